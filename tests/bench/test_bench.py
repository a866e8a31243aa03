"""The benchmark suite runs end to end in its --quick configuration and writes the JSON the README's
Performance section is built from. Structure only: timings on shared machines prove nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minivllm_compile.bench.__main__ import NAMES, exit_code, targets
from minivllm_compile.bench.common import code_stats
from minivllm_compile.viz.kernels import call_stats

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

STATS = {"median", "min", "max", "q1", "q3", "n"}
CODE_STATS = {"buffers", "buffer_bytes", "generated_kernels", "copy_kernels", "extern_calls",
              "op_calls", "copy_calls"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # The bench runs on a fresh Inductor cache, where Inductor's ISA probe builds and dlopens a
    # program per ISA the CPU claims (~20 s of a ~100 s run here). This test checks the JSON's
    # structure, not the probe: Inductor's own switch takes the CPU's claim as the answer.
    env = {**os.environ, "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    proc = subprocess.run([sys.executable, "-m", "minivllm_compile.bench", "--quick",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout, out


def test_every_benchmark_ran_or_says_why_not(quick):
    res, _, _ = quick
    assert res["meta"]["quick"] is True
    for name in NAMES:
        assert "error" not in res[name], res[name]
    # the fresh-process Inductor benchmarks are skipped in --quick, and say so
    assert set(res["startup"]) == {"skipped"} and set(res["compile_scaling"]) == {"skipped"}


def test_overhead_structure(quick):
    o = quick[0]["overhead"]
    variants = {"eager", "bytecode_hook", "bytecode_hook_direct", "vllm_bytecode_hook",
                "vllm_direct", "stock",
                "stock_direct"}
    assert set(o["per_call_us"]) == variants
    assert set(o["per_call_us_second_process"]) == {"eager", "bytecode_hook",
                                                    "bytecode_hook_direct",
                                                    "dynamo_no_guards"}
    for by_n in [*o["per_call_us"].values(), *o["overhead_above_direct_us"].values()]:
        assert set(by_n) == {str(n) for n in o["config"]["sizes"]}
        for s in by_n.values():
            assert (set(s) == STATS and s["n"] == o["config"]["rounds"]
                    and s["min"] <= s["median"] <= s["max"])
    assert set(o["ratios"]) == {"bytecode_hook_vs_stock_overhead", "bytecode_hook_vs_stock_call",
                                "vllm_hook_vs_direct_call",
                                "dynamo_no_guards_vs_bytecode_hook_call",
                                "stock_vs_eager_call"}
    # a ratio is a positive number, or None where an overhead measured <= 0
    # (noise on a busy machine)
    assert all(v is None or v > 0 for v in o["ratios"].values())


def test_fix_functionalization_and_generate_structure(quick):
    res = quick[0]
    f = res["fix_functionalization"]
    for on in ("on", "off"):
        assert set(f[on]["code"]) == CODE_STATS
        assert set(f[on]["step_us"]) == STATS
    g = res["generate"]
    assert set(g["modes"]) == {"eager", "stock", "dynamo_trace_once", "vllm_compile",
                               "vllm_compile_custom_ops"}
    for m in g["modes"].values():
        assert (m["new_tokens"] >= 1 and m["decode_tok_s"]["median"] > 0
                and m["prefill_tok_s"]["median"] > 0)
    # the paired ratios behind the targets
    assert set(g["decode_ratio_per_round"]) == {"eager", "stock"}
    assert all(set(r) == STATS and r["min"] > 0 for r in g["decode_ratio_per_round"].values())


def test_ir_priority_structure(quick):
    """Each IR priority supported here (triton needs a GPU: under the interpreter it is left out),
    its compile time and decode step, and the ratios to native from the same run."""
    r = quick[0]["ir_priority"]
    assert r["priorities"][:2] == ["native", "vllm_c"] and "triton" not in r["priorities"]
    for p in r["priorities"]:
        assert set(r[p]["step_us"]) == STATS and r[p]["compile_s"] > 0
    assert set(r["ratios_vs_native"]) == set(r["priorities"]) - {"native"}
    assert all(v["step"] > 0 and v["compile"] > 0 for v in r["ratios_vs_native"].values())


def test_targets_printed_and_plots_written(quick):
    res, stdout, out = quick
    assert len(res["targets"]) == 4  # overhead (2) and generate (2); the skipped ones have none
    for t in res["targets"]:
        line = ("PASS" if t["pass"] else "FAIL") + f"  {t['target']}:"
        assert line in stdout
    for name in ("overhead", "fix_functionalization", "generate"):
        assert (out / f"{name}.png").stat().st_size > 0 and res["plots"][name] == f"{name}.png"


def test_code_stats_counts_as_the_notebooks_do():
    """The benchmark counts generated code with viz.call_stats (notebooks 05 and 13 too), its
    entries' sources added up."""
    code = ("cpp_fused_clone_0 = async_compile.cpp_pybinding(['float*'], r'''\nextern \"C\" void "
            "kernel(){}''')\ndef call(self, args):\n    buf0 = empty_strided_cpu((s72, 96), (96, "
            "1), torch.float32)\n    buf1 = empty_strided_cpu((4, 8), (8, 1), torch.bfloat16)\n    "
            "cpp_fused_clone_0(buf0)\n    buf0.copy_(arg0_1)\n")
    s = code_stats([code, code], n=16)
    assert s == {k: 2 * v for k, v in call_stats(code, num_tokens=16).items()}
    assert s == {"buffers": 4, "buffer_bytes": 2 * (16 * 96 * 4 + 4 * 8 * 2),
                 "generated_kernels": 2, "copy_kernels": 2, "extern_calls": 0, "op_calls": 0,
                 "copy_calls": 2}


