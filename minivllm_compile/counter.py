"""compilation_counter: what the compiler did, counted (vLLM's compilation/counter.py). Tests and
notebooks assert structure with these numbers instead of reading logs."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from typing import Iterator


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_graphs_seen: int = 0  # Dynamo graphs handed to VllmBackend (VLLM_COMPILE only, as in vLLM)
    num_piecewise_graphs_seen: int = 0  # submodules after split, splitting ops included
    num_piecewise_capturable_graphs_seen: int = 0  # submodules that get compiled
    num_backend_compilations: int = 0  # CompilerManager.compile calls: a piece for one size or range
    num_inductor_compiles: int = 0  # Inductor adaptor compile calls, identical pieces included
    num_eager_compiles: int = 0  # eager adaptor compile calls
    num_cache_entries_updated: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    num_aot_compiles: int = 0
    num_aot_artifacts_saved: int = 0
    num_aot_artifacts_loaded: int = 0
    stock_torch_compile_count: int = 0
    num_cudagraph_captured: int = 0  # a graph (or the CPU stand-in's buffers) per wrapper and descriptor
    # this project's own, not in vLLM. vLLM hands a string backend ("inductor") to torch.compile
    # under STOCK_TORCH_COMPILE and DYNAMO_TRACE_ONCE, so none of its counters above sees those
    # traces; and its Inductor adaptor counts a piece identical to an earlier one before finding
    # the earlier one's artifact (AOTAutograd's cache key), so L identical layers count L + 1.
    num_dynamo_traces: int = 0  # Dynamo graphs handed to any backend of ours, in every mode
    num_unique_compiles: int = 0  # compiles that ran, in every mode (an identical piece reuses the first)

    def clone(self) -> "CompilationCounter":
        return copy.deepcopy(self)

    @contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly its delta (others: any)."""
        unknown = set(deltas) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"compilation_counter has no field(s) {sorted(unknown)}")
        before = self.clone()
        yield
        wrong = {k: (getattr(self, k) - getattr(before, k), d) for k, d in deltas.items()
                 if getattr(self, k) - getattr(before, k) != d}
        assert not wrong, "compilation_counter changed by (got, expected): " + ", ".join(
            f"{k}: {got} != {want}" for k, (got, want) in wrong.items())


compilation_counter = CompilationCounter()
