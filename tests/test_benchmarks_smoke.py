"""Each benchmark's run() at tiny sizes into a tmp dir: JSON keys and values are sane.

Assertions on measured times (upper bounds, speed thresholds, one time against another) are in
the ``bench``-marked tests: deselected by default (pyproject's ``addopts``), run once, serially,
by ``.ci/run`` (``pytest -m bench``), since they depend on the machine's load. Each benchmark
runs once per module (a fixture), shared by its default test and its bench test."""
from __future__ import annotations

import json
import math
import sys

import pytest
from matplotlib.colors import to_rgba

from benchmarks import (bench_comm, bench_cost_model, bench_cpu_ops, bench_forward_checks,
                        bench_load_balance, bench_metadata, bench_op_overhead, bench_speed)
from benchmarks.engine_process import EngineFailed, EngineProcess, engine_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


def _load(out, name: str) -> dict:
    assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((out / f"{name}.json").read_text())
    assert data["benchmark"] == name and "torch" in data["environment"]
    return data


def test_load_balance(out):
    bench_load_balance.run(out, quick=True)
    data = _load(out, "bench_load_balance")
    assert {(r["pcp"], r["prompt"]) for r in data["rows"]} == {(2, 64), (2, 4096), (4, 64), (4, 4096)}
    for r in data["rows"]:
        assert r["head_tail_max_over_mean"] == pytest.approx(1.0, abs=1e-12)  # 2*pcp divides
        assert r["contiguous_max_over_mean"] == pytest.approx(r["contiguous_formula"], rel=2e-2)
    assert all(r["head_tail_max_over_mean"] < r["contiguous_max_over_mean"]
               for r in data["mixed_batch"]["rows"])


@pytest.mark.distributed
def test_comm(out):
    bench_comm.run(out, quick=True)
    data = _load(out, "bench_comm")
    assert data["all_formulas_match_measurement"] is True
    for r in data["measured"]["rows"]:
        assert r["cache_exact"] and r["max_err_vs_fp64"] < 1e-4
        assert r["decode_bytes_measured_per_rank"] == [r["decode_bytes_formula"]] * 4
        if r["pcp"] > 1:
            assert 1.0 <= r["prefill_over_bound"] < 1.2
        else:
            assert r["prefill_bytes_measured_per_rank"] == [0] * 4
    decode = data["formula_decode"]["rows"]
    for combo in {(r["pcp"], r["dcp"]) for r in decode}:
        sizes = {r["bytes_per_layer"] for r in decode if (r["pcp"], r["dcp"]) == combo}
        assert len(sizes) == 1 and sizes.pop() > 0  # flat in context length
    for r in data["window"]["measured"]:  # the planner's bytes, moved on real ranks
        assert r["cache_exact"] and r["max_err_vs_fp64"] < 1e-4
        assert r["bytes_measured_per_rank"] == [r["bytes_planned"]] * 4
        assert r["bytes_planned"] <= r["all_gather_bytes"]
    at_32k = {(r["model"], r["kv_shard"], r["window_cache"]): r["ratio"]
              for r in data["window"]["rows"] if r["pcp"] == 2 and r["prompt"] == 32768}
    for model in ("gemma3-270m", "gpt-oss"):  # issue 36's goal: at most 1/8 of the all-gather
        assert at_32k[(model, "cp", "window")] <= 1 / 8 and at_32k[(model, "dcp", "window")] <= 1 / 8
        assert at_32k[(model, "dcp", "all")] == 1.0  # every rank stores every token


@pytest.fixture(scope="module")
def speed_and_cost(out):
    bench_speed.run(out, quick=True)
    data = _load(out, "bench_speed")
    bench_cost_model.run(out, quick=True)  # reads bench_speed.json from ``out``
    cost = json.loads((out / "bench_cost_model.json").read_text())
    return data, cost


