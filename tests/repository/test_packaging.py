"""The install story: environment.yml names what pyproject names; kernels/
ships inside the package."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted |= {_name(r) for r in extra}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {_name(r) for r in pip_section if not r.startswith("-e")}
    assert listed == wanted, (f"only in pyproject: {wanted - listed}; only in "
                              f"environment.yml: {listed - wanted}")
    conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)}
    assert {"python", "pip", "graphviz"} <= conda


def test_kernels_ship_inside_the_package_not_as_a_top_level_module():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert project["package-dir"] == {"minivllm_compile.kernels": "kernels"}
    assert "kernels" not in project["packages"]
    import minivllm_compile.kernels.layernorm as layernorm

    assert Path(layernorm.__file__).parent.name == "kernels"
    # every subpackage on disk is listed, or a non-editable install would lack it
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "minivllm_compile").rglob("__init__.py")}
    assert on_disk | {"minivllm_compile.kernels"} == set(project["packages"])


def test_shipped_checkpoints_are_small_and_have_a_loss_curve():
    from minivllm_compile.models import CHECKPOINTS, SHIPPED

    for name in SHIPPED:
        folder = CHECKPOINTS / name
        assert (folder / "model.safetensors").stat().st_size <= 16 * 2**20
        for f in ("config.json", "loss.png", "training_log.json"):
            assert (folder / f).is_file(), f"{name}/{f}"


@pytest.mark.compiles
def test_a_warm_start_does_not_import_the_pattern_matcher():
    """A warm start computes the AOT key; with the fusion passes off (the default) that must not
    import Inductor's pattern matcher (and its lowerings): about a second of a warm start."""
    import subprocess
    import sys

    code = ("import sys; from minivllm_compile import CompilationConfig; "
            "from minivllm_compile.compilation import cache_keys; "
            "from minivllm_compile.models import build_model; "
            "cache_keys.aot_cache_key(build_model('llama', num_layers=1).model, "
            "CompilationConfig()); "
            "print('torch._inductor.pattern_matcher' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
