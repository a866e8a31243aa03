"""The compiler: what runs from `@support_torch_compile` to a compiled forward (vLLM's
vllm/compilation/). Open vLLM's file of the same name beside each one.

vLLM 0.34's files, under their names and paths:

    decorators.py          @support_torch_compile: mark_dynamic, the first call, AOT load or compile
    wrapper.py             TorchCompileWithNoGuardsWrapper: guard filter, bytecode hook
    backends.py            VllmBackend: split_graph, PiecewiseCompileInterpreter, CompilerManager
    piecewise_backend.py   PiecewiseBackend: every compile size and range of one piece
    compiler_interface.py  the Inductor adaptors (standalone_compile, compile_fx) and eager
    partition_rules.py     splitting_ops: which nodes cut the graph
    caching.py             VllmSerializableFunction: the AOT artifact and how it is saved
    codegen.py             the stitching function: the split graph written out as plain Python
    cuda_graph.py          CUDAGraphWrapper (on a CPU: a static-buffer replay stand-in)
    counter.py             compilation_counter
    monitor.py             compile timing
    depyf_compat.py        depyf's debugging (debug_dump_path) with its hook fixed for this Inductor
    passes/                the Inductor passes: fusion/, utility/, ir/ (vLLM's folders)

This project's own (vLLM keeps these inside the files above, or has none):

    aot.py                 the AOT branch of the first call, out of decorators.py
    cache_keys.py          the factors of the compile cache's keys
    cache_files.py         the cache's folders, hashes, locks and atomic writes
    traced_state.py        what one trace assumed, saved with the AOT artifact and checked on load
    cpu_isa.py             Inductor's CPU vector-ISA probe, remembered across processes
    nvtx.py                layerwise profiler ranges (vLLM's --enable-layerwise-nvtx-tracing)

Nothing here imports the teaching layer (viz/, exercises/), the models or the benchmarks; the
source of every module here is part of the compile cache's key (cache_files.compiler_files).
"""
