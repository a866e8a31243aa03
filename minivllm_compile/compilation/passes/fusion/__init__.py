"""vLLM's fusion passes (vllm/compilation/passes/fusion/): pattern-matcher passes that replace a
chain of ops with one fused op."""
