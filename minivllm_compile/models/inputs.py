"""What `lm(...)` and `lm.generate(...)` accept, checked before anything runs.

Each refusal names the argument, what was wrong and what to pass instead. Token ids matter most: a
compiled decoder looks them up in its embedding inside Inductor's generated code, whose bounds
check throws inside an OpenMP region, so an id past the vocabulary aborts the whole process
(SIGABRT) instead of raising. vLLM refuses such ids before the model too ("Token id ... is out of
vocabulary", InputProcessor._validate_model_input in vllm/v1/engine/input_processor.py).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

# the integer dtypes ids and positions may come in; they are converted to int64, what the compiled
# decoder was traced with (the unsigned 16/32/64-bit dtypes lack min/max on some torch builds)
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def as_id_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A tensor as it is; a list or tuple of ints (or a numpy array) as a tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} is a {type(value).__name__}, not token ids: encode the text first "
                        f"(ids = lm.tokenizer.encode(text)) and pass torch.tensor(ids)")
    try:
        return torch.as_tensor(value, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must be a 1-D tensor of integers or a list of ints, got "
                        f"{type(value).__name__} ({e})") from None


def check_ids(name: str, t: torch.Tensor, upper: int, what: str) -> None:
    """Every value of the integer tensor `t` in [0, upper), or a ValueError naming the first bad
    one and `what` (the config field that sets `upper`). One aminmax: a few microseconds on a CPU,
    one host sync on a GPU."""
    lo, hi = (int(v) for v in torch.aminmax(t))
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        which = (f"token id {bad} is out of vocabulary" if name == "input_ids"
                 else f"{name} holds {bad}")
        raise ValueError(f"{which}: {name} must lie in [0, {upper}) for this model's "
                         f"{what}={upper}, got [{lo}, {hi}]")


def check_prefill_inputs(input_ids: Any, positions: Any, cfg, device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """lm(input_ids, positions)'s arguments, refused with a reason or returned as contiguous int64
    tensors on `device` (what the compiled decoder's one trace saw, as in vLLM)."""
    input_ids = as_id_tensor("input_ids", input_ids, device)
    positions = as_id_tensor("positions", positions, device)
    if input_ids.dim() != 1 or positions.dim() != 1 or input_ids.shape != positions.shape:
        raise ValueError(f"input_ids and positions must be 1-D of the same length (num_tokens), "
                         f"got {tuple(input_ids.shape)} and {tuple(positions.shape)}")
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: give at least one token")
    for name, t, upper, what in (("input_ids", input_ids, cfg.vocab_size, "vocab_size"),
                                 ("positions", positions, cfg.max_position_embeddings,
                                  "max_position_embeddings")):
        if t.dtype not in ID_DTYPES:
            fix = f"pass {name}.long()"
            if t.dtype.is_floating_point:
                fix += " if they are whole numbers"
            raise ValueError(f"{name} must be an integer tensor (int64, int32, int16, int8 or "
                             f"uint8), got {t.dtype}: {fix}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model is on {device}: pass "
                             f"{name}.to({str(device)!r})")
        check_ids(name, t, upper, what)
    return input_ids.long().contiguous(), positions.long().contiguous()


def check_generate_args(prompts: Any, max_new_tokens: Any, temperature: Any,
                        seed: Any) -> tuple[list[str], int, float, int]:
    """generate()'s arguments, refused with a reason, or returned as plain Python values (any
    iterable of strings is taken as the prompts; an empty one gives an empty result)."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of strings; wrap a single prompt in a list")
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a list of strings, got "
                        f"{type(prompts).__name__}") from None
    for i, p in enumerate(prompts):
        if isinstance(p, bytes):
            raise TypeError(f"prompts[{i}] is bytes, but prompts are text: pass "
                            f"prompts[{i}].decode('utf-8') (the tokenizer turns text into bytes "
                            "itself)")
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] is a {type(p).__name__}, not a string; to run token "
                            "ids, call lm(input_ids, positions)")
    # numbers.Integral: numpy's integers too; bool is an int, but never meant as a count
    if (not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool)
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
            or not math.isfinite(temperature) or temperature < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                         f"{temperature!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return prompts, int(max_new_tokens), float(temperature), int(seed)
