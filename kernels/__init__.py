"""Triton kernels, each beside its plain-torch reference (shipped as ``minivllm_compile.kernels``).

Every module exposes ``<op>_ref`` (plain torch, the ground truth and the CPU path of the custom
ops) and ``<op>`` or ``<op>_triton`` (the Triton launch). Set ``TRITON_INTERPRET=1`` before this
package is first imported to run the Triton kernels on the CPU.
"""
