"""A CPU stand-in for the parts of ``torch_npu`` that :class:`cp_attention.ops.npu.NpuOps` calls.

Tests only. Each function implements the *documented* semantics (Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md``,
``torch_npu-npu_fusion_attention.md`` for the band rule, ``torch_npu-npu_attention_update.md``,
and ``test/test_custom_ops/test_atb_reshape_and_cache.py``'s golden), with explicit float64
math that shares no code with ReferenceOps. It is deliberately unforgiving: it rejects
argument forms the real op rejects (tensor lengths instead of python lists, wrong mask shape,
non-int32 block tables/slots, dtypes outside float16/bfloat16 when ``strict``), and it
returns NaN LSE for rows that see no key, since the real op leaves that value unspecified.

``install(monkeypatch, strict=...)`` puts the module in ``sys.modules['torch_npu']``.
"""
from __future__ import annotations

import sys
import types

import torch

MAX_TOKENS = 2147483647
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


class EmulatorError(ValueError):
    """An argument the documented op would reject."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise EmulatorError(msg)


def _int_list(name: str, values) -> list[int]:
    _check(isinstance(values, (list, tuple)), f"{name} must be a python list of ints (SymInt[])")
    _check(all(isinstance(x, int) for x in values), f"{name} must hold python ints")
    return list(values)


def _check_compressed_mask(mask) -> None:
    _check(mask is not None, "sparse_mode 2/3/4 needs the compressed atten_mask")
    _check(mask.dtype in _MASK_DTYPES, f"atten_mask dtype {mask.dtype} not bool/int8/uint8")
    m = mask.reshape(mask.shape[-2], mask.shape[-1]) if mask.dim() > 2 else mask
    _check(tuple(m.shape) == (2048, 2048), f"compressed mask must be 2048x2048, got {tuple(mask.shape)}")
    _check(mask.dim() <= 2 or all(s == 1 for s in mask.shape[:-2]), "mask leading dims must be 1")
    expect = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    _check(bool((m.cpu().bool() == expect).all()), "compressed mask must be triu(1) (True = masked)")


def _visible(nq: int, nk: int, sparse_mode: int, pre: int, nxt: int) -> torch.Tensor:
    """[nq, nk] bool: key positions each query row may see; origin bottom-right."""
    pos = (torch.arange(nq) + (nk - nq))[:, None]
    keys = torch.arange(nk)[None, :]
    if sparse_mode == 0:
        return torch.ones(nq, nk, dtype=torch.bool)
    if sparse_mode == 3:
        return keys <= pos
    if sparse_mode == 4:
        return (keys >= pos - pre) & (keys <= pos + nxt)
    raise NotImplementedError(f"emulator has no sparse_mode {sparse_mode}")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 q [nq, H, D], k/v [nk, H, D] -> out [nq, H, D], lse [nq, H] (NaN if empty)."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("hqk,khd->qhd", p / torch.where(denom > 0, denom, torch.ones_like(denom)), v)
    lse = (m_safe + torch.log(denom)).squeeze(-1).transpose(0, 1)
    empty = ~visible.any(dim=1)
    lse[empty] = float("nan")
    return out, lse


def make_module(strict: bool = True) -> types.ModuleType:
    """A fake ``torch_npu``; ``strict`` enforces the float16/bfloat16 kernel dtypes."""
    mod = types.ModuleType("torch_npu")
    mod.__emulator__ = True
    mod.calls = []  # (op name, kwargs summary) for assertions on call shapes

    def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                        actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                        block_table=None, num_heads=1, scale=1.0,
                                        pre_tokens=MAX_TOKENS, next_tokens=MAX_TOKENS,
                                        input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
                                        inner_precise=0, block_size=0, softmax_lse_flag=False,
                                        **others):
        _check(not [n for n, x in others.items() if x is not None], f"unemulated args {others}")
        _check(pse_shift is None, "pse_shift is not emulated")
        _check(input_layout == "TND", "only input_layout='TND' is emulated")
        _check(query.dim() == 3 and query.is_contiguous(), "TND query must be contiguous [T, N, D]")
        if strict:
            _check(query.dtype in KERNEL_DTYPES, f"query dtype {query.dtype} not float16/bfloat16")
        _check(key.dtype == query.dtype and value.dtype == query.dtype, "q/k/v dtypes differ")
        _check(tuple(key.shape) == tuple(value.shape), "key and value shapes must match")
        t, n, d = query.shape
        _check(num_heads == n, f"num_heads {num_heads} != query heads {n}")
        n_kv = num_key_value_heads or n
        _check(n % n_kv == 0 and n // n_kv <= 64, "num_heads must be a multiple of kv heads (<= 64x)")
        q_ends = _int_list("actual_seq_lengths", actual_seq_lengths)
        kv_arg = _int_list("actual_seq_lengths_kv", actual_seq_lengths_kv)
        _check(all(b >= a for a, b in zip([0] + q_ends, q_ends)) and (not q_ends or q_ends[0] >= 0),
               "actual_seq_lengths must be non-decreasing cumulative ends")
        _check(not q_ends or q_ends[-1] <= t, "actual_seq_lengths exceeds T")
        batch = len(q_ends)
        if sparse_mode in (2, 3, 4):
            _check_compressed_mask(atten_mask)
        else:
            _check(sparse_mode == 0 and atten_mask is None, "only sparse_mode 0 without a mask, 3, 4")
        if block_table is not None:
            _check(block_table.dtype == torch.int32 and block_table.dim() == 2, "block_table: 2-D int32")
            _check(block_table.shape[0] == batch, "block_table rows != batch")
            _check(key.dim() in (3, 4) and block_size == key.shape[1], "block_size != cache dim 1")
            _check(block_size % 16 == 0 and block_size <= 1024, "TND PageAttention block_size")
            _check(key.shape[-1] * (key.shape[2] if key.dim() == 4 else 1) == n_kv * d,
                   "paged cache last dims != num_key_value_heads * D")
            _check(len(kv_arg) == batch, "paged actual_seq_lengths_kv needs one length per request")
            _check(all(0 <= x <= block_table.shape[1] * block_size for x in kv_arg), "kv length > table")
            flat_k = key.reshape(-1, n_kv, d)
            flat_v = value.reshape(-1, n_kv, d)
        else:
            _check(key.dim() == 3 and key.shape[1] == n_kv and key.shape[2] == d, "TND key [T, Nkv, D]")
            _check(len(kv_arg) == batch, "actual_seq_lengths_kv length != batch")
            _check(all(b >= a for a, b in zip([0] + kv_arg, kv_arg)), "kv ends must be cumulative")
            _check(not kv_arg or kv_arg[-1] <= key.shape[0], "actual_seq_lengths_kv exceeds T_kv")
        mod.calls.append(("fia", dict(batch=batch, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                                      next_tokens=next_tokens, paged=block_table is not None)))
        out = torch.zeros(t, n, d, dtype=torch.float64)
        lse = torch.full((t, n), float("nan"), dtype=torch.float64)
        group = n // n_kv
        for b in range(batch):
            qs, qe = (q_ends[b - 1] if b else 0), q_ends[b]
            if block_table is not None:
                nk = kv_arg[b]
                blocks = block_table[b, : -(-nk // block_size)].long()
                slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:nk]
                k_b, v_b = flat_k[slots], flat_v[slots]
            else:
                ks, ke = (kv_arg[b - 1] if b else 0), kv_arg[b]
                nk = ke - ks
                k_b, v_b = key[ks:ke], value[ks:ke]
            if qe == qs or nk == 0:
                continue
            vis = _visible(qe - qs, nk, sparse_mode, pre_tokens, next_tokens)
            o_b, l_b = _attend(query[qs:qe].double(),
                               k_b.double().repeat_interleave(group, dim=1),
                               v_b.double().repeat_interleave(group, dim=1), float(scale), vis)
            out[qs:qe], lse[qs:qe] = o_b, l_b
        lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        if not softmax_lse_flag:
            return out.to(query.dtype), torch.zeros(1, dtype=torch.float32)
        return out.to(query.dtype), lse.to(lse_dtype).unsqueeze(-1)

    def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        _check(slot_indices.dtype == torch.int32, "slot_indices must be int32")
        _check(key.dtype == key_cache.dtype and value.dtype == value_cache.dtype, "cache dtype")
        if strict:
            _check(key.dtype in KERNEL_DTYPES + (torch.int8,), f"cache dtype {key.dtype}")
        _check(key.shape[1:] == key_cache.shape[2:], "key [T, Hkv, D] vs cache [nb, bs, Hkv, D]")
        mod.calls.append(("reshape_and_cache", dict(tokens=key.shape[0])))
        bs = key_cache.shape[1]
        for i, slot in enumerate(slot_indices.tolist()):
            if slot < 0:
                continue
            key_cache[slot // bs, slot % bs] = key[i]
            value_cache[slot // bs, slot % bs] = value[i]

    def npu_attention_update(lse, local_out, update_type):
        _check(isinstance(lse, (list, tuple)) and len(lse) == len(local_out), "lists of equal size")
        _check(1 <= len(lse) <= 16, "sp must be in [1, 16]")
        _check(update_type in (0, 1), "update_type must be 0 or 1")
        _check(all(x.dtype == torch.float32 and x.dim() == 1 for x in lse), "lse: float32 [N]")
        d = local_out[0].shape[-1]
        _check(all(o.dim() == 2 and o.shape == (x.shape[0], d) for o, x in zip(local_out, lse)),
               "local_out: [N, D] matching lse")
        _check(8 <= d <= 512 and d % 8 == 0, "headDim must be in [8, 512] and a multiple of 8")
        mod.calls.append(("attention_update", dict(sp=len(lse))))
        lses = torch.stack([x.double() for x in lse])
        lse_max = lses.amax(dim=0)
        lse_m = lse_max + torch.log(torch.exp(lses - lse_max).sum(dim=0))  # NaN when all -inf
        out = sum(o.double() * torch.exp(x - lse_m)[:, None] for o, x in zip(local_out, lses))
        return out.to(local_out[0].dtype), (lse_m.float() if update_type == 1 else None)

    mod.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    mod._npu_reshape_and_cache = _npu_reshape_and_cache
    mod.npu_attention_update = npu_attention_update
    return mod


def install(monkeypatch, strict: bool = True) -> types.ModuleType:
    """Put a fresh emulator in ``sys.modules['torch_npu']`` for the test's duration."""
    mod = make_module(strict)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    return mod
