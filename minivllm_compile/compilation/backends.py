"""VllmBackend: what Dynamo calls, once, in VLLM_COMPILE (vLLM's compilation/backends.py; seed §14).

It splits the Dynamo graph at the splitting ops (attention, short conv), compiles every other
piece for every compile size and range up front (PiecewiseBackend), and returns the stitching
graph: at run time it calls the compiled pieces and, between them, the splitting ops eagerly.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import logging
import operator
import pprint
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._logging import trace_structured
from torch.fx.passes.split_module import split_module

from minivllm_compile import envs
from minivllm_compile.compilation import cache_files, cache_keys, caching
from minivllm_compile.compilation.compiler_interface import (
    CompiledEntry,
    CompilerInterface,
    EagerAdaptor,
    InductorAdaptor,
    InductorStandaloneAdaptor,
    returns_single_value,
    timed_compile,
)
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.cuda_graph import wrap_with_cudagraph_if_needed
from minivllm_compile.compilation.monitor import dynamo_transform_time
from minivllm_compile.compilation.partition_rules import should_split, warn_unknown_splitting_ops
from minivllm_compile.compilation.piecewise_backend import PiecewiseBackend, StitchingRecord
from minivllm_compile.config import CompilationConfig, DynamicShapesType, Range

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
            if all(n.op == "placeholder" or node_to_id[n] <= prev_compiled
                   for n in nodes[0].all_input_nodes):
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
    """x.size() -> its dims, as vLLM's: a torch.Size must not cross a piece boundary (a compiled
    piece takes tensors and SymInts, not Size objects). A dynamic dim becomes
    aten.sym_size.int(x, i), placed right after x (so it crosses into later pieces as a SymInt); a
    static dim becomes the literal int, so no piece takes a plain int as an input. x.size(i) is a
    scalar already: left alone."""
    for node in list(gm.graph.find_nodes(op="call_method", target="size")):
        if len(node.args) > 1 or "dim" in node.kwargs:
            continue
        tensor = node.args[0]
        value = tensor.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"cannot split at {node.name} = {tensor.name}.size(): {tensor.name} "
                               "has no example value (was the graph traced by Dynamo?)")
        # after the tensor; after the last input when it is one, so that the inputs stay first
        inputs = list(gm.graph.find_nodes(op="placeholder"))
        where = tensor if tensor.op != "placeholder" else inputs[-1]
        dims: list[fx.Node | int] = []
        with gm.graph.inserting_after(where):
            for i, d in reversed(list(enumerate(value.shape))):  # each inserted right after `where`
                if isinstance(d, torch.SymInt):
                    dim = gm.graph.call_function(torch.ops.aten.sym_size.int, (tensor, i))
                    dim.meta["example_value"] = d
                    dims.insert(0, dim)
                else:
                    dims.insert(0, int(d))
        for user in list(node.users):
            if (user.op == "call_function" and user.target is operator.getitem
                    and user.args[0] is node and isinstance(user.args[1], int)):
                user.replace_all_uses_with(dims[user.args[1]])
                gm.graph.erase_node(user)
            elif (user.args and user.args[-1] is node
                  and node not in (*user.args[:-1], *user.kwargs.values())):
                user.args = (*user.args[:-1], *dims)  # view(t, size) -> view(t, d0, d1), as vLLM's
            else:  # the size among other arguments (torch.full(size, v)): a tuple of the dims
                user.args, user.kwargs = torch.fx.node.map_arg(
                    (user.args, user.kwargs), lambda a: tuple(dims) if a is node else a)
        gm.graph.erase_node(node)
    gm.recompile()


def split_graph(gm: fx.GraphModule, splitting_ops: list[str]) -> tuple[fx.GraphModule,
                                                                       list[SplitItem]]:
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
        if (node.op == "call_function" and node.target is operator.getitem
            and node.args[0] in node_to_id):
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
    """A hash of a piece's structure, blind to node names, to the names of its size symbols (s77
    in one trace is s0 in the graph a non-mega AOT load traces again) and to addresses: identical
    layers give identical keys, and a saved piece's key is found again in the next process."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        return f"%{index[a]}" if isinstance(a, fx.Node) else repr(a)

    rows = []
    for n in gm.graph.nodes:
        value = n.meta.get("example_value")
        meta = (str(value.shape), str(value.stride()), str(value.dtype)) if isinstance(
            value, torch.Tensor) else repr(value)
        rows.append((n.op, str(n.target) if n.op != "placeholder" else "",
                     str(torch.fx.node.map_arg(n.args, norm)),
                     str(torch.fx.node.map_arg(n.kwargs, norm)),
                     meta if n.op == "placeholder" else ""))
    symbols: dict[str, str] = {}
    text = re.sub(r"\b[su]\d+\b", lambda m: symbols.setdefault(m.group(0), f"sym{len(symbols)}"),
                  re.sub(r" at 0x[0-9a-f]+", "", repr(rows)))  # a builtin's repr has its address
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def refuse_unbacked_floats(gm: fx.GraphModule) -> None:
    """A Python float read from a tensor in forward (`float(t)`, `t.item()`; a numpy scalar
    attribute too, which Dynamo reads as a 0-d tensor) is an unbacked float in the graph. Inductor
    compiles it in a whole graph (DYNAMO_TRACE_ONCE), but not in a piece split out of one: it
    failed deep inside with PendingUnbackedSymbolNotFound. Refused here, naming the line and the
    fix."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if not (isinstance(value, torch.SymFloat) and free_unbacked_symbols(value)):
            continue
        where = "forward"
        lines = [ln.strip() for ln in (node.stack_trace or "").splitlines()]
        last = max((i for i, ln in enumerate(lines) if ln.startswith('File "')), default=None)
        if last is not None:  # the innermost frame: 'File "<path>", line <n>, in <fn>', its code
            m = re.match(r'File "(.+)", line (\d+)', lines[last])
            code = lines[last + 1] if last + 1 < len(lines) else ""
            where = f"{Path(m.group(1)).name}:{m.group(2)}: {code}" if m else where
        inputs = [a for a in node.all_input_nodes if a.op == "placeholder"]
        source = getattr(inputs[0].meta.get("grapharg"), "source", None) if inputs else None
        name = getattr(getattr(source, "base", None), "name", None)
        fix = ("store a Python number, or a tensor used as a tensor, instead (for a buffer of "
               "weights: a tensor; for a setting: a float)")
        if type(source).__name__ == "NumpyTensorSource" and name is not None:
            attr = re.sub(r"L\['([^']+)'\]", r"\1", name if isinstance(name, str) else name())
            fix = (f"{attr} is a numpy scalar, which Dynamo reads as a 0-d tensor: store a Python "
                   f"number instead, {attr} = float(...) where it is set (Dynamo then bakes the "
                   "value into the graph)")
        raise RuntimeError(
            f"{where}\n  reads a tensor's value as a Python float (an unbacked float in the "
            "graph), which VLLM_COMPILE cannot compile into its pieces (DYNAMO_TRACE_ONCE, "
            f"compiling the graph whole, can): {fix}.")


def make_compiler(compilation_config: CompilationConfig, *,
                  use_aot_compile: bool) -> CompilerInterface:
    """The adaptor a piece goes to (vLLM's): eager, standalone_compile, or compile_fx."""
    if compilation_config.backend == "eager":
        return EagerAdaptor()
    if envs.VLLM_USE_STANDALONE_COMPILE and hasattr(torch._inductor, "standalone_compile"):
        return InductorStandaloneAdaptor(compilation_config.compile_cache_save_format,
                                         use_aot_compile=use_aot_compile)
    return InductorAdaptor()


class CompilerManager:
    """Compiles pieces, counts it, keeps the index of what it saved, and loads from it (vLLM's).

    The index, `vllm_compile_cache.py` in the prefix's cache folder, is a pprint'ed dict
    `((start, end), graph_index, compiler_name) -> {"graph_handle": (key, path), "cache_key": ...}`,
    read back with ast.literal_eval. It is kept only with AOT compile on (as in vLLM 0.34): the
    non-mega AOT load re-runs the backend, and each piece and entry is then found in it and loaded
    instead of compiled. With the mega artifact the adaptor gives no handles (the bytes are in the
    AOT file), so the index stays empty; with AOT off nothing is loaded from it at all."""

    INDEX_NAME = "vllm_compile_cache.py"

    def __init__(self, compilation_config: CompilationConfig, inductor_config: dict):

        self.compilation_config = compilation_config
        # vLLM: passed in by the decorator
        self.use_aot_compile = caching.use_aot_compile(compilation_config)
        self.compiler = make_compiler(compilation_config, use_aot_compile=self.use_aot_compile)
        self.inductor_config = inductor_config
        self.entries: list[CompiledEntry] = []
        self._by_key: dict[tuple[str, Range], CompiledEntry] = {}
        self.cache: dict[tuple[Range, int, str], dict] = {}
        self.is_cache_updated = False
        self.cache_dir: Path | None = None  # set by the backend; None: nothing saved
        self.disable_cache = True
        self.prefix = ""  # the model tag, in log lines as vLLM's _log_prefix

    @contextlib.contextmanager
    def compile_context(self, compile_range: Range) -> Iterator[None]:
        """Around one Inductor compile (vLLM's): the passes Inductor runs inside read the compile
        range from this pass context, and a range-gated pass (is_applicable_for_range) skips the
        ranges it does not serve."""
        from minivllm_compile.compilation.passes import (
            pass_context,  # the passes load with the first compile
        )

        with pass_context(compile_range):
            yield

    @property
    def cache_file_path(self) -> Path | None:
        return self.cache_dir / self.INDEX_NAME if self.cache_dir is not None else None

    def initialize_cache(self, cache_dir: Path | None, prefix: str) -> None:
        self.cache_dir, self.prefix = cache_dir, prefix
        self.disable_cache = cache_dir is None
        if self.use_aot_compile and not self.disable_cache and self.cache_file_path.exists():
            self.cache = self._read_index(self.cache_file_path)
        self.compiler.initialize_cache(str(cache_dir or ""), disable_cache=self.disable_cache,
                                       prefix=prefix)

    @staticmethod
    def _read_index(path: Path) -> dict[tuple[Range, int, str], dict]:
        """The index as saved; an unreadable one (truncated, edited, from an older layout) is
        reported once and starts empty: every piece compiles again and the index is rewritten."""

        try:
            cache = {}
            for (r, graph_index, compiler_name), value in (
                    ast.literal_eval(path.read_text()).items()):
                if not (isinstance(graph_index, int) and isinstance(compiler_name, str)
                        and isinstance(value, dict) and "graph_handle" in value):
                    raise TypeError(f"unexpected entry {r, graph_index, compiler_name}: {value!r}")
                cache[(Range(*r), graph_index, compiler_name)] = value
            return cache
        except Exception as e:  # SyntaxError, ValueError, TypeError, OSError, ...
            logger.warning("compile cache index %s is unusable (%s); compiling its pieces afresh",
                           path,
                           str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__)
            return {}

    def save_to_file(self) -> None:
        """Written at every update (vLLM writes it once, after the last piece): the index on disk
        always names only artifacts already saved, so a process killed
        part-way leaves a usable one."""
        if not self.use_aot_compile or self.disable_cache or not self.is_cache_updated:
            return
        # a Range is written as its (start, end): literal_eval reads tuples, not dataclasses
        data = {((r.start, r.end), i, name): v for (r, i, name), v in self.cache.items()}
        try:
            with cache_files.locked(self.cache_dir):
                cache_files.atomic_write(self.cache_file_path,
                                         pprint.pformat(data, indent=4) + "\n")
        except OSError as e:
            logger.warning("cannot write the compile cache index %s (%s); continuing in memory",
                           self.cache_file_path, e)
            self.disable_cache = True
            return
        self.is_cache_updated = False

    def load(self, graph: fx.GraphModule, example_inputs: list, graph_index: int,
             compile_range: Range, cache_key: str) -> CompiledEntry | None:
        """The piece's artifact for this entry, if the index has it; None: compile it. The entry
        must have been written for this piece's graph (`cache_key`, graph_key's), and the file
        must be the one saved (its SHA-256, recorded in the index): a piece file swapped with
        another, or another model's, loaded and then failed at every call of every start."""
        if not self.use_aot_compile or self.disable_cache:
            return None
        value = self.cache.get((compile_range, graph_index, self.compiler.name))
        if value is None:
            return None
        t0 = time.perf_counter()
        try:
            key, path = value["graph_handle"]
            if value.get("cache_key") != cache_key:
                raise RuntimeError("the index entry was written for another graph")
            if cache_files.path_sha256(Path(self.cache_dir) / key) != value.get("sha256"):
                raise RuntimeError("the file is not the one saved (its SHA-256 differs from the "
                                   "index's)")
            runnable = self.compiler.load((key, path), graph, example_inputs,
                                          graph_index, compile_range)
        except Exception as e:  # a corrupt or missing artifact: compile it again, and overwrite it
            if envs.VLLM_FORCE_AOT_LOAD:
                raise
            logger.warning("compiled artifact %s of graph %d for %s is unusable "
                           "(%s); compiling it afresh",
                           value.get("graph_handle"), graph_index, compile_range,
                           str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__)
            return None
        logger.debug("loaded graph %d for %s from %s", graph_index, compile_range, path)
        return CompiledEntry(runnable, compile_range, graph_index, time.perf_counter() - t0,
                             artifact_path=str(cache_files.resolve_path(path)), handle=(key, path),
                             loaded=True)

    def compile(self, graph: fx.GraphModule, example_inputs: list, compile_range: Range,
                graph_index: int) -> CompiledEntry:
        compilation_counter.num_backend_compilations += 1
        key = (graph_key(graph), compile_range)
        entry = self.load(graph, example_inputs, graph_index, compile_range, key[0])
        if entry is not None:
            self._by_key.setdefault(key, entry)
            self.entries.append(entry)
            return entry
        hit = self._by_key.get(key)
        if hit is not None:
            logger.debug("graph %d has the same key as graph %d for %s: reusing it",
                         graph_index, hit.graph_index, compile_range)
            # no handle for it: as in vLLM, a later load finds it again the same way
            entry = dataclasses.replace(hit, graph_index=graph_index,
                                        reused_from=hit.graph_index, seconds=0.0,
                                        handle=None, loaded=False)
            # vLLM calls its adaptor here too, which counts the call before AOTAutograd's cache
            # key finds the earlier artifact: the counters match vLLM's
            if self.compiler.name == "eager":
                compilation_counter.num_eager_compiles += 1
            else:
                compilation_counter.num_inductor_compiles += 1
        else:
            compilation_counter.num_unique_compiles += 1
            artifact_key = (
                f"artifact_compile_range_{caching.range_key(compile_range)}_subgraph_{graph_index}")
            with self.compile_context(compile_range):
                entry = timed_compile(self.compiler, graph, example_inputs, self.inductor_config,
                                      compile_range, graph_index, key=artifact_key)
            # a progress line per piece and entry that Inductor compiled (vLLM logs one per range
            # after its last piece); an eager "compile" takes no time and stays at DEBUG
            logger.log(logging.DEBUG if self.compiler.name == "eager" else logging.INFO,
                       "%sCompiled piece %d for compile range %s with %s in %.2f s",
                       f"[{self.prefix}] " if self.prefix else "", graph_index, compile_range,
                       self.compiler.name, entry.seconds)
            if self.use_aot_compile and not self.disable_cache and entry.handle is not None:
                self.cache[(compile_range, graph_index, self.compiler.name)] = {
                    "graph_handle": entry.handle, "cache_key": key[0],
                    "sha256": cache_files.path_sha256(Path(self.cache_dir) / entry.handle[0])}
                compilation_counter.num_cache_entries_updated += 1
                self.is_cache_updated = True
                self.save_to_file()
            self._by_key[key] = entry
        self.entries.append(entry)
        return entry


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Walks the split graph on fake inputs; each piece to compile gets a PiecewiseBackend (which
    compiles it for every entry right away) in place of its submodule. A piece is not run, not
    even on fake tensors: its outputs are the values Dynamo recorded for them (each output node's
    example_value), as vLLM's call_module reads them; the interpreter runs only the stitching
    graph's own nodes (getitem, sym_size) to hand each piece its inputs."""

    def __init__(self, split_gm: fx.GraphModule, compile_submod_names: list[str],
                 backend: "VllmBackend"):
        super().__init__(split_gm)
        self.compile_submod_names = compile_submod_names
        self.backend = backend
        self.extra_traceback = False

    def run(self, *args: Any) -> Any:
        from torch._guards import detect_fake_mode

        # as vLLM's: each tensor input as Dynamo traced it (its placeholder's example_value, with
        # num_tokens symbolic), the SymInts as given
        traced = [n.meta["example_value"] for n in self.module.graph.find_nodes(op="placeholder")]
        fake_args = [v if isinstance(t, torch.Tensor) else t for t, v in zip(args, traced)]
        with detect_fake_mode(fake_args) or contextlib.nullcontext(), enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target, args, kwargs):
        submod = self.module._modules[target]  # the piece itself, whatever is installed over it
        output = fx.map_arg(submod.graph.output_node().args[0],
                            lambda node: node.meta["example_value"])
        if target in self.compile_submod_names:
            index = self.compile_submod_names.index(target)
            sym_shape_indices = [i for i, a in enumerate(args) if isinstance(a, torch.SymInt)]
            piece = PiecewiseBackend(self.fetch_attr(target), self.backend, index,
                                     len(self.compile_submod_names), sym_shape_indices,
                                     submod_name=target)
            self.backend.piecewise_backends.append(piece)
            # the stitching graph now calls the backend, under a PIECEWISE CUDA-graph wrapper when
            # the mode has piecewise graphs (vLLM wraps here too, in self.module.__dict__); the
            # splitting ops stay unwrapped, eager
            self.backend.record.install(target, wrap_with_cudagraph_if_needed(
                piece, self.backend.compilation_config), backend=piece)
            compilation_counter.num_piecewise_capturable_graphs_seen += 1
        return output


