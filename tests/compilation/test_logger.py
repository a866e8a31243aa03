"""The package's log lines (logger.py): configured once, INFO to stdout and warnings to stderr, and
a progress line per piece and range Inductor compiles."""

import logging

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode, envs
from minivllm_compile.logger import configure
from minivllm_compile.models import build_model

log = logging.getLogger("minivllm_compile")


def test_configured_once_info_to_stdout_warnings_to_stderr(capsys):
    n = len(log.handlers)
    configure()  # the import configured it already: nothing added
    assert len(log.handlers) == n == 2 and log.level == logging.INFO
    log.info("a progress line")
    log.warning("a warning")
    out, err = capsys.readouterr()
    assert "INFO" in out and "a progress line" in out and "a warning" not in out
    assert "WARNING" in err and "a warning" in err and "a progress line" not in err


def test_a_bad_logging_level_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "loud")
    with pytest.raises(ValueError, match="VLLM_LOGGING_LEVEL='loud' is not a level"):
        envs.VLLM_LOGGING_LEVEL


@pytest.mark.compiles
def test_a_line_per_piece_and_range_inductor_compiles(caplog):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[4],
                           max_num_batched_tokens=8)
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    with caplog.at_level(logging.INFO, logger="minivllm_compile"):
        lm(torch.arange(5), torch.arange(5))
    lines = [r.getMessage() for r in caplog.records if "Compiled piece" in r.getMessage()]
    # 1 layer: 2 compiled pieces (around the attention) x 2 entries (size 4, range [1, 8])
    assert len(lines) == 4, lines
    assert any(line.startswith("[backbone] Compiled piece 1 for compile range "
                               "Range(4, 4) with inductor") for line in lines)
    assert all(line.endswith(" s") for line in lines)

