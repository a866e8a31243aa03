"""`VllmInductorPass`: an InductorPass with the pass config, timing, and a graph record
(vLLM's passes/vllm_inductor_pass.py). vLLM writes the before/after graphs to TORCH_LOGS; here they
go into a list the pass manager owns, so a notebook can print the post-grad graph at every stage.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import ClassVar

from torch import fx

from minivllm_compile.compilation.passes.inductor_pass import InductorPass, graph_text
from minivllm_compile.config import PassConfig

logger = logging.getLogger(__name__)

Records = list[tuple[str, str]]  # (stage name, graph source), in the order they happened


class VllmInductorPass(InductorPass):
    def __init__(self, pass_config: PassConfig | None = None, records: Records | None = None):
        self.pass_config = pass_config or PassConfig()
        self.pass_name = type(self).__name__
        # bound by PostGradPassManager to its own list; None records nothing
        self.records: Records | None = records
        self.dump_prefix: int | None = None  # position in the manager's pipeline
        self.duration_ms = 0.0

    @staticmethod
    def time_and_log(call_fn: Callable[[VllmInductorPass, fx.Graph], None]):
        """Decorate a pass's __call__: record the graph before and after it, and time it."""

        @functools.wraps(call_fn)
        def wrapped(self: VllmInductorPass, graph: fx.Graph) -> None:
            self.begin()
            self.dump_graph(graph, "before")
            call_fn(self, graph)
            self.dump_graph(graph, "after")
            self.end_and_log()

        return wrapped

    def stage_name(self, stage: str) -> str:
        i = "" if self.dump_prefix is None else f".{self.dump_prefix}"
        return f"post_grad{i}.{self.pass_name}.{stage}"

    def dump_graph(self, graph: fx.Graph, stage: str) -> None:
        if self.records is not None:
            self.records.append((self.stage_name(stage), graph_text(graph)))

    def begin(self) -> None:
        self._start = time.perf_counter()

    def end_and_log(self) -> None:
        self.duration_ms = (time.perf_counter() - self._start) * 1e3
        logger.debug("%s completed in %.1f ms", self.pass_name, self.duration_ms)


class VllmPatternMatcherPass(VllmInductorPass):
    """A VllmInductorPass built on Inductor's pattern matcher (torch._inductor.pattern_matcher):
    the subclass registers replacements into a PatternMatcherPass and sets `matched_count` on
    every call, which vLLM logs and its tests assert on."""

    matched_count: int = 0  # matches replaced by the latest call
    # every pass's matches, summed over all calls in this process (vLLM: match_table)
    match_table: ClassVar[Counter[str]] = Counter()

    def record_matches(self, count: int) -> None:
        self.matched_count = count
        VllmPatternMatcherPass.match_table[self.pass_name] += count
        logger.debug("%s replaced %d matches", self.pass_name, count)
