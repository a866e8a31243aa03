"""The trained checkpoints: ours agrees with models no one here wrote, and the
text looks like Python."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minivllm_compile.models import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def hybrid():
    return load_model("tiny-hybrid")


def _sample_ids(n=97):
    text = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 2
    return torch.tensor([256, *text.encode()][:n])


def test_transformers_llama_gives_the_same_logits(llama):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(llama.checkpoint_dir,
                                                       torch_dtype=torch.float32)
    hf.eval()
    ids = _sample_ids()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = llama(ids, torch.arange(len(ids)))
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4, f"max |ours - transformers| = {diff}"


def test_training_model_gives_the_same_logits_for_the_hybrid(hybrid):
    """The hybrid has no transformers class; compare against the plain-torch
    model it was trained as."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    cfg = json.loads((hybrid.checkpoint_dir / "config.json").read_text())
    ref = train_tiny.TrainLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(
        load_file(hybrid.checkpoint_dir / "model.safetensors"), strict=False)
    assert not unexpected and all(".mixer." in k for k in missing)  # `mixer` aliases conv/self_attn
    ids = _sample_ids()
    with torch.no_grad():
        want = ref(ids[None])[0]
    got = hybrid(ids, torch.arange(len(ids)))
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4, f"max |ours - training model| = {diff}"


PYTHONISH = re.compile(r"\b(def|return|self|import|if|for|in|None|class|raise|else)\b")


@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_greedy_text_looks_like_python(name, llama, hybrid):
    lm = llama if name == "llama" else hybrid
    out = lm.generate(["def __init__(self, name):\n", "import os\n"], max_new_tokens=80)
    assert any("\n    " in text for text in out), out  # indented blocks
    for text in out:
        assert "\n" in text, text  # lines
        assert len(PYTHONISH.findall(text)) >= 2, text
        printable = sum(c.isprintable() or c in "\n\t" for c in text) / max(len(text), 1)
        assert printable > 0.95, text


def _edited_checkpoint(tmp_path, text: str) -> Path:
    """A copy of tiny-llama whose config.json holds `text`."""
    src = load_model.__globals__["CHECKPOINTS"] / "tiny-llama"
    (tmp_path / "model.safetensors").symlink_to(src / "model.safetensors")
    (tmp_path / "config.json").write_text(text)
    return tmp_path


def _with(**changes) -> str:
    cfg = json.loads((load_model.__globals__["CHECKPOINTS"] / "tiny-llama"
                      / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    return json.dumps(cfg)


@pytest.mark.parametrize("text, match", [
    ("", "not valid JSON"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_with(hidden_size=None), r"missing \['hidden_size'\]"),
    (_with(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (_with(hidden_size="192"), "hidden_size must be a positive integer, got '192'"),
    (_with(rms_norm_eps=0), "rms_norm_eps must be a positive number, got 0"),
    (_with(rms_norm_eps=-1e-5), "rms_norm_eps must be a positive number"),
    (_with(rope_theta=0), "rope_theta must be a positive number, got 0"),
    (_with(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
])
def test_a_bad_config_json_is_refused_naming_the_file_and_field(tmp_path, text, match):
    """Each of these used to give a JSONDecodeError, KeyError or ZeroDivisionError with no path, or
    loaded and produced NaN (eps or theta of 0)."""
    path = _edited_checkpoint(tmp_path, text)
    with pytest.raises(ValueError, match=match) as e:
        load_model(path)
    assert str(path / "config.json") in str(e.value)
