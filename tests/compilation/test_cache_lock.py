"""The compile cache's lock (cache_files.locked) is held by another live process: a waiting compile
says who holds it after a few seconds, and gives up after MINIVLLM_CACHE_LOCK_TIMEOUT_S with an
error naming the holder and what to do. The holder is a real process holding a real flock."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from minivllm_compile import envs
from minivllm_compile.compilation.cache_files import lock_holder, locked

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from pathlib import Path
from minivllm_compile.compilation.cache_files import locked
with locked(Path(sys.argv[1])):
    Path(sys.argv[2]).write_text("held")
    sys.stdin.readline()  # until the test closes stdin (or dies, which closes it too)
"""


def wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)


def take_lock(directory: Path, within: float = 60) -> BaseException | None:
    """locked(directory) in a thread that may wait at most `within` seconds (the old lock waited
    for ever): what it raised, or None once it got the lock."""
    outcome: list[BaseException | None] = []

    def take() -> None:
        try:
            with locked(directory):
                pass
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            outcome.append(e)

    t = threading.Thread(target=take, daemon=True)
    t.start()
    t.join(timeout=within)
    assert outcome, f"still waiting for the lock after {within} s"
    return outcome[0]


@pytest.mark.compiles
def test_a_held_lock_is_named_then_given_up_on_then_taken_once_free(tmp_path, monkeypatch, caplog):
    directory, flag = tmp_path / "model", tmp_path / "held"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(flag)], env=env,
                              stdin=subprocess.PIPE, text=True)
    try:
        wait_for(flag, 120)
        monkeypatch.setenv("MINIVLLM_CACHE_LOCK_TIMEOUT_S", "2")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="minivllm_compile"):
            error = take_lock(directory)
        assert isinstance(error, TimeoutError) and 2 <= time.monotonic() - started < 30, error
        msg = str(error)
        assert f"held by pid {holder.pid} on " in msg and "gave up after 2 s" in msg, msg
        assert "MINIVLLM_CACHE_LOCK_TIMEOUT_S" in msg and "VLLM_DISABLE_COMPILE_CACHE=1" in msg, msg
        # logged before giving up (after min(5 s, half the timeout)), naming the holder too
        waits = [r.getMessage() for r in caplog.records
                 if "waiting for the compile cache lock" in r.getMessage()]
        assert len(waits) == 1 and f"pid {holder.pid}" in waits[0], caplog.text

        # once the holder lets go, the lock is taken, and no one is named any more
        monkeypatch.setenv("MINIVLLM_CACHE_LOCK_TIMEOUT_S", "60")
        holder.stdin.close()
        assert take_lock(directory) is None
        with locked(directory):
            assert f"pid {os.getpid()} " in lock_holder(directory / ".lock")
        assert holder.wait(timeout=60) == 0
        assert "did not say which" in lock_holder(directory / ".lock")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)


@pytest.mark.compiles
def test_a_record_left_by_a_killed_holder_is_not_believed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60, check=True)
    pid = int(dead.stdout)
    record = {"pid": pid, "host": socket.gethostname(), "since": 0}
    (tmp_path / ".lock").write_text(json.dumps(record))
    assert lock_holder(tmp_path / ".lock") == \
        f"another process (the last one recorded, pid {pid}, has exited)"


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_a_bad_lock_timeout_is_refused_naming_the_switch(monkeypatch, raw):
    monkeypatch.setenv("MINIVLLM_CACHE_LOCK_TIMEOUT_S", raw)
    match = rf"MINIVLLM_CACHE_LOCK_TIMEOUT_S='{raw}' is not a number of seconds"
    with pytest.raises(ValueError, match=match):
        _ = envs.MINIVLLM_CACHE_LOCK_TIMEOUT_S