@pytest.mark.distributed
def test_speed_then_cost_model(out, speed_and_cost):
    data, cost = speed_and_cost
    assert [(r["q_heads"], r["kv_heads"], r["tokens"]) for r in data["rows"]] == [
        (4, 4, 512), (4, 4, 1024), (8, 2, 512), (8, 2, 1024)]  # the heads axis, GQA included
    for r in data["rows"]:
        for key in ("pcp1_s", "pcp2_s", "torch_ring_s", "cpu_pcp2_s", "sdpa_s", "bare_op_s"):
            assert r[key] > 0
        # each run did its share of the work: pcp=2 ranks hold half the prompt each
        assert r["local_rows"] == {"pcp1": r["tokens"], "pcp2": [r["tokens"] // 2] * 2,
                                   "torch_ring": [r["tokens"] // 2] * 2}
        assert r["outputs_finite"]
        # parallel time = the slowest rank's best repeat (not the fastest rank's)
        samples = r["samples"]
        assert r["pcp1_s"] == min(samples["pcp1"])
        assert r["pcp2_s"] == max(min(walls) for walls in samples["pcp2"])
        assert r["torch_ring_s"] == max(min(walls) for walls in samples["torch_ring"])
        assert r["torch_ring_calls_per_rank"] == 1  # the ring path ran, not a fallback
    assert (out / "cost_model.png").read_bytes()[:8] == PNG_MAGIC
    assert cost["fit"]["attention_flops_1_thread"] > 0
    assert cost["fit"]["link_bw_bytes_per_s"] > 0 and cost["fit"]["link_latency_s"] > 0
    assert [v["tokens"] for v in cost["validation_fitted"]] == [512, 1024]
    for v in cost["validation_fitted"]:
        assert 0 < v["speedup_predicted"] <= 2.0
    effs = cost["predictions"]["prefill_efficiency"]
    assert effs and all(0 < e["efficiency"] <= 1 for e in effs)
    assert all(m["recommended"]["pcp"] in (1, 2, 4, 8) for m in cost["predictions"]["recommendations"])


@pytest.mark.bench
@pytest.mark.distributed
def test_speed_timing_bounds(speed_and_cost):
    data, cost = speed_and_cost
    for r in data["rows"]:
        for key in ("pcp1_s", "pcp2_s", "torch_ring_s", "cpu_pcp2_s", "sdpa_s", "bare_op_s"):
            assert r[key] < 60
    assert cost["fit"]["attention_flops_1_thread"] > 1e8


@pytest.fixture(scope="module")
def metadata_data(out):
    bench_metadata.run(out, quick=True)
    return _load(out, "bench_metadata")


def test_metadata(metadata_data):
    data = metadata_data
    assert len(data["rows"]) == 3 * 2 * 2
    assert all(r["median_ms"] > 0 for r in data["rows"])
    # the verdict is the target applied to the largest batch measured (quick: 16 requests)
    largest = max(r["num_reqs"] for r in data["rows"])
    assert largest == 16 and data["meets_target"] == all(
        r["median_ms"] <= data["target_ms_at_256"] for r in data["rows"] if r["num_reqs"] == largest)
    funcs = [h["function"] for p in data["hot_spots"] for h in p["top_by_own_time"]]
    assert any(f.endswith(":build") for f in funcs)


@pytest.mark.bench
def test_metadata_timing_bounds(metadata_data):
    assert all(r["median_ms"] < 1000 for r in metadata_data["rows"])


@pytest.fixture(scope="module")
def op_overhead_data(out):
    bench_op_overhead.run(out, quick=True)
    return _load(out, "bench_op_overhead")


def test_op_overhead(op_overhead_data):
    data = op_overhead_data
    assert len(data["rows"]) == 4
    for r in data["rows"]:
        assert r["max_abs_diff"] < 1e-5  # same kernel underneath: same numbers
        assert r["overhead_ratio"] > 0 and math.isfinite(r["overhead_ratio"])


@pytest.mark.bench
def test_op_overhead_timing_bounds(op_overhead_data):
    for r in op_overhead_data["rows"]:
        assert 0.1 < r["overhead_ratio"] < 10


@pytest.fixture(scope="module")
def forward_checks_data(out):
    bench_forward_checks.run(out, quick=True)
    return _load(out, "bench_forward_checks")


def test_forward_checks(forward_checks_data):
    data = forward_checks_data
    assert [r["num_reqs"] for r in data["rows"]] == [1, 16]
    for r in data["rows"]:
        assert r["check_us"] > 0 and r["forward_us"] > 0 and r["debug_us"] > 0


@pytest.mark.bench
def test_forward_checks_timing_bounds(forward_checks_data):
    for r in forward_checks_data["rows"]:
        assert r["check_us"] < r["forward_us"]  # the O(1) check costs less than the forward


def test_speed_plot_uses_one_colour_per_series(tmp_path):
    """Both panels of the speed figure draw a series in the same colour; the speedup panel
    plots SDPA time / series time."""
    rows = [{"tokens": n, "sdpa_s": 2.2, "pcp1_s": 2.0, "pcp2_s": 1.1, "torch_ring_s": 1.4}
            for n in (512, 1024)]
    bars, lines = bench_speed._plot(rows, tmp_path).axes
    bar_colors = {c.get_label(): c.patches[0].get_facecolor() for c in bars.containers}
    series = {ln.get_label(): ln for ln in lines.get_lines()
              if not ln.get_label().startswith(("ideal", "goal"))}
    assert set(series) == {"cp_attention pcp=1 layer", "cp_attention pcp=2",
                           "torch ring CP, 2 ranks"}
    for label, line in series.items():
        assert bar_colors[label] == to_rgba(line.get_color()), label
    assert len(set(bar_colors.values())) == 4
    assert list(series["cp_attention pcp=2"].get_ydata()) == pytest.approx([2.0, 2.0])


def test_cpu_ops(out):
    bench_cpu_ops.run(out, quick=True)
    data = _load(out, "bench_cpu_ops")
    assert data["memory_read_bandwidth_gbs"] > 0 and len(data["rows"]) == 3
    for r in data["rows"]:
        assert r["ours_ms"] > 0 and r["sdpa_ms"] > 0
        assert max(r["max_abs_diff_vs_ours"].values()) < 5e-2  # same data, same attention


def test_cpu_ops_matrix(out):
    bench_cpu_ops.run_matrix(out, quick=True)
    data = _load(out, "bench_cpu_matrix")
    assert data["cpu"] and data["rows"] and len(data["rows"]) + len(data["skipped"]) == 9
    assert {r["kind"] for r in data["rows"]} == {"decode", "prefill"}
    assert {r["sequential_blocks"] for r in data["rows"] if r["kind"] == "decode"} == {False, True}
    for r in data["rows"]:
        assert r["max_abs_diff"] < 5e-2  # every implementation computes the same attention
        assert r["ours_ms"] > 0 and 0 < r["ours_fraction_of_roof"]
        if r["kind"] == "decode":  # ours is the worse of the two cache layouts
            assert r["ours_ms"] == max(r["ours_packed_ms"], r["ours_own_layout_ms"])
    table = bench_cpu_ops.matrix_markdown(data)
    assert "Worst rows" in table and table.count("\n| ") >= 3


def test_cpu_model_shapes(out):
    """Gemma 3's shapes with and without a window: every implementation computes the same
    windowed attention (ours, SDPA on the window or a band mask, and vLLM's kernel where vLLM
    is installed), caches flushed."""
    bench_cpu_ops.run_model_shapes(out, quick=True)
    data = _load(out, "bench_cpu_model_shapes")
    assert [(r["kind"], r["window"]) for r in data["rows"]] == [
        ("decode", None), ("decode", 512), ("prefill", None), ("prefill", 512)]
    for r in data["rows"]:
        assert (r["head_size"], r["q_heads"], r["kv_heads"]) == (256, 4, 1)
        # fp32: one key more or less in a window of 512 moves outputs by ~1e-2
        assert r["caches_flushed"] and r["max_abs_diff"] < 1e-4 and r["ours_ms"] > 0
    assert "rows at or under 1.0x" in bench_cpu_ops.model_shapes_markdown(data)


def test_window_rows_count_only_visible_keys():
    """A window of w: a decode reads its last w keys; a causal prefill of n tokens covers
    1 + 2 + ... + w pairs for its first w queries and w for each later one."""
    decode = {"kind": "decode", "batch": 1, "q_heads": 4, "kv_heads": 1, "head_size": 256,
              "context": 8192, "dtype": "float32", "window": 512}
    prefill = {**decode, "kind": "prefill", "context": 10, "window": 4}
    assert bench_cpu_ops.row_flops(decode) == 4 * 4 * 256 * 512
    assert bench_cpu_ops.row_bytes(decode) == 512 * 2 * 256 * 4
    assert bench_cpu_ops.row_flops(prefill) == 4 * 4 * 256 * (10 + 6 * 4)
    assert bench_cpu_ops.row_flops({**prefill, "window": None}) == 4 * 4 * 256 * 55


def test_matrix_goal_bound():
    """A row's lower bound on this CPU and the share of it the 0.8x-vLLM goal needs: a decode
    of B=2, 8/8 heads of 64 over 1000 keys is 4 * 2 * 8 * 64 * 1000 flops over 2 * 2 * 1000 *
    8 * 64 * 4 bytes of fp32 K/V; a causal prefill of 4 tokens covers 10 query-key pairs."""
    decode = {"kind": "decode", "batch": 2, "q_heads": 8, "head_size": 64, "context": 1000,
              "dtype": "float32", "vllm_ms": 0.1, "ours_packed_ms": 0.2,
              "ours_own_layout_ms": 0.25, "ours_ms": 0.25, "sdpa_ms": 1.0,
              "ours_over_vllm": 2.5, "kv_heads": 8, "sequential_blocks": False,
              "ours_over_sdpa": 0.25, "ours_fraction_of_roof": 0.5, "read_gbs": 100.0}
    prefill = {"kind": "prefill", "batch": 1, "q_heads": 1, "head_size": 1, "context": 4,
               "dtype": "bfloat16", "vllm_ms": 1e-6, "ours_ms": 2e-6, "sdpa_ms": 3e-6,
               "ours_over_vllm": 2.0, "kv_heads": 1, "ours_over_sdpa": 0.67,
               "ours_fraction_of_roof": 0.5, "read_gbs": 1.0}
    peaks = {"float32": 40.0, "bfloat16": 80.0}
    assert bench_cpu_ops.row_flops(decode) == 4 * 2 * 8 * 64 * 1000
    assert bench_cpu_ops.row_flops(prefill) == 4 * 10
    assert bench_cpu_ops.row_bytes(decode) == 2 * 2 * 1000 * 8 * 64 * 4
    assert bench_cpu_ops.row_bytes(prefill) == 4 * 4 * 2
    # decode: 4.096 MFLOP at 40 GFLOP/s = 0.1024 ms > 2.048 MB at 100 GB/s = 0.02048 ms
    decode["bound_ms"] = bench_cpu_ops.bound_ms(decode, peaks)
    assert decode["bound_ms"] == pytest.approx(0.1024)
    # prefill: 40 flops at 80 GFLOP/s = 5e-10 s < 32 bytes at 1 GB/s = 3.2e-8 s
    prefill["bound_ms"] = bench_cpu_ops.bound_ms(prefill, peaks)
    assert prefill["bound_ms"] == pytest.approx(3.2e-5)
    # the goal, 0.8x vLLM's time, is under both bounds; vLLM itself beat the decode's bound
    assert bench_cpu_ops.goal_share_of_bound(decode) == pytest.approx(0.1024 / 0.08)
    assert bench_cpu_ops.goal_share_of_bound(prefill) == pytest.approx(3.2e-5 / 0.8e-6)
    payload = {"rows": [decode, prefill], "matmul_gflops": 10.0, "vllm_available": True,
               "skipped": [], "peak_gflops": peaks}
    table = bench_cpu_ops.matrix_markdown(payload)
    assert "Rows above 0.8x vLLM: 2; on 2 of them 0.8x vLLM's time is under the row's bound" in table
    assert "2 measured times under it" in table


_ECHO_ENGINE = """
import json, sys
print("log line before ready")
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() == "fail":
        raise ValueError("1 validation error for ModelConfig\\n  Value error, no such config")
    print("RESULT " + json.dumps({"echo": line.strip()}), flush=True)
"""


def test_engine_process_requests_logs_and_failures(tmp_path):
    """The vLLM benchmarks' engine driver: a ready line, one JSON result per request line,
    everything else in the log; an engine that dies gives EngineFailed with its last error line
    (the line after a pydantic header) and leaves no process."""
    engine = EngineProcess("echo", [sys.executable, "-c", _ECHO_ENGINE], engine_env(),
                           tmp_path / "echo.log", ready="READY", result="RESULT ",
                           start_timeout_s=60, request_timeout_s=60)
    assert engine.request("a b") == {"echo": "a b"}
    assert engine.request("c") == {"echo": "c"}
    with pytest.raises(EngineFailed) as failed:
        engine.request("fail")
    assert failed.value.reason == "Value error, no such config"
    assert engine.proc.poll() is not None
    assert "log line before ready" in (tmp_path / "echo.log").read_text()
    with pytest.raises(EngineFailed):
        EngineProcess("dead", [sys.executable, "-c", "import sys; sys.exit(3)"], engine_env(),
                      tmp_path / "dead.log", ready="READY", result="RESULT ",
                      start_timeout_s=60, request_timeout_s=60)


def test_engine_env_drops_the_callers_vllm_settings(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    monkeypatch.setenv("CP_ATTENTION_VLLM_SHM", "0")
    env = engine_env(CP_ATTENTION_VLLM="1")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CP_ATTENTION_VLLM_SHM" not in env
    assert env["CP_ATTENTION_VLLM"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_run_all_knows_every_benchmark():
    """Every benchmarks/bench_*.py is run by run_all (bench_cpu_ops twice: its table and its
    --matrix) and has a results page whose method section exists in docs/performance.md."""
    from benchmarks import pages, run_all
    from benchmarks.common import REPO_ROOT
    modules = {p.stem for p in (REPO_ROOT / "benchmarks").glob("bench_*.py")}
    assert {b.module for b in run_all.BENCHMARKS} == modules
    assert {p.name for p in pages.PAGES} == set(run_all.ORDER)
    assert run_all.ORDER.index("bench_speed") < run_all.ORDER.index("bench_cost_model")
    for page in pages.PAGES:
        assert pages.method_anchor(page.method)


def test_results_pages_are_generated_from_the_committed_json():
    """results/<page>.md is what ``run_all --pages-only`` writes from the JSON in results/
    (after a benchmark run or a new JSON: ``python -m benchmarks.run_all --pages-only``)."""
    from benchmarks import pages
    from benchmarks.common import REPO_ROOT
    results = REPO_ROOT / "results"
    for page in pages.PAGES:
        assert (results / f"{page.name}.md").read_text() == pages.render(page, results), page.name
    assert (results / "README.md").read_text() == pages.index(results)
