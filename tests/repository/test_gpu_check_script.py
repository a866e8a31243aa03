"""scripts/gpu_check.sh runs once, in a later session, on a lent GPU with no second try: what can
be checked of it here is checked here."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.compiles
def test_the_gpu_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.compiles
def test_gpu_check_refuses_a_time_scale_it_cannot_use(tmp_path):
    env = {**os.environ, "GPU_CHECK_TIME_SCALE": "1.5"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env,
                          capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert (proc.returncode == 2 and "GPU_CHECK_TIME_SCALE must be a positive integer, got "
                                     "'1.5'" in proc.stderr)
