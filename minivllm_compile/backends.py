"""VllmBackend: what Dynamo calls, once, in VLLM_COMPILE (vLLM's compilation/backends.py; seed §14).

It splits the Dynamo graph at the splitting ops (attention, short conv), compiles every other
piece for every compile size and range up front (PiecewiseBackend), and returns the stitching
graph: at run time it calls the compiled pieces and, between them, the splitting ops eagerly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import operator
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.passes.split_module import split_module

from minivllm_compile import caching, envs
from minivllm_compile.compiler_interface import CompiledEntry, make_compiler, returns_single_value, timed_compile
from minivllm_compile.config import CompilationConfig, Range
from minivllm_compile.counter import compilation_counter
from minivllm_compile.monitor import dynamo_transform_time
from minivllm_compile.partition_rules import should_split, warn_unknown_splitting_ops
from minivllm_compile.piecewise_backend import PiecewiseBackend

logger = logging.getLogger("minivllm_compile")

def is_empty_allocation(node: fx.Node) -> bool:
    """torch.empty / empty_like / empty_strided / Tensor.new_empty, in any of the forms a graph
    holds them (a function, an op packet, an overload): uninitialised memory, nothing computed."""
    if node.op == "call_method":
        return node.target == "new_empty"
    if node.op != "call_function":
        return False
    if node.target in (torch.empty, torch.empty_like, torch.empty_strided):
        return True
    name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else \
        getattr(node.target, "_qualified_op_name", "")
    return name.startswith(("aten::empty", "aten::new_empty"))


def _merge_empty_only_subgraphs(node_to_id: dict[fx.Node, int], split_ids: set[int]) -> None:
    """A piece that is one empty allocation (the output buffer of the splitting op after it) is
    not worth a compile, or in vLLM a CUDA-graph capture, of its own: it joins the last compiled
    (non-splitting) piece before it, if every input of the allocation exists by then. As vLLM."""
    members: dict[int, list[fx.Node]] = {}
    for node, i in node_to_id.items():
        members.setdefault(i, []).append(node)
    prev_compiled: int | None = None
    for i in sorted(members):
        nodes, merged = members[i], False
        if len(nodes) == 1 and is_empty_allocation(nodes[0]) and prev_compiled is not None:
            if all(n.op == "placeholder" or node_to_id[n] <= prev_compiled for n in nodes[0].all_input_nodes):
                node_to_id[nodes[0]] = prev_compiled
                merged = True
        if not merged and i not in split_ids:
            prev_compiled = i


@dataclasses.dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: fx.GraphModule


def _decompose_size_nodes(gm: fx.GraphModule) -> None:
    """x.size() -> x.size(0), x.size(1), ...: a torch.Size must not cross a piece boundary (a
    compiled piece takes tensors and SymInts, not Size objects)."""
    for node in list(gm.graph.nodes):
        if not (node.op == "call_method" and node.target == "size" and len(node.args) == 1
                and not node.kwargs and "example_value" in node.meta):
            continue
        with gm.graph.inserting_after(node):
            dims = [gm.graph.call_method("size", (node.args[0], i)) for i in range(len(node.meta["example_value"]))]
        for d, value in zip(dims, node.meta["example_value"]):
            d.meta["example_value"] = value
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                user.replace_all_uses_with(dims[user.args[1]])
                gm.graph.erase_node(user)
            else:
                user.args = torch.fx.node.map_arg(user.args, lambda a: tuple(dims) if a is node else a)
        gm.graph.erase_node(node)
    gm.recompile()


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut the graph before and after every splitting op. Rules: a getitem stays with its
    producer; consecutive splitting ops share one piece; a piece that is one empty allocation
    joins the compiled piece before it."""
    _decompose_size_nodes(gm)
    node_to_id: dict[fx.Node, int] = {}
    split_ids: set[int] = set()
    current, in_split = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in node_to_id:
            node_to_id[node] = node_to_id[node.args[0]]
        elif should_split(node, splitting_ops):
            if not in_split:
                current += 1
                in_split = True
            node_to_id[node] = current
            split_ids.add(current)
        else:
            if in_split:
                current += 1
                in_split = False
            node_to_id[node] = current
    _merge_empty_only_subgraphs(node_to_id, split_ids)
    # keep_original_order: the in-place ops must run in program order across pieces
    split_gm = split_module(gm, None, lambda n: node_to_id[n], keep_original_order=True)
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.removeprefix("submod_"))
        items.append(SplitItem(name, graph_id, graph_id in split_ids, module))
    items.sort(key=lambda it: it.graph_id)
    return split_gm, items


