"""GPU check of CudaOps: op contract, the layer end to end on the device, CP over nccl, overhead.

Usage: ``PYTHONPATH=. python launch/gpu_check.py --out gpu_check.json`` (under 5 minutes).

The device comes from the launchers' device path (:mod:`cp_attention.launch.device`):
``--device auto`` (default) uses CUDA device 0 when there is one and otherwise runs every check
on CPU tensors and says so (``"device": "cpu"`` and a ``note`` in the report: flash-attn and nccl
are then not exercised); ``--device cuda`` fails (exit 2) without a GPU.

1. contract: CudaOps vs ReferenceOps on the same device tensors (varlen causal/non-causal/window,
   GQA 1 and 4; paged with block sizes 16/128 and per-query kv ranges; reshape_and_cache with
   -1 slots; merge with -inf), in bfloat16 (flash-attn path when installed) and float32
   (explicit path), max abs errors recorded with pass/fail;
2. layer: a mixed workload (prefills, prefix hit, chunked prefill, decodes) through the
   single-device impl with CudaOps on the device, every row against the float64 oracle;
3. cp: the same workload at pcp=2 on two ranks of the pool (nccl on two GPUs, gloo on the CPU
   here; skipped, with the reason, on a host with one GPU), ops chosen by ``get_ops(device)``;
4. timing: local prefill attention through ``CudaOps.varlen_attention`` vs calling
   ``flash_attn_varlen_func`` (or, without flash-attn, ``torch.nn.functional.
   scaled_dot_product_attention``) directly; ``overhead_ratio = wrapper / direct`` (smaller
   shapes and float32 on the CPU).
Exit codes: 0 all passed, 1 a check failed, 2 the forced device is unavailable (nothing run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

from cp_attention.config import CPConfig  # noqa: E402
from cp_attention.launch.device import (DeviceUnavailableError, choose_device,  # noqa: E402
                                        probe_device_counts, set_current_device)
from cp_attention.ops.cuda import CudaOps, load_flash_attn  # noqa: E402
from cp_attention.ops.reference import ReferenceOps  # noqa: E402
from cp_attention.testing.pool import RankPool  # noqa: E402
from cp_attention.testing.workload import Workload, run_workload  # noqa: E402

# Largest |layer output - float64 oracle| accepted in the layer and cp checks (float32).
LAYER_TOLERANCE = 1e-4


def _cu(lengths, torch):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out)


def _compare(name, got, ref, tol, results):
    (out, lse), (r_out, r_lse) = got, ref
    same_empty = bool(torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)))
    fin = torch.isfinite(r_lse)
    err_out = float((out.float() - r_out.float()).abs().max()) if out.numel() else 0.0
    err_lse = float((lse[fin].float() - r_lse[fin].float()).abs().max()) if fin.any() else 0.0
    ok = same_empty and err_out <= tol and err_lse <= tol and not bool(torch.isnan(out).any())
    results.append(dict(name=name, ok=ok, max_abs_out=err_out, max_abs_lse=err_lse,
                        empty_rows_match=same_empty))


def contract(torch, dev, results) -> None:
    ops, ref = CudaOps(), ReferenceOps()
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens = [5, 0, 37, 130], [9, 4, 37, 300]
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 2e-4)):
        for hq, hkv in ((8, 8), (8, 2)):
            q = torch.randn(sum(q_lens), hq, 128, generator=gen).to(dev, dtype)
            k = torch.randn(sum(k_lens), hkv, 128, generator=gen).to(dev, dtype)
            v = torch.randn(sum(k_lens), hkv, 128, generator=gen).to(dev, dtype)
            for causal, window in ((False, None), (True, None), (True, 16)):
                kw = dict(scale=128 ** -0.5, causal=causal, window=window)
                args = (q, k, v, _cu(q_lens, torch).to(dev), _cu(k_lens, torch).to(dev))
                _compare(f"varlen {dtype} gqa{hq // hkv} causal={causal} window={window}",
                         ops.varlen_attention(*args, **kw), ref.varlen_attention(*args, **kw),
                         tol, results)
        for block_size in (16, 128):
            nb, seq = 40, [3 * block_size + 7, 0, block_size]
            kc = torch.randn(nb, block_size, 2, 128, generator=gen).to(dev, dtype)
            vc = torch.randn(nb, block_size, 2, 128, generator=gen).to(dev, dtype)
            table = torch.randperm(nb, generator=gen)[:12].view(3, 4).to(dev)
            ql = [4, 2, 1]
            q = torch.randn(sum(ql), 8, 128, generator=gen).to(dev, dtype)
            hi = torch.tensor([seq[0] - 3, seq[0] - 2, seq[0] - 1, seq[0], 0, 0, block_size])
            lo = torch.tensor([0, block_size, 5, seq[0] - 20, 0, 0, 3])
            args = (q, kc, vc, table, _cu(ql, torch).to(dev), torch.tensor(seq).to(dev))
            for name, kw in (("full", {}), ("ranges", dict(kv_start=lo.to(dev), kv_end=hi.to(dev)))):
                _compare(f"paged {dtype} bs={block_size} {name}",
                         ops.paged_attention(*args, scale=0.1, **kw),
                         ref.paged_attention(*args, scale=0.1, **kw), tol, results)
    key, value = (torch.randn(9, 2, 128, generator=gen).to(dev) for _ in range(2))
    slots = torch.tensor([3, -1, 17, 40, -1, 0, 8, 9, 63]).to(dev)
    caches = [torch.zeros(4, 16, 2, 128, device=dev) for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    ref.reshape_and_cache(key, value, caches[2], caches[3], slots)
    results.append(dict(name="reshape_and_cache", ok=bool(torch.equal(caches[0], caches[2])
                                                          and torch.equal(caches[1], caches[3]))))
    oa, ob = (torch.randn(64, 8, 128, generator=gen).to(dev) for _ in range(2))
    la, lb = (torch.randn(64, 8, generator=gen).to(dev) for _ in range(2))
    la[::3], lb[::5] = float("-inf"), float("-inf")
    _compare("merge", ops.merge_attn_states(oa, la, ob, lb), ref.merge_attn_states(oa, la, ob, lb),
             1e-5, results)


def check_workload(dtype: str = "float32") -> Workload:
    """Prefills (one of 1 token), a prefix hit, a chunked prefill and decodes; 8 q / 2 kv heads."""
    steps = (((0, 160), (1, 1), (2, 37)), ((0, 1), (1, 1), (2, 1)), ((1, 70),),
             ((0, 1), (2, 1), (3, 100)), ((0, 1), (1, 1), (3, 47)),
             ((0, 1), (1, 1), (2, 1), (3, 1)))
    return Workload(CPConfig(), steps, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype)


def layer_check(dev) -> dict:
    """The single-device layer with CudaOps on ``dev`` over a mixed workload, vs the oracle."""
    report = run_workload(check_workload(), device=dev, ops=CudaOps())
    ok = report.max_err <= LAYER_TOLERANCE and report.cache_exact and not report.any_nan
    return dict(ok=ok, ops=report.ops, device=report.device, max_err=report.max_err,
                cache_exact=report.cache_exact, tolerance=LAYER_TOLERANCE)


def cp_check(dev, cuda_count: int) -> dict:
    """pcp=2 on two pool ranks of ``dev``'s type, ops from get_ops(device), vs the oracle."""
    if dev.type == "cuda" and cuda_count < 2:
        return dict(ok=True, ran=False, reason=f"pcp=2 needs 2 CUDA devices, found {cuda_count}")
    base = check_workload()
    w = Workload(CPConfig(pcp_size=2), base.steps, num_heads=8, num_kv_heads=2, head_size=64)
    with RankPool(2, device_type=dev.type) as pool:
        reports = pool.run("cp_attention.testing.workload.run_workload_task", w, timeout_s=300)
    ok = all(r.max_err <= LAYER_TOLERANCE and r.cache_exact and not r.any_nan for r in reports)
    return dict(ok=ok, ran=True, pcp=2, tolerance=LAYER_TOLERANCE,
                ranks=[dict(device=r.device, ops=r.ops, backend=r.backend, max_err=r.max_err,
                            cache_exact=r.cache_exact) for r in reports])


