"""A damaged model.safetensors is refused naming the file and what is wrong with it (the safetensors
library says only "Error while deserializing header: ...", without the file)."""

from __future__ import annotations

import re
import shutil

import pytest

from minivllm_compile.models import CHECKPOINTS, load_model

SRC = CHECKPOINTS / "tiny-llama"


def _damaged(data: bytes) -> dict[str, tuple[bytes, str]]:
    n = int.from_bytes(data[:8], "little")
    return {
        "empty": (b"", "it holds 0 bytes, fewer than the 8 that give the header's length"),
        "cut in the header": (data[:8 + n // 2], rf"header of {n} bytes but only {n // 2} follow"),
        "cut in the data": (data[:len(data) // 2], r"tensor data but the file holds .*truncated"),
        "a flipped header byte": (data[:20] + bytes([data[20] ^ 0x55]) + data[21:],
                                  "header is not valid JSON"),
        "trailing bytes": (data + b"junk", "it has 4 bytes after the last tensor its header lists"),
        "not safetensors": (b'{"model_type": "llama"}\n', r"give a header of \d+ bytes but only"),
    }


@pytest.mark.parametrize("case", ["empty", "cut in the header", "cut in the data",
                                  "a flipped header byte", "trailing bytes", "not safetensors"])
def test_a_damaged_checkpoint_names_the_file_and_the_damage(case, tmp_path):
    data, why = _damaged((SRC / "model.safetensors").read_bytes())[case]
    shutil.copy(SRC / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    path = tmp_path / "model.safetensors"
    assert msg.startswith(f"{path} is not a readable safetensors file: "), msg
    assert re.search(why, msg), msg
    assert "download it again" in msg, msg
