"""The package's log lines, as vLLM's logger.py sets them up (VLLM_CONFIGURE_LOGGING=1, the default,
at VLLM_LOGGING_LEVEL, INFO unless set): the "minivllm_compile" logger gets its own handlers, so a
compile's progress shows in a terminal and in a notebook's output without configuring logging.

INFO and DEBUG go to stdout (a notebook shows them as plain output, vLLM also logs to stdout);
WARNING and above to stderr, where Python's own last-resort handler would put them (tests and
scripts read warnings there). The records still propagate to the root logger, so pytest's caplog
and an application's own handlers see them too.
"""

from __future__ import annotations

import logging
import sys

from minivllm_compile import envs

# vLLM's, without the pid
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_DATEFMT = "%m-%d %H:%M:%S"


class _Below(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _Stream(logging.StreamHandler):
    """Looks up sys.stdout / sys.stderr at each record: a notebook kernel
    and pytest replace them."""

    def __init__(self, name: str):
        super().__init__()
        self.name_of_stream = name

    @property
    def stream(self):  # noqa: D401  (StreamHandler reads self.stream)
        return getattr(sys, self.name_of_stream)

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure() -> None:
    """Give the package's logger its handlers, once (a re-import or a second call adds none)."""
    if not envs.VLLM_CONFIGURE_LOGGING:
        return
    log = logging.getLogger("minivllm_compile")
    if any(getattr(h, "_minivllm", False) for h in log.handlers):
        return
    log.setLevel(envs.VLLM_LOGGING_LEVEL)
    formatter = logging.Formatter(_FORMAT, _DATEFMT)
    out, err = _Stream("stdout"), _Stream("stderr")
    out.addFilter(_Below(logging.WARNING))
    err.setLevel(logging.WARNING)
    for h in (out, err):
        h.setFormatter(formatter)
        h._minivllm = True
        log.addHandler(h)
