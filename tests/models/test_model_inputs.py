"""What lm(...) and lm.generate(...) accept, and how they refuse the rest (models/inputs.py).

An out-of-vocabulary id used to abort a compiled model's process (SIGABRT from Inductor's bounds
check inside an OpenMP region); it must raise instead, naming the id and the vocabulary size, and
leave the model usable. That one runs in a fresh process, since an abort would take pytest down.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm_compile.models import build_model, load_model

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lm():
    return build_model("llama", num_layers=1)


def test_an_out_of_vocabulary_id_raises_in_a_compiled_model_instead_of_aborting(tmp_path):
    child = textwrap.dedent("""
        import torch
        from minivllm_compile import CompilationConfig, CompilationMode
        from minivllm_compile.models import build_model

        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=32)
        lm = build_model("llama", num_layers=1, compilation_config=cc)
        lm.warmup()
        good = lm(torch.tensor([1, 2, 3]), torch.arange(3))
        for ids in (torch.tensor([1, 258, 3]), [5, -1]):
            try:
                lm(ids, torch.arange(len(ids)))
            except ValueError as e:
                print("REFUSED:", e)
        # the compiled decoder called straight, as a notebook may: its own check
        from minivllm_compile.forward_context import set_forward_context
        def raw(ids, pos):
            with torch.inference_mode(), set_forward_context(None, lm.model.static_forward_context):
                return lm.model(ids, pos)
        for ids, pos in ((torch.tensor([1, 300, 3]), torch.arange(3)),
                         (torch.tensor([1, 2]), torch.tensor([0, 10**6]))):
            try:
                raw(ids, pos)
            except ValueError as e:
                print("MODEL REFUSED:", e)
        # a weight changed after the compile: another dtype, then a strided copy
        proj = lm.model.layers[0].self_attn.o_proj
        weight = proj.weight
        for changed in (weight.detach().half(), weight.detach().t().contiguous().t()):
            proj.weight = torch.nn.Parameter(changed, requires_grad=False)
            try:
                raw(torch.tensor([1, 2, 3]), torch.arange(3))
            except RuntimeError as e:
                print("CHANGED:", " ".join(str(e).splitlines()))
        proj.weight = weight
        # nothing lost: the model still runs, and gives what it gave before
        print("SAME AFTER:", torch.equal(lm(torch.tensor([1, 2, 3]), torch.arange(3)), good))
    """)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 0, f"the process died (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "REFUSED: token id 258 is out of vocabulary" in out and "vocab_size=258" in out, out
    assert "REFUSED: token id -1 is out of vocabulary" in out, out
    # lm.model(...) straight: LlamaModel.check_input_values, before the compiled code runs
    assert "MODEL REFUSED: token id 300 is out of vocabulary" in out, out
    assert "MODEL REFUSED: positions holds 1000000" in out and "max_position_embeddings" in out, out
    # a parameter changed after the compile is named, with what changed (it failed in Inductor's
    # stride assertion, or in a matmul's dtype check, blaming neither the model nor the change)
    changed = [line for line in out.splitlines() if line.startswith("CHANGED:")]
    assert len(changed) == 2, out
    for line, what in zip(changed, ("torch.float32, now torch.float16",
                                    "strides (96, 1), now (1, 96)")):
        assert "LlamaModel changed after it was compiled" in line and what in line, line
        assert "layers.0.self_attn.o_proj.weight" in line, line
    assert "SAME AFTER: True" in out, out


def test_a_vocabulary_smaller_than_the_byte_tokenizers_is_refused_at_load(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=200 is smaller than the byte tokenizer"):
        build_model("llama", num_layers=1, vocab_size=200)
    # a checkpoint folder: the error names its config.json
    src = load_model("tiny-llama").checkpoint_dir
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] = 200
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:200].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: vocab_size=200 is smaller"):
        load_model(tmp_path)


def test_lists_and_any_integer_dtype_are_taken_as_token_ids(lm):
    ids, pos = [256, 100, 101, 102], [0, 1, 2, 3]
    want = lm(torch.tensor(ids), torch.tensor(pos))
    assert torch.equal(lm(ids, pos), want)
    assert torch.equal(lm(tuple(ids), tuple(pos)), want)
    small = torch.tensor([100, 101, 102], dtype=torch.uint8)  # bytes, as torch.frombuffer gives
    want = lm([100, 101, 102], [0, 1, 2])
    assert torch.equal(lm(small, torch.arange(3, dtype=torch.int16)), want)


@pytest.mark.parametrize("ids,pos,error,match", [
    (torch.tensor([1.0, 2.0]), [0, 1], ValueError,
     r"must be an integer tensor .*got torch.float32: pass input_ids.long\(\) if they are whole"),
    (torch.tensor([True, False]), [0, 1], ValueError, r"got torch.bool: pass input_ids.long\(\)"),
    ([1, 2.5], [0, 1], ValueError, "input_ids must be an integer tensor"),
    ("hello", [0], TypeError, r"input_ids is a str, not token ids: encode the text first"),
    (b"hello", [0], TypeError, r"input_ids is a bytes, not token ids"),
    ([1, None], [0, 1], TypeError, r"input_ids must be a 1-D tensor of integers or a list of ints"),
    ([[1, 2]], [[0, 1]], ValueError, "1-D"),
    ([], [], ValueError, "input_ids is empty"),
    ([1, 999], [0, 1], ValueError, r"token id 999 is out of vocabulary: input_ids must lie in \[0"),
    ([1, 2], [0, 600], ValueError, (r"positions holds 600: positions must lie in \[0, 512\) for "
                                    r"this model's max_position_embeddings=512")),
])
def test_bad_token_ids_are_refused_naming_what_to_pass(lm, ids, pos, error, match):
    with pytest.raises(error, match=match):
        lm(ids, pos)


def test_generate_takes_an_empty_list_and_any_sequence_of_strings(lm):
    assert lm.generate([], 3) == []
    assert lm.generate(("def", "x ="), 3) == lm.generate(["def", "x ="], 3)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"prompts": "def"}, TypeError, "prompts must be a list of strings; wrap a single prompt in a"),
    ({"prompts": b"def"}, TypeError, "prompts must be a list of strings"),
    ({"prompts": None}, TypeError, "prompts must be a list of strings, got NoneType"),
    ({"prompts": ["ok", b"def"]}, TypeError, (r"prompts\[1\] is bytes, but prompts are text: pass "
                                              r"prompts\[1\].decode\('utf-8'\)")),
    ({"prompts": [[256, 100]]}, TypeError, r"prompts\[0\] is a list, not a string; to run token"),
    ({"temperature": math.nan}, ValueError, "temperature must be a finite number >= 0 .*got nan"),
    ({"temperature": math.inf}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": "0.7"}, ValueError, "temperature must be a finite number"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1, got 0"),
    ({"max_new_tokens": 2.5}, ValueError, "max_new_tokens must be an int >= 1, got 2.5"),
    ({"seed": None}, TypeError, "seed must be an int, got None"),
])
def test_bad_generate_arguments_are_refused_naming_what_to_pass(lm, kwargs, error, match):
    args = {"prompts": ["def"], "max_new_tokens": 3} | kwargs
    with pytest.raises(error, match=match):
        lm.generate(**args)


def test_numpy_numbers_are_taken_as_generate_arguments(lm):
    np = pytest.importorskip("numpy")
    want = lm.generate(["def"], 3, temperature=0.5, seed=7)
    assert lm.generate(["def"], np.int64(3), temperature=np.float32(0.5), seed=np.int64(7)) == want
