"""run.py's torch install: the pip command it builds, with MINIVLLM_TORCH_SPEC and
MINIVLLM_TORCH_INDEX_URL (pip is mocked: nothing is installed)."""

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_py(monkeypatch, tmp_path):
    """run.py as a module, with pip recorded instead of run, torch missing and everything else
    present (triton, and this package installed from the current pyproject.toml)."""
    spec = importlib.util.spec_from_file_location("run_py_under_test", ROOT / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module, "sh", lambda *cmd: calls.append(list(cmd)))
    monkeypatch.setattr(module, "has", lambda name: name != "torch")
    stamp = tmp_path / "stamp"
    stamp.write_text(hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest())
    monkeypatch.setattr(module, "install_stamp", lambda: stamp)
    monkeypatch.delenv("MINIVLLM_TORCH_SPEC", raising=False)
    monkeypatch.delenv("MINIVLLM_TORCH_INDEX_URL", raising=False)
    module.calls = calls
    return module


def _pip_installs(calls):
    prefix = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    assert all(c[:len(prefix)] == prefix for c in calls), calls
    return [c[len(prefix):] for c in calls]


def test_default_torch_comes_from_the_default_index(run_py):
    run_py.ensure_installed()
    assert _pip_installs(run_py.calls) == [["torch==2.13.0"]]


def test_index_url_is_passed_to_the_torch_install_only(run_py, monkeypatch):
    monkeypatch.setenv("MINIVLLM_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    monkeypatch.setenv("MINIVLLM_TORCH_SPEC", "torch==2.12.1")
    monkeypatch.setattr(run_py, "has", lambda name: name not in ("torch", "minivllm_compile"))
    monkeypatch.setattr(run_py.platform, "system", lambda: "Darwin")  # no triton step
    run_py.ensure_installed()
    torch_call, package_call = _pip_installs(run_py.calls)
    assert torch_call == ["torch==2.12.1", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert "--index-url" not in package_call and package_call[-1].endswith("[test,notebooks]")


def test_an_empty_index_url_is_no_index_url(run_py, monkeypatch):
    monkeypatch.setenv("MINIVLLM_TORCH_INDEX_URL", "  ")
    assert run_py.torch_pip_args() == ["torch==2.13.0"]


def test_nothing_is_installed_when_torch_is_there(run_py, monkeypatch):
    monkeypatch.setenv("MINIVLLM_TORCH_INDEX_URL", "https://download.pytorch.org/whl/cpu")
    monkeypatch.setattr(run_py, "has", lambda name: True)
    run_py.ensure_installed()
    assert run_py.calls == []


def test_the_whole_suite_runs_a_worker_per_core_up_to_four(run_py, monkeypatch):
    monkeypatch.delenv("MINIVLLM_TEST_WORKERS", raising=False)
    in_order = ["--dist", "loadfile", "--no-loadscope-reorder"]  # a file each, conftest's order
    for cores, workers in ((1, []), (2, ["-n", "2", *in_order]), (16, ["-n", "4", *in_order])):
        monkeypatch.setattr(run_py.os, "cpu_count", lambda cores=cores: cores)
        assert run_py.test_workers() == workers
    monkeypatch.setenv("MINIVLLM_TEST_WORKERS", "1")  # one process: no xdist
    assert run_py.test_workers() == []
    monkeypatch.setenv("MINIVLLM_TEST_WORKERS", "3")
    assert run_py.test_workers() == ["-n", "3", *in_order]
    monkeypatch.setenv("MINIVLLM_TEST_WORKERS", "two")
    with pytest.raises(SystemExit, match="MINIVLLM_TEST_WORKERS must be a whole number.*got 'two'"):
        run_py.test_workers()
