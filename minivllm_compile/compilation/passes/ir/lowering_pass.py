"""`VllmIRLoweringPass`: every IR op node -> the implementation its priority picks
(vLLM 0.34's compilation/passes/ir/lowering_pass.py).

It runs after the fusion passes, which match the IR ops while they are still one node each. For a
node it asks the op's `dispatch` (with the node's fake tensors, so `supports_args` sees the real
dtypes and shapes) and replaces the node by a trace of that provider's `func_impl_fn`:
`Match.replace_by_example`, Inductor's pattern-matcher tool. A native provider becomes plain aten
ops Inductor fuses into its neighbours; a custom-op provider becomes one call. An in-place provider
is traced writing into copies of its activations; UnsafeCloneEliminationPass removes the copies it
can. Functional clean-up (dead-code elimination) is not run on the replacement: it may mutate.

The priority is the pass's own (the config's, given at construction), entered for each call; vLLM
reads the process-wide one its worker set. Both, and the source of each implementation, are in
the uuid: a change must not hit kernels lowered under the old ones.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from torch import fx

from minivllm_compile.compilation.passes.ir.utils import get_ir_op
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass
from minivllm_compile.ir.op import IrOp

if TYPE_CHECKING:
    from minivllm_compile.config.kernel import IrOpPriorityConfig

logger = logging.getLogger(__name__)


class VllmIRLoweringPass(VllmInductorPass):
    def __init__(
        self, pass_config=None, records=None, ir_op_priority: IrOpPriorityConfig | None = None
    ):
        super().__init__(pass_config, records)
        self.ir_op_priority = ir_op_priority  # None: whatever each op's priority is when it runs
        self.selected_impls: dict[str, dict[str, str]] = defaultdict(dict)  # op -> node -> provider
        self.lowered: Counter[tuple[str, str]] = Counter()  # (op, provider), over every call
        self.unlowered: list[str] = []
        self.patterns = None  # built on first use: importing the matcher costs a warm start ~1 s

    def _build_patterns(self) -> None:
        from torch._inductor.pattern_matcher import (
            CallFunctionVarArgs,
            PatternMatcherPass,
            register_graph_pattern,
        )

        self.patterns = PatternMatcherPass(pass_name=self.pass_name)
        ops = [op.torch_op for op in IrOp.registry.values()]
        # any call of an IR op's default overload; lower_matched_op does the rest
        register_graph_pattern(CallFunctionVarArgs(ops), pass_dict=self.patterns)(
            self.lower_matched_op
        )

    def lower_matched_op(self, match, *args, **kwargs) -> None:
        assert len(match.nodes) == 1, "an IR op matches one node"
        node = match.nodes[0]
        op = get_ir_op(node)
        assert op is not None and not node.kwargs, node.format_node()
        fake_args = fx.map_arg(node.args, lambda a: a.meta["val"])
        impl = op.dispatch(*fake_args)
        self.selected_impls[op.name][node.name] = impl.provider
        self.lowered[op.name, impl.provider] += 1
        # the trace needs every argument, defaults included; func_impl_fn: in-place providers
        # write into copies, so the replacement is as functional as the node it replaces
        match.replace_by_example(
            impl.func_impl_fn, op.apply_arg_defaults(node.args), run_functional_passes=False
        )

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.selected_impls.clear()  # at the start, so that a test can read the last call's
        if self.patterns is None:
            self._build_patterns()
        scope = (
            self.ir_op_priority.set_priority() if self.ir_op_priority else contextlib.nullcontext()
        )
        with scope:
            count = self.patterns.apply(graph)
        logger.debug(
            "%s lowered %d vLLM IR nodes; selected implementations: %s",
            self.pass_name,
            count,
            self.summary(),
        )
        self.unlowered = [n.name for n in graph.nodes if get_ir_op(n) is not None]
        if self.unlowered:
            ops = sorted({get_ir_op(n).name for n in graph.nodes if get_ir_op(n) is not None})
            logger.warning(
                "Failed to lower vLLM IR ops %s (nodes %s): Inductor will call them as "
                "extern kernels, dispatching at run time",
                ops,
                self.unlowered,
            )

    def summary(self) -> str:
        """e.g. "rms_norm=native, fused_add_rms_norm=vllm_c*4" (vLLM's log format)."""

        def count(impls: dict[str, str]) -> str:
            return ",".join(p if n == 1 else f"{p}*{n}" for p, n in Counter(impls.values()).items())

        return ", ".join(f"{op}={count(impls)}" for op, impls in self.selected_impls.items())

    def uuid(self) -> str:
        priorities = (
            {name: p for name, p in self.ir_op_priority.items()}
            if self.ir_op_priority
            else {name: op.get_priority() for name, op in IrOp.registry.items()}
        )
        impls = {
            name: [IrOp.registry[name].impls[p].uuid() for p in ps]
            for name, ps in priorities.items()
        }
        return VllmInductorPass.hash_dict(
            {"source": super().uuid(), "priority": priorities, "impls": impls}
        )
