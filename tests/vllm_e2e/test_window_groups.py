"""One metadata builder for layers of different sliding windows, in process.

With the hybrid KV cache manager off (``--disable-hybrid-kv-cache-manager``, or where vLLM turns
it off itself), vLLM promotes sliding-window specs to full attention and puts every layer of
Gemma 3 (window 512 on 15 layers, none on 3) in one KV cache group: one metadata builder, whose
spec carries the window (``FullAttentionSpec.merge``) while each layer keeps its own. Our
builder used to build every step's metadata with the spec's window, and the global layers
refused it ("metadata was built for sliding_window=512 but this layer uses None"). It now
builds one per window of its layers, and each impl takes its own (``by_window``); vLLM's
CPU_ATTN takes the window from the layers too (``cpu_attn.py`` ``_group_sliding_window``).
End to end: ``test_gemma3.py`` (``cp_pcp2_dcp2_nohybrid``).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cp_attention.config import CPRanks
from test_plugin import _engine_config, make_tiny_llama_dir, vllm_batch, vllm_formula_slots

pytestmark = pytest.mark.vllm

WINDOW = 16


def test_builder_serves_layers_of_two_windows_like_vllm_cpu_attn(tmp_path, monkeypatch):
    """A group spec with window 16 over a windowed and a global layer: each impl's output
    equals vLLM's CPU_ATTN with that layer's window, over prefill, chunked and decode steps
    longer than the window."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cp_attention.integrations.vllm import backend

    heads, kv_heads, dim, bs = 4, 2, 32, 32
    windows = {"layer.0": WINDOW, "layer.1": None}
    monkeypatch.setattr(backend, "vllm_ranks", lambda cfg: CPRanks())  # one process, no groups
    monkeypatch.setattr(backend, "get_layers_from_vllm_config", lambda cfg, kind, names: {
        name: SimpleNamespace(sliding_window=windows[name]) for name in names}, raising=False)
    config = _engine_config(make_tiny_llama_dir(tmp_path))
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=dim,
                             dtype=torch.float32, sliding_window=WINDOW)  # the merged spec
    with set_current_vllm_config(config):
        ours_b = backend.CPVllmMetadataBuilder(spec, list(windows), config, torch.device("cpu"))
        ours = {name: backend.CPVllmImpl(heads, dim, dim ** -0.5, kv_heads, sliding_window=w)
                for name, w in windows.items()}
        ref_b = {name: cpu_attn.CPUAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))
                 for name in windows}
        for name, w in windows.items():
            ref_b[name].window_size = -1 if w is None else w  # what it reads from its layers
        ref = {name: cpu_attn.CPUAttentionBackendImpl(heads, dim, dim ** -0.5, kv_heads, None, w,
                                                      "auto")
               for name, w in windows.items()}
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(24, generator=gen).view(3, 8).to(torch.int32)
    caches = {name: (torch.zeros(24, kv_heads, bs, 2 * dim), torch.zeros(24, kv_heads, bs, 2 * dim))
              for name in windows}
    computed = np.zeros(3, dtype=int)
    for new in ([40, 7, 70], [1, 1, 1], [1, 30, 1], [1, 1, 1]):
        cm, _ = vllm_batch(computed, new, block_size=bs)
        cm.block_table_tensor = table  # the same blocks every step
        cm.slot_mapping = vllm_formula_slots(cm.query_start_loc_cpu, cm.positions, table, bs,
                                             1, 0, 1)
        n = int(sum(new))
        meta = ours_b.build(0, cm)
        for name in windows:
            layer = SimpleNamespace(isa=ref_b[name].isa, _k_scale_float=1.0, _v_scale_float=1.0)
            q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
            out_ours, out_ref = torch.zeros(n, heads, dim), torch.zeros(n, heads, dim)
            ours[name].forward(None, q, k, v, caches[name][0], meta, output=out_ours)
            ref_meta = ref_b[name].build(0, cm)
            ref[name].do_kv_cache_update(layer, k, v, caches[name][1], cm.slot_mapping)
            ref[name].forward(layer, q, k, v, caches[name][1], ref_meta, output=out_ref)
            torch.testing.assert_close(out_ours, out_ref, atol=1e-5, rtol=1e-5)
        computed = computed + np.asarray(new)


def test_builder_of_one_window_builds_one_metadata(tmp_path, monkeypatch):
    """The usual case (hybrid manager on: one window per group): one build per step."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from cp_attention.integrations.vllm import backend

    monkeypatch.setattr(backend, "vllm_ranks", lambda cfg: CPRanks())
    config = _engine_config(make_tiny_llama_dir(tmp_path))
    spec = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=WINDOW)
    with set_current_vllm_config(config):  # no such layers registered: the spec's window
        builder = backend.CPVllmMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
    assert list(builder.inners) == [WINDOW]
    cm, _ = vllm_batch([0], [40], block_size=32)
    meta = builder.build(0, cm)
    assert meta.by_window is None and meta.inner.sliding_window == WINDOW
