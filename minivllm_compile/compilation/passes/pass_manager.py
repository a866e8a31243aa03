"""`PostGradPassManager`: the one object Inductor calls after its own post-grad passes
(vLLM's passes/pass_manager.py). The backend installs it as

    torch._inductor.config.post_grad_custom_post_pass = manager

beside enable_auto_functionalized_v2=False, which CompilationConfig sets (FixFunctionalization
reads v1).

Each pass may apply to some compile ranges only (`is_applicable_for_range`): the manager reads
the range of the compile in progress from the pass context (`get_pass_context()`), which the
backend sets around each piece's compile (`CompilerManager.compile_context`), as in vLLM. A graph
compiled outside the backend (the manager installed by hand, outside any `pass_context`) runs
every pass: vLLM asserts a context there.

Order (vLLM 0.34's): NoOpElimination -> AllReduceFusion, RMSNormQuantFusion, ActivationQuantFusion,
QKNormRoPEFusion (each when enabled) -> user passes (`add`) -> PostCleanup -> VllmIRLowering
-> UnsafeCloneElimination
-> PostCleanup -> FixFunctionalization, always last, so every other pass sees a functional graph.
The fusion passes match the vLLM IR ops, which the lowering then replaces with the provider the
priority picks. (VllmIRInplaceFunctionalizationPass runs before all of these, before AOTAutograd:
the backend installs it as Inductor's pre_grad_custom_pass.)
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from minivllm_compile.compilation.cache_files import compiler_source_hash
from minivllm_compile.compilation.passes.inductor_pass import (
    CallableInductorPass,
    InductorPass,
    get_pass_context,
    graph_text,
    in_pass_context,
)
from minivllm_compile.compilation.passes.ir.clone_elimination import UnsafeCloneEliminationPass
from minivllm_compile.compilation.passes.ir.lowering_pass import VllmIRLoweringPass
from minivllm_compile.compilation.passes.ir.utils import set_donated_input_ids
from minivllm_compile.compilation.passes.utility.fix_functionalization import (
    FixFunctionalizationPass,
)
from minivllm_compile.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from minivllm_compile.compilation.passes.utility.post_cleanup import PostCleanupPass
from minivllm_compile.compilation.passes.vllm_inductor_pass import Records, VllmInductorPass
from minivllm_compile.config import CompilationConfig, PassConfig, Range

logger = logging.getLogger(__name__)


class PostGradPassManager(CustomGraphPass):
    def __init__(self) -> None:
        self.passes: list[CustomGraphPass] = []
        self.fix_functionalization: FixFunctionalizationPass | None = None
        self.post_cleanup = PostCleanupPass()
        self.ir_lowering = VllmIRLoweringPass()
        self.clone_elimination = UnsafeCloneEliminationPass()
        self.pass_config = PassConfig()
        # (stage, graph source) for every pass run, across every graph this manager has seen
        self.records: Records = []

    def configure(self, pass_config: PassConfig, ir_op_priority=None,
                  max_num_batched_tokens: int | None = None) -> None:
        """`ir_op_priority` (the config's IrOpPriorityConfig) is what the lowering uses; None: each
        op's priority at the time it runs (vLLM's, which its worker sets for the process).
        `max_num_batched_tokens` caps the all-reduce fusion's range gate (as vLLM's)."""
        self.pass_config = pass_config
        self.passes = [NoOpEliminationPass(pass_config)] if pass_config.eliminate_noops else []
        # the fusion passes import Inductor's pattern matcher (and with it all of Inductor's
        # lowerings, about a second): only when one is on, so a warm start, which builds this
        # manager for its cache key, does not pay for it
        if pass_config.fuse_allreduce_rms:  # vLLM's order: before the quant fusions
            from minivllm_compile.compilation.passes.fusion.allreduce_rms_fusion import (
                AllReduceFusionPass,
            )

            self.passes.append(AllReduceFusionPass(pass_config,
                                                   max_num_batched_tokens=max_num_batched_tokens))
        if pass_config.fuse_norm_quant:  # vLLM's order: the quant fusions, then QK-norm + RoPE
            from minivllm_compile.compilation.passes.fusion.rms_quant_fusion import (
                RMSNormQuantFusionPass,
            )

            self.passes.append(RMSNormQuantFusionPass(pass_config))
        if pass_config.fuse_act_quant:
            from minivllm_compile.compilation.passes.fusion.act_quant_fusion import (
                ActivationQuantFusionPass,
            )

            self.passes.append(ActivationQuantFusionPass(pass_config))
        if pass_config.enable_qk_norm_rope_fusion:  # its patterns expect views already folded
            from minivllm_compile.compilation.passes.fusion.qk_norm_rope_fusion import (
                QKNormRoPEFusionPass,
            )

            self.passes.append(QKNormRoPEFusionPass(pass_config))
        self.post_cleanup = PostCleanupPass(pass_config)
        self.ir_lowering = VllmIRLoweringPass(pass_config, ir_op_priority=ir_op_priority)
        self.clone_elimination = UnsafeCloneEliminationPass(pass_config)
        self.fix_functionalization = None
        if pass_config.enable_fix_functionalization:
            self.fix_functionalization = FixFunctionalizationPass(pass_config)

    def add(self, pass_: InductorPass) -> None:
        """A user pass, run after the default ones and before FixFunctionalization. Only an
        InductorPass, as in vLLM (which asserts it): its uuid keys Inductor's cache, so a plain
        function must say what it is, CallableInductorPass(fn) (its uuid: its source's hash)."""
        if not isinstance(pass_, InductorPass):
            hint = "wrap it: CallableInductorPass(fn)" if callable(pass_) \
                else "give an InductorPass"
            raise TypeError(f"PostGradPassManager.add takes an InductorPass, got {pass_!r}: {hint}")
        self.passes.append(pass_)

    @staticmethod
    def compile_range() -> Range | None:
        """The num_tokens range of the compile in progress; None outside a pass context."""
        return get_pass_context().compile_range if in_pass_context() else None

    def all_passes(self) -> list[CustomGraphPass]:
        """Every pass in the order it runs (the clean-up twice: before and after the lowering)."""
        tail = [self.post_cleanup, self.ir_lowering, self.clone_elimination, self.post_cleanup]
        return self.passes + tail + ([self.fix_functionalization]
                                     if self.fix_functionalization else [])

    def __call__(self, graph: fx.Graph) -> None:
        try:
            self._run(graph)
        finally:
            set_donated_input_ids(set())  # the pre-grad pass's record serves this one compile

    def _run(self, graph: fx.Graph) -> None:
        compile_range = self.compile_range()
        for i, pass_ in enumerate(self.all_passes()):
            applicable = getattr(pass_, "is_applicable_for_range", lambda _: True)
            if not applicable(compile_range):
                logger.debug("skipping %s for %s", type(pass_).__name__, compile_range)
                continue
            if isinstance(pass_, VllmInductorPass):  # it records itself (and any inner stages)
                pass_.records, pass_.dump_prefix = self.records, i
                pass_(graph)
            else:
                name = f"post_grad.{i}.{type(pass_).__name__}"
                self.records.append((f"{name}.before", graph_text(graph)))
                pass_(graph)
                self.records.append((f"{name}.after", graph_text(graph)))

    def uuid(self) -> Any:
        """Part of Inductor's FX-graph cache key: a changed pass, pass config or compile range
        must not hit kernels compiled under the old ones. Each pass's uuid hashes its class's
        source, as in vLLM; the compiler's whole source is added, so that an edit outside a pass's
        class (a helper it calls) cannot hit kernels the old code built either."""
        state = {
            "pass_config": asdict(self.pass_config),
            "passes": [p.uuid() for p in self.all_passes()],
            "compile_range": str(self.compile_range()),
            "compiler": compiler_source_hash(),
        }
        return InductorPass.hash_dict(state)


def make_pass_manager(cc: CompilationConfig) -> PostGradPassManager:
    """The passes a config runs, a user's `post_grad_custom_post_pass` among them (as vLLM's
    VllmBackend.configure_post_pass merges it). The backend installs this manager; the cache key
    hashes its uuid, so both see the same passes."""
    manager = PostGradPassManager()
    manager.configure(cc.pass_config, cc.kernel_config.ir_op_priority, cc.max_num_batched_tokens)
    user_pass = cc.inductor_compile_config.get("post_grad_custom_post_pass")
    if isinstance(user_pass, PostGradPassManager):
        raise ValueError("inductor_compile_config['post_grad_custom_post_pass'] "
                         "is a PostGradPassManager: give the pass itself; the "
                         "backend builds the manager")
    if user_pass is not None:
        manager.add(as_inductor_pass(user_pass))
    return manager


def as_inductor_pass(pass_: Any) -> InductorPass:
    """A user's `post_grad_custom_post_pass` as an InductorPass: a function of a graph (or another
    CustomGraphPass) is wrapped in CallableInductorPass here. vLLM wraps the entries of
    CompilationConfig.inductor_passes so, and asserts that this key holds an InductorPass."""
    if isinstance(pass_, InductorPass):
        return pass_
    if not callable(pass_):
        raise TypeError(f"inductor_compile_config['post_grad_custom_post_pass'] is {pass_!r}: "
                        "give an InductorPass or a function of a torch.fx.Graph")
    return CallableInductorPass(pass_, pass_.uuid() if isinstance(pass_, CustomGraphPass) else None)
