"""`PostCleanupPass`: sort the graph and drop dead nodes after the custom passes (vLLM's
passes/utility/post_cleanup.py). The pattern matcher may leave a graph out of topological order,
and replaced nodes' inputs unused; it runs before the IR lowering (so no dead IR op is lowered)
and after it (so the lowering's leftovers go). Dead-code elimination keeps a node that mutates
(fx's is_impure), so an in-place call the lowering inserted survives it."""

from __future__ import annotations

from torch import fx

from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass


class PostCleanupPass(VllmInductorPass):
    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.eliminate_dead_code()