def _time(fn, sync, iters=20) -> float:
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def timing(torch, dev) -> dict:
    on_gpu = dev.type == "cuda"
    ops, flash = CudaOps(), load_flash_attn() if on_gpu else None
    lens = [2048, 1024, 4096, 512] if on_gpu else [128, 64, 256, 32]
    hq, hkv, dtype = (32, 8, torch.bfloat16) if on_gpu else (8, 2, torch.float32)
    sync = torch.get_device_module(dev).synchronize
    t = sum(lens)
    q = torch.randn(t, hq, 128, device=dev, dtype=dtype)
    k = torch.randn(t, hkv, 128, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    cu = _cu(lens, torch).to(dev)
    cu32 = cu.to(torch.int32)
    iters = 20 if on_gpu else 5
    wrapper = _time(lambda: ops.varlen_attention(q, k, v, cu, cu, scale=128 ** -0.5, causal=True),
                    sync, iters)
    if flash is not None:
        direct_name = "flash_attn_varlen_func"
        direct = _time(lambda: flash.flash_attn_varlen_func(
            q, k, v, cu32, cu32, max(lens), max(lens), softmax_scale=128 ** -0.5, causal=True,
            return_attn_probs=True), sync, iters)
    else:
        direct_name = "sdpa (per request, no LSE)"
        import torch.nn.functional as F

        def sdpa():
            for a, b in zip(cu.tolist(), cu.tolist()[1:]):
                F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(hq // hkv, 0),
                    v[a:b].transpose(0, 1).repeat_interleave(hq // hkv, 0), is_causal=True)
        direct = _time(sdpa, sync, iters)
    return dict(tokens=t, heads=f"{hq}q/{hkv}kv", head_dim=128, dtype=str(dtype).split(".")[-1],
                iters=iters, wrapper_s=wrapper,
                direct=direct_name, direct_s=direct, overhead_ratio=wrapper / direct,
                flash_attn=flash is not None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA device 0 if present, else the CPU (the report says so)")
    args = parser.parse_args(argv)
    cuda_count, _ = probe_device_counts("cuda")
    try:
        choice = choose_device(args.device, cuda_count=cuda_count, npu_count=0, local_rank=0,
                               local_world_size=1)
    except DeviceUnavailableError as exc:
        print(f"gpu_check: {exc}; nothing was run (exit 2).")
        with open(args.out, "w") as f:
            json.dump(dict(ran=False, reason=str(exc)), f, indent=2)
        return 2
    dev = choice.device
    set_current_device(dev)
    note = None
    if dev.type == "cpu":
        note = ("no CUDA device used: every check ran on CPU tensors (CudaOps' explicit path; "
                "flash-attn kernels and nccl were not exercised)")
        print(f"gpu_check: {note}")
    results: list[dict] = []
    contract(torch, dev, results)
    layer, cp = layer_check(dev), cp_check(dev, cuda_count)
    all_ok = all(r["ok"] for r in results) and layer["ok"] and cp["ok"]
    report = dict(ran=True, device=str(dev), note=note,
                  device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                  torch=torch.__version__, contract=results, layer=layer, cp=cp, all_ok=all_ok,
                  timing=timing(torch, dev))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(dict(device=report["device"], all_ok=all_ok, layer=layer, cp=cp,
                          timing=report["timing"]), indent=2))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
