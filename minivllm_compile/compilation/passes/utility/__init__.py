"""vLLM's utility passes (vllm/compilation/passes/utility/): the clean-up around the fusions, and
FixFunctionalizationPass, which runs last."""
