import os
import tempfile

# Triton reads this when a kernel is decorated, so it must be set before any kernel module is
# imported: the Triton kernels then run on the CPU through Triton's interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests count compilations: a warm compile cache from an earlier run would change the counts. The
# cache tests (test_caching.py) turn it back on, each in a fresh directory.
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="minivllm_test_cache_"))
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