def test_a_missed_target_fails_with_its_ratio():
    t = targets({"startup": {"aot_speedup_vs_cold": 6.0}})
    assert t == [{"target": "cold compile / AOT load", "value": 6.0, "op": ">=",
                  "limit": 10.0, "pass": False,
                  "measured": "first-call s, fresh processes"}]


def test_fusion_structure(quick):
    f = quick[0]["fusion"]
    # --quick: the FP8 model's compiles are left out
    assert set(f) == {"num_tokens", "qk_norm_rope"}
    row = f["qk_norm_rope"]
    for side in ("fused", "unfused"):
        assert set(row[side]) == {"code", "step_us"} and set(row[side]["code"]) == CODE_STATS
        assert set(row[side]["step_us"]) == STATS
    # the fused op replaces an rms_norm per q and k and the rotary call, in each attention layer
    assert row["fused"]["code"]["op_calls"] < row["unfused"]["code"]["op_calls"]
    assert row["ratio_unfused_vs_fused_step"] > 0


def test_an_overhead_at_or_below_zero_is_no_pass_and_a_full_run_then_fails():
    t = targets({"overhead": {"ratios": {"bytecode_hook_vs_stock_overhead": None,
                                         "vllm_hook_vs_direct_call": 1.0}}})
    assert [x["pass"] for x in t] == [False, True] and "not measured" in t[0]["measured"]
    assert exit_code({"targets": t, "meta": {"quick": False}}) == 1
    # --quick: figures are meaningless
    assert exit_code({"targets": t, "meta": {"quick": True}}) == 0
    assert exit_code({"targets": t[1:], "meta": {"quick": False}}) == 0


def test_cuda_graphs_structure(quick):
    c = quick[0]["cuda_graphs"]
    assert set(c["modes"]) == {"eager", "vllm_compile_no_graphs", "piecewise", "full",
                               "full_and_piecewise"}
    for name, row in c["modes"].items():
        # only on CUDA, where this project's attention cannot be in a FULL graph
        if "refused" in row:
            assert c["config"]["device"] == "cuda" and name == "full"
            continue
        assert row["max_abs_diff_vs_eager"] <= 1e-4, name  # every mode computes the same step
        assert row["launches_per_step"]["total"] > 0 and row["step_us"]["n"] >= 2
    if c["config"]["device"] == "cpu":  # the CPU stand-in: no launches to save, every mode as asked
        assert all(row["resolved"] == row["requested"] for row in c["modes"].values())
        assert "a CPU launches nothing" in c["modes"]["piecewise"]["launches_per_step"]["what"]
        # eager runs the opaque custom ops, its norms excepted: on a CPU the IR priority is native
        # (vLLM's CPU default; on CUDA, with nothing compiling, vllm_c, the custom op)
        eager_ops = c["modes"]["eager"]["launches_per_step"]["by_name"]
        assert "minivllm::rotary_embedding" in eager_ops
        assert "minivllm::rms_norm" not in eager_ops and "aten::rsqrt" in eager_ops


def test_the_whole_process_start_up_has_its_own_target():
    t = targets({"startup": {"aot_speedup_vs_cold": 12.0, "process_speedup_vs_cold": 5.0}})
    assert [(x["target"], x["pass"]) for x in t] == [("cold compile / AOT load", True),
                                                    ("cold process / warm (AOT-loading) "
                                                     "process", False)]


def test_the_thread_count_each_benchmark_ran_with_is_reported(quick):
    res, stdout, _ = quick
    threads = res["torch_threads"]
    assert set(threads) == set(NAMES) and res["meta"]["torch_default_threads"] >= 1
    assert threads["overhead"] == [1] and threads["fusion"] == [1]  # one thread: steady ratios
    assert threads["generate"] == [res["meta"]["cpus"]]
    assert "[bench] torch threads:" in stdout and "[bench] generate done in" in stdout
    assert f"(torch threads: {res['meta']['cpus']})" in stdout