# which compiled part of the model the next VllmBackend serves (vLLM: backbone, eagle_head, ...):
# its folder in the cache, beside the other parts'
model_tag: str = cache_keys.DEFAULT_MODEL_TAG


@contextlib.contextmanager
def set_model_tag(tag: str) -> Iterator[None]:
    """Build a compiled submodule under its own tag (as vLLM's set_model_tag): its pieces get their
    own folder, `<hash>/rank_{rank}_{dp_rank}/<tag>`."""
    global model_tag
    if tag == model_tag:
        raise ValueError(f"model tag {tag!r} is the current tag already")
    old, model_tag = model_tag, tag
    try:
        yield
    finally:
        model_tag = old


class VllmBackend:
    def __init__(self, compilation_config: CompilationConfig, prefix: str = "",
                 from_saved_graph: bool = False,
                 model_factors: Callable[[], dict | None] | None = None):
        self.compilation_config = compilation_config
        self.prefix = prefix or model_tag
        # run by a non-mega AOT load on the saved Dynamo graph, not by Dynamo
        self.from_saved_graph = from_saved_graph
        # what tells this model from others in the cache key (cache_keys.model_factors), asked for
        # when the graph arrives: the decorated model knows them only at its first call. None: a
        # backend used on its own, keyed without them
        self.model_factors = model_factors or (lambda: None)
        self.inductor_config, _ = compilation_config.inductor_config_and_guard_filter()
        self.compiler_manager = CompilerManager(compilation_config, self.inductor_config)
        self.graphs: list[fx.GraphModule] = []  # the Dynamo graph (one: Dynamo traces once)
        self.piecewise_backends: list[PiecewiseBackend] = []
        # what it built, for the views and the artifact (set when the graph arrives)
        self.record: StitchingRecord | None = None
        self.dynamo_time_s: float | None = None
        self.cache_dir: str | None = None
        self.post_grad_pass_manager = None

    def configure_post_pass(self) -> None:
        """Post-grad passes run inside Inductor, after functionalization (on v1 nodes:
        CompilationConfig sets enable_auto_functionalized_v2=False, as vLLM's does)."""
        if self.compilation_config.backend != "inductor":
            return
        from minivllm_compile.compilation.passes import make_pass_manager

        self.post_grad_pass_manager = manager = make_pass_manager(self.compilation_config)
        self.inductor_config["post_grad_custom_post_pass"] = manager
        from minivllm_compile.compilation.passes.ir import install_pre_grad_pass

        install_pre_grad_pass(self.inductor_config)  # vLLM IR: maybe_inplace -> functional
        self.inductor_config.setdefault("enable_auto_functionalized_v2", False)

    def _pick_cache_dir(self, example_inputs: list) -> Path | None:
        """<root>/<hash of every factor, traced files included>/rank_{rank}_{dp_rank}/<prefix>, as
        vLLM lays it (rank_0_0 in a single process; the hash is the same on every rank);
        None when the cache is off or cannot be written (then everything stays in memory). A
        CompilationConfig.cache_dir takes the root's place; vLLM uses it as the hash folder itself,
        but then two models given the same cache_dir would overwrite each other's pieces."""
        cc = self.compilation_config
        device = next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        key, self.cache_key_factors = cache_keys.backend_cache_key(cc, device, self.model_factors())
        if not caching.compile_cache_enabled(cc):
            return None
        root = Path(cc.cache_dir or cache_files.cache_root())
        local = root / key / cache_files.rank_folder() / self.prefix
        try:
            cache_files.atomic_write(local / "cache_key_factors.json",
                                     json.dumps(self.cache_key_factors, indent=1))
        except OSError as e:
            # a read-only (shared) cache: load from it
            if (local / "cache_key_factors.json").is_file():
                logger.warning("cannot write to the compile cache %s (%s); reading from it only",
                               local, e)
                return local
            logger.warning("cannot write to the compile cache %s (%s); compiling in memory only",
                           local, e)
            return None
        return local

    def __call__(self, gm: fx.GraphModule,
                 example_inputs: list) -> "caching.VllmSerializableFunction":
        if self.graphs:
            raise RuntimeError("VllmBackend is called once per model: Dynamo traced it a second "
                               "time (a guard was kept and failed?)")
        self.dynamo_time_s = None if self.from_saved_graph else dynamo_transform_time()
        compilation_counter.num_graphs_seen += 1  # vLLM counts the load's re-run too
        compilation_counter.num_dynamo_traces += 0 if self.from_saved_graph else 1
        self.graphs.append(gm)
        if self.compilation_config.backend == "inductor":
            refuse_unbacked_floats(gm)
        self.cache_dir = self._pick_cache_dir(example_inputs)
        self.compiler_manager.initialize_cache(self.cache_dir, self.prefix)
        self.configure_post_pass()
        cc = self.compilation_config
        warn_unknown_splitting_ops(cc.splitting_ops)
        self.split_gm, self.piecewise_graphs = split_graph(gm, cc.splitting_ops)
        self.record = StitchingRecord(self.split_gm)
        self._trace_config_and_split()
        compilation_counter.num_piecewise_graphs_seen += len(self.piecewise_graphs)
        names = [it.submod_name for it in self.piecewise_graphs if not it.is_splitting_graph]
        PiecewiseCompileInterpreter(self.split_gm, names, self).run(*example_inputs)
        self._write_computation_graph()
        self._widen_backed_ranges_for_evaluate_guards()
        pieces = [{"submod": pb.submod_name, "index": pb.piecewise_compile_index,
                   "sym_shape_indices": pb.sym_shape_indices,
                   # a loaded Inductor artifact returns a list even for a piece returning one value
                   "single_output": returns_single_value(pb.graph),
                   "entries": {r: e.compiled.artifact_path for r, e in pb.range_entries.items()}}
                  for pb in self.piecewise_backends]
        return caching.VllmSerializableFunction(self.record, cc, pieces, self.cache_dir,
                                                cc.compile_cache_save_format, example_inputs)

    def _trace_config_and_split(self) -> None:
        """What vLLM records for TORCH_TRACE before compiling the pieces: the config that decides
        them, and the split graph (tlparse lists both beside Dynamo's own pages)."""
        cc = self.compilation_config
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "vllm_compilation_config", "encoding": "json"},
            payload_fn=lambda: json.dumps({
                "prefix": self.prefix, "mode": cc.mode.name, "backend": cc.backend,
                "custom_ops": ", ".join(cc.custom_ops),
                "splitting_ops": ", ".join(cc.splitting_ops),
                "cudagraph_mode": str(cc.cudagraph_mode),
                "compile_sizes": ", ".join(map(str, cc.compile_sizes)),
                "compile_ranges_endpoints": ", ".join(map(str, cc.compile_ranges_endpoints)),
                "enabled_passes": ", ".join(f.name for f in dataclasses.fields(cc.pass_config)
                                            if getattr(cc.pass_config, f.name) is True)}))
        trace_structured("graph_dump", metadata_fn=lambda: {"name": "vllm_piecewise_split_graph"},
                         payload_fn=lambda: self.split_gm.print_readable(print_output=False))

    def _widen_backed_ranges_for_evaluate_guards(self) -> None:
        """As vLLM's VllmBackend.__call__: with evaluate_guards and BACKED shapes, a backed size
        Dynamo assumed >= 2 (it specialises 0 and 1) gets the lower bound 0, so the guards Dynamo
        builds after this backend returns do not refuse 1 token: the compiled pieces serve every
        size in their ranges, and evaluate_guards is left to catch real specialisations."""
        ds = self.compilation_config.dynamic_shapes_config
        if not (ds.evaluate_guards and ds.type == DynamicShapesType.BACKED):
            return
        from torch._guards import detect_fake_mode
        from torch.utils._sympy.value_ranges import ValueRanges

        shape_env = detect_fake_mode().shape_env
        for s, r in shape_env.var_to_range.items():
            if r.lower == 2:
                shape_env.var_to_range[s] = ValueRanges(0, r.upper)

    def _write_computation_graph(self) -> None:
        """The split graph, every piece's graph in it, as readable Python: into the cache folder,
        and into debug_dump_path when set (with the cache off too: the pieces are what one
        debugs)."""
        dump = self.compilation_config.compile_debug_dump_path()
        if self.cache_dir is None and not dump:
            return
        src = "from __future__ import annotations\nimport torch\n" + \
            self.split_gm.print_readable(print_output=False).replace("<lambda>", "GraphModule")
        if dump:
            path = Path(dump) / f"computation_graph_{self.prefix}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(src)
            logger.debug("Computation graph saved to %s", path)
        if self.cache_dir is None:
            return
        try:
            cache_files.atomic_write(self.cache_dir / "computation_graph.py", src)
        except OSError as e:
            logger.warning("cannot write to the compile cache %s (%s); continuing without it",
                           self.cache_dir, e)
