"""compilation_counter: what the compiler did, counted (vLLM's compilation/counter.py). Tests and
notebooks assert structure with these numbers instead of reading logs:

    with compilation_counter.expect(num_graphs_seen=1):    # vLLM's: assert the change of a block
        lm(ids, pos)
    before = compilation_counter.clone()                   # this project's: read the change
    lm(ids, pos)
    moved = compilation_counter.since(before)              # {"num_graphs_seen": 1, ...}
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_graphs_seen: int = 0  # Dynamo graphs handed to VllmBackend (VLLM_COMPILE only, as in vLLM)
    num_piecewise_graphs_seen: int = 0  # submodules after split, splitting ops included
    num_piecewise_capturable_graphs_seen: int = 0  # submodules that get compiled
    # CompilerManager.compile calls: a piece for one size or range
    num_backend_compilations: int = 0
    num_inductor_compiles: int = 0  # Inductor adaptor compile calls, identical pieces included
    num_eager_compiles: int = 0  # eager adaptor compile calls
    num_cache_entries_updated: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    num_aot_compiles: int = 0
    num_aot_artifacts_saved: int = 0
    num_aot_artifacts_loaded: int = 0
    stock_torch_compile_count: int = 0
    # a graph (or the CPU stand-in's buffers) per wrapper and descriptor
    num_cudagraph_captured: int = 0
    # this project's own, not in vLLM. vLLM hands a string backend ("inductor") to torch.compile
    # under STOCK_TORCH_COMPILE and DYNAMO_TRACE_ONCE, so none of its counters above sees those
    # traces; and its Inductor adaptor counts a piece identical to an earlier one before finding
    # the earlier one's artifact (AOTAutograd's cache key), so L identical layers count L + 1.
    num_dynamo_traces: int = 0  # Dynamo graphs handed to any backend of ours, in every mode
    # compiles that ran, in every mode (an identical piece reuses the first)
    num_unique_compiles: int = 0

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    def since(self, before: CompilationCounter) -> CounterDelta:
        """How much each counter moved since `before` (a `clone()` taken earlier). vLLM has only
        `expect`, which asserts; this reads the change, to print it or to assert on it after."""
        if not isinstance(before, CompilationCounter):
            raise TypeError(f"since() takes the counter's clone() from before the block, not "
                            f"{type(before).__name__}: before = compilation_counter.clone()")
        return CounterDelta({f.name: getattr(self, f.name) - getattr(before, f.name)
                             for f in dataclasses.fields(self)
                             if getattr(self, f.name) != getattr(before, f.name)})

    @contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly its delta (others: any)."""
        unknown = set(deltas) - FIELDS
        if unknown:
            raise ValueError(f"compilation_counter has no field(s) {sorted(unknown)}")
        before = self.clone()
        yield
        moved = self.since(before)
        wrong = {k: (moved[k], d) for k, d in deltas.items() if moved[k] != d}
        assert not wrong, "compilation_counter changed by (got, expected): " + ", ".join(
            f"{k}: {got} != {want}" for k, (got, want) in wrong.items())


FIELDS = frozenset(f.name for f in dataclasses.fields(CompilationCounter))


class CounterDelta(dict[str, int]):
    """The counters that moved, by how much (`since`). It lists only those, so it prints short
    and equals {} when nothing moved; a counter that did not move reads 0, and a name that is no
    counter raises KeyError, so a misspelt name cannot pass for "did not move"."""

    def __missing__(self, name: str) -> int:
        if name in FIELDS:
            return 0
        raise KeyError(f"compilation_counter has no field {name!r}")


compilation_counter = CompilationCounter()
