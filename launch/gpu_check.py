"""GPU check of CudaOps: op contract on GPU tensors and the wrapper's overhead.

Usage: ``PYTHONPATH=. python launch/gpu_check.py --out gpu_check.json`` (under 5 minutes).

1. contract: CudaOps vs ReferenceOps on the same CUDA tensors (varlen causal/non-causal/window,
   GQA 1 and 4; paged with block sizes 16/128 and per-query kv ranges; reshape_and_cache with
   -1 slots; merge with -inf), in bfloat16 (flash-attn path when installed) and float32
   (explicit path), max abs errors recorded with pass/fail;
2. timing: local prefill attention through ``CudaOps.varlen_attention`` vs calling
   ``flash_attn_varlen_func`` (or, without flash-attn, ``torch.nn.functional.
   scaled_dot_product_attention``) directly; ``overhead_ratio = wrapper / direct``.
Exit codes: 0 all passed, 1 a contract check failed, 2 no CUDA device (nothing run).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _cu(lengths, torch):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out)


def _compare(name, got, ref, tol, results):
    import torch
    (out, lse), (r_out, r_lse) = got, ref
    same_empty = bool(torch.equal(torch.isneginf(lse), torch.isneginf(r_lse)))
    fin = torch.isfinite(r_lse)
    err_out = float((out.float() - r_out.float()).abs().max()) if out.numel() else 0.0
    err_lse = float((lse[fin].float() - r_lse[fin].float()).abs().max()) if fin.any() else 0.0
    ok = same_empty and err_out <= tol and err_lse <= tol and not bool(torch.isnan(out).any())
    results.append(dict(name=name, ok=ok, max_abs_out=err_out, max_abs_lse=err_lse,
                        empty_rows_match=same_empty))


def contract(torch, dev, results) -> None:
    from cp_attention.ops.cuda import CudaOps
    from cp_attention.ops.reference import ReferenceOps

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


def _time(fn, torch, iters=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def timing(torch, dev) -> dict:
    from cp_attention.ops.cuda import CudaOps, load_flash_attn

    ops, flash = CudaOps(), load_flash_attn()
    lens = [2048, 1024, 4096, 512]
    t = sum(lens)
    q = torch.randn(t, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, 8, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = _cu(lens, torch).to(dev)
    cu32 = cu.to(torch.int32)
    wrapper = _time(lambda: ops.varlen_attention(q, k, v, cu, cu, scale=128 ** -0.5, causal=True),
                    torch)
    if flash is not None:
        direct_name = "flash_attn_varlen_func"
        direct = _time(lambda: flash.flash_attn_varlen_func(
            q, k, v, cu32, cu32, max(lens), max(lens), softmax_scale=128 ** -0.5, causal=True,
            return_attn_probs=True), torch)
    else:
        direct_name = "sdpa (per request, no LSE)"
        import torch.nn.functional as F

        def sdpa():
            for a, b in zip(cu.tolist(), cu.tolist()[1:]):
                F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1).repeat_interleave(4, 0),
                    v[a:b].transpose(0, 1).repeat_interleave(4, 0), is_causal=True)
        direct = _time(sdpa, torch)
    return dict(tokens=t, heads="32q/8kv", head_dim=128, dtype="bfloat16", wrapper_s=wrapper,
                direct=direct_name, direct_s=direct, overhead_ratio=wrapper / direct,
                flash_attn=flash is not None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON report")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device available; nothing was run (exit 2).")
        with open(args.out, "w") as f:
            json.dump(dict(ran=False, reason="no CUDA device"), f, indent=2)
        return 2
    dev = torch.device("cuda")
    results: list[dict] = []
    contract(torch, dev, results)
    report = dict(ran=True, device=torch.cuda.get_device_name(), torch=torch.__version__,
                  contract=results, all_ok=all(r["ok"] for r in results),
                  timing=timing(torch, dev))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(dict(all_ok=report["all_ok"], timing=report["timing"]), indent=2))
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
