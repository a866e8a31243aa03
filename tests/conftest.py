import os

# Triton reads this when a kernel is decorated, so it must be set before any kernel module is
# imported: the Triton kernels then run on the CPU through Triton's interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