def graph_key(gm: fx.GraphModule) -> str:
    """A hash of a piece's structure, blind to node names: identical layers give identical keys."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        return f"%{index[a]}" if isinstance(a, fx.Node) else repr(a)

    rows = []
    for n in gm.graph.nodes:
        value = n.meta.get("example_value")
        meta = (str(value.shape), str(value.stride()), str(value.dtype)) if isinstance(value, torch.Tensor) else repr(value)
        rows.append((n.op, str(n.target) if n.op != "placeholder" else "", str(torch.fx.node.map_arg(n.args, norm)),
                     str(torch.fx.node.map_arg(n.kwargs, norm)), meta if n.op == "placeholder" else ""))
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


class CompilerManager:
    """Compiles pieces, counts it, and reuses an identical piece's artifact within the process."""

    def __init__(self, compilation_config: CompilationConfig, inductor_config: dict):
        self.compilation_config = compilation_config
        self.compiler = make_compiler(compilation_config.backend)
        self.inductor_config = inductor_config
        self.entries: list[CompiledEntry] = []
        self._by_key: dict[tuple[str, Range], CompiledEntry] = {}
        self.cache_dir: Path | None = None  # set by the backend; None: nothing saved

    def initialize_cache(self, cache_dir: Path | None, prefix: str) -> None:
        self.cache_dir = cache_dir
        self.compiler.initialize_cache(str(cache_dir or ""), disable_cache=cache_dir is None, prefix=prefix)

    def _save(self, entry: CompiledEntry) -> None:
        if self.cache_dir is None or not hasattr(entry.runnable, "save"):
            return
        path = self.cache_dir / f"artifact_compile_range_{caching.range_key(entry.compile_range)}_subgraph_{entry.graph_index}"
        try:
            with caching.locked(self.cache_dir):
                caching.save_artifact(entry.runnable, path, self.compilation_config.compile_cache_save_format)
        except OSError as e:  # read-only or full disk: keep going in memory
            logger.warning("cannot save compiled artifacts to %s (%s); continuing in memory", self.cache_dir, e)
            self.cache_dir = None
            return
        entry.artifact_path = str(path)
        compilation_counter.num_compiled_artifacts_saved += 1
        compilation_counter.num_cache_entries_updated += 1

    def compile(self, graph: fx.GraphModule, example_inputs: list, compile_range: Range,
                graph_index: int) -> CompiledEntry:
        compilation_counter.num_backend_compilations += 1
        key = (graph_key(graph), compile_range)
        hit = self._by_key.get(key)
        if hit is not None:
            logger.debug("graph %d has the same key as graph %d for %s: reusing it",
                         graph_index, hit.graph_index, compile_range)
            entry = dataclasses.replace(hit, graph_index=graph_index, reused_from=hit.graph_index, seconds=0.0)
        else:
            manager = self.inductor_config.get("post_grad_custom_post_pass")
            if hasattr(manager, "set_compile_range"):
                manager.set_compile_range(compile_range)
            entry = timed_compile(self.compiler, graph, example_inputs, self.inductor_config,
                                  compile_range, graph_index)
            self._save(entry)
            self._by_key[key] = entry
        self.entries.append(entry)
        return entry


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; each piece to compile gets a PiecewiseBackend (which
    compiles it for every entry right away) in place of its submodule."""

    def __init__(self, split_gm: fx.GraphModule, compile_submod_names: list[str], backend: "VllmBackend"):
        super().__init__(split_gm)
        self.compile_submod_names = compile_submod_names
        self.backend = backend
        self.extra_traceback = False

    def run(self, *args: Any) -> Any:
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode(args)
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target, args, kwargs):
        output = super().call_module(target, args, kwargs)
        if target in self.compile_submod_names:
            index = self.compile_submod_names.index(target)
            sym_shape_indices = [i for i, a in enumerate(args) if isinstance(a, torch.SymInt)]
            piece = PiecewiseBackend(self.fetch_attr(target), self.backend, index,
                                     len(self.compile_submod_names), sym_shape_indices)
            piece.submod_name = target
            self.backend.piecewise_backends.append(piece)
            self.module.__dict__[target] = piece  # the stitching graph now calls the backend
            compilation_counter.num_piecewise_capturable_graphs_seen += 1
        return output


# which compiled part of the model the next VllmBackend serves (vLLM: backbone, eagle_head, ...):
# its folder in the cache, beside the other parts'
model_tag: str = caching.DEFAULT_MODEL_TAG


@contextlib.contextmanager
def set_model_tag(tag: str) -> Iterator[None]:
    """Build a compiled submodule under its own tag (as vLLM's set_model_tag): its pieces get their
    own folder, `<hash>/rank_0_0/<tag>`."""
    global model_tag
    if tag == model_tag:
        raise ValueError(f"model tag {tag!r} is the current tag already")
    old, model_tag = model_tag, tag
    try:
        yield
    finally:
        model_tag = old


class VllmBackend:
    def __init__(self, compilation_config: CompilationConfig, prefix: str = ""):
        self.compilation_config = compilation_config
        self.prefix = prefix or model_tag
        # what tells this model from others in the cache key (caching.model_factors); the
        # decorator sets it at the first call, None when the backend is used on its own
        self.model_factors: dict | None = None
        self.inductor_config, _ = compilation_config.inductor_config_and_guard_filter()
        self.compiler_manager = CompilerManager(compilation_config, self.inductor_config)
        self.graphs: list[fx.GraphModule] = []  # the Dynamo graph (one: Dynamo traces once)
        self.piecewise_backends: list[PiecewiseBackend] = []
        self.dynamo_time_s: float | None = None
        self.cache_dir: str | None = None
        self.post_grad_pass_manager = None

    def configure_post_pass(self) -> None:
        """Post-grad passes run inside Inductor, after functionalization (vLLM sets
        enable_auto_functionalized_v2=False so FixFunctionalizationPass sees v1 nodes)."""
        if self.compilation_config.backend != "inductor":
            return
        from minivllm_compile.passes import make_pass_manager

        self.post_grad_pass_manager = manager = make_pass_manager(self.compilation_config)
        self.inductor_config["post_grad_custom_post_pass"] = manager
        self.inductor_config.setdefault("enable_auto_functionalized_v2", False)

    def _pick_cache_dir(self, example_inputs: list) -> Path | None:
        """<root>/<hash of every factor, traced files included>/rank_0_0/<prefix>, as vLLM lays it;
        None when the cache is off or cannot be written (then everything stays in memory). A
        CompilationConfig.cache_dir takes the root's place; vLLM uses it as the hash folder itself,
        but then two models given the same cache_dir would overwrite each other's pieces."""
        cc = self.compilation_config
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        key, self.cache_key_factors = caching.backend_cache_key(cc, device, self.model_factors)
        if envs.VLLM_DISABLE_COMPILE_CACHE:
            return None
        local = Path(cc.cache_dir or caching.cache_root()) / key / "rank_0_0" / self.prefix
        try:
            caching.atomic_write(local / "cache_key_factors.json", json.dumps(self.cache_key_factors, indent=1))
        except OSError as e:
            logger.warning("cannot write to the compile cache %s (%s); compiling in memory only", local, e)
            return None
        return local

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> "caching.VllmSerializableFunction":
        if self.graphs:
            raise RuntimeError("VllmBackend is called once per model: Dynamo traced it a second time "
                               "(a guard was kept and failed?)")
        self.dynamo_time_s = dynamo_transform_time()
        compilation_counter.num_graphs_seen += 1
        self.graphs.append(gm)
        self.cache_dir = self._pick_cache_dir(example_inputs)
        self.compiler_manager.initialize_cache(self.cache_dir, self.prefix)
        self.configure_post_pass()
        cc = self.compilation_config
        warn_unknown_splitting_ops(cc.splitting_ops)
        self.split_gm, self.piecewise_graphs = split_graph(gm, cc.splitting_ops)
        compilation_counter.num_piecewise_graphs_seen += len(self.piecewise_graphs)
        names = [it.submod_name for it in self.piecewise_graphs if not it.is_splitting_graph]
        PiecewiseCompileInterpreter(self.split_gm, names, self).run(*example_inputs)
        self._write_computation_graph()
        pieces = [{"submod": pb.submod_name, "index": pb.piecewise_compile_index,
                   "sym_shape_indices": pb.sym_shape_indices,
                   # a loaded Inductor artifact returns a list even for a piece returning one value
                   "single_output": returns_single_value(pb.graph),
                   "entries": {r: e.compiled.artifact_path for r, e in pb.range_entries.items()}}
                  for pb in self.piecewise_backends]
        return caching.VllmSerializableFunction(self.split_gm, cc, pieces, self.cache_dir,
                                                cc.compile_cache_save_format)

    def _write_computation_graph(self) -> None:
        if self.cache_dir is None:
            return
        src = self.split_gm.print_readable(print_output=False).replace("<lambda>", "GraphModule")
        try:
            caching.atomic_write(self.cache_dir / "computation_graph.py",
                                 "from __future__ import annotations\nimport torch\n" + src)
        except OSError as e:
            logger.warning("cannot write to the compile cache %s (%s); continuing without it", self.cache_dir, e)
