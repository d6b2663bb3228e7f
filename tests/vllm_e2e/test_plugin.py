"""The vLLM plugin's pieces, in process: registration (opt-in, version range), start-up
refusals, slot-mapping shim, batch translation, config mapping, KV-cache view, the impl's log
line and PCP handshake, PCP metadata and hidden-state restore from vLLM-shaped inputs (end to
end: test_e2e.py, test_e2e_pcp.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from cp_attention.config import CPConfig, CPRanks
from cp_attention.integrations import vllm as plugin
from cp_attention.integrations.vllm.adapter import (SlotMappingMismatch, UnsupportedLayout,
                                                    check_slot_mapping, cp_config_from_vllm,
                                                    expected_vllm_dcp_rank, local_input_rows,
                                                    pack_held_rows, pick_held_rows, row_order,
                                                    rows_holding, slots_in_vllm_order,
                                                    step_from_vllm)
from cp_attention.integrations.vllm.slot_mapping import (cp_slot_mapping,
                                                         install_slot_mapping_shim,
                                                         make_slot_mapping_impl)
from cp_attention.metadata.builder import MetadataBuilder
from cp_attention.ops import ReferenceOps
from cp_attention.ops.cpu_build import load_cpu_extension
from cp_attention.parallel import CPGroups
from cp_attention.testing.dense import dense_attention

pytestmark = pytest.mark.vllm


# -- helpers --------------------------------------------------------------------------------
def vllm_formula_slots(qsl, positions, table, block_size, world, rank, interleave):
    """vLLM's slot formula (``ComputeSlotMappingKernel``, block_table.py), written here in
    torch independently of cp_attention's ``KVSharding``: -1 where ``rank`` does not store."""
    lens = qsl[1:].to(torch.int64) - qsl[:-1].to(torch.int64)
    req = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    pos = positions[:int(qsl[-1])].to(torch.int64)
    vblock, voff = pos // (block_size * world), pos % (block_size * world)
    local = (voff // interleave) % world == rank
    offset = (voff // (world * interleave)) * interleave + voff % interleave
    blocks = table[req, vblock].to(torch.int64)
    return torch.where(local, blocks * block_size + offset, torch.full_like(offset, -1))


def vllm_batch(computed, new, block_size, world=1, rank=0, interleave=1, max_blocks=8, seed=0):
    """A vLLM ``CommonAttentionMetadata`` (CPU) with vLLM-formula slots; also returns positions."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    computed, new = np.asarray(computed), np.asarray(new)
    num_reqs = len(new)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(new)])).to(torch.int32)
    seq_lens = torch.from_numpy(computed + new).to(torch.int32)
    table = torch.randperm(num_reqs * max_blocks, generator=gen)[:num_reqs * max_blocks]
    table = table.view(num_reqs, max_blocks).to(torch.int32)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new)]).to(torch.int64)
    slots = vllm_formula_slots(qsl, positions, table, block_size, world, rank, interleave)
    meta = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=num_reqs,
        num_actual_tokens=int(new.sum()), max_query_len=int(new.max()),
        max_seq_len=int(seq_lens.max()), block_table_tensor=table, slot_mapping=slots,
        positions=positions)
    return meta, positions


def build(cm, config: CPConfig, ranks: CPRanks = CPRanks()):
    step = step_from_vllm(cm.query_start_loc_cpu, cm.seq_lens, cm.block_table_tensor, cm.num_reqs)
    return step, MetadataBuilder(config, ranks).build(step)


# -- import hygiene and registration --------------------------------------------------------
def test_core_package_never_imports_vllm():
    code = ("import sys, cp_attention, cp_attention.integrations.vllm, "
            "cp_attention.integrations.vllm.adapter, cp_attention.integrations.vllm.slot_mapping, "
            "cp_attention.testing.workload; "
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != plugin.ENV_ENABLE})
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture
def clean_registry(monkeypatch):
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def unhook():  # undo the PCP config hooks of an earlier register()
        for cls, name in ((VllmConfig, "_get_v1_model_runner_unsupported_features"),
                          (ModelConfig, "verify_with_parallel_config")):
            method = getattr(cls, name)
            setattr(cls, name, getattr(method, "__wrapped__", method))

    original = cpu_tl._compute_slot_mapping_kernel_impl
    AttentionBackendEnum.CPU_ATTN.clear_override()
    unhook()
    yield AttentionBackendEnum, cpu_tl, original
    AttentionBackendEnum.CPU_ATTN.clear_override()
    cpu_tl._compute_slot_mapping_kernel_impl = original
    unhook()


def test_register_does_nothing_without_opt_in(clean_registry, monkeypatch):
    enum, cpu_tl, original = clean_registry
    for value in (None, "0", ""):
        if value is None:
            monkeypatch.delenv(plugin.ENV_ENABLE, raising=False)
        else:
            monkeypatch.setenv(plugin.ENV_ENABLE, value)
        plugin.register()
        assert enum.CPU_ATTN.get_path() == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
        assert cpu_tl._compute_slot_mapping_kernel_impl is original


def test_register_overrides_cpu_attn_and_installs_shim_once(clean_registry, monkeypatch):
    enum, cpu_tl, original = clean_registry
    monkeypatch.setenv(plugin.ENV_ENABLE, "1")
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once per process
    assert enum.CPU_ATTN.get_path() == plugin.BACKEND_CLASS_PATH
    from cp_attention.integrations.vllm.backend import CPVllmBackend

    assert enum.CPU_ATTN.get_class() is CPVllmBackend
    assert cpu_tl._compute_slot_mapping_kernel_impl.__wrapped__ is original
    assert not install_slot_mapping_shim()  # already installed


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "0.3.2", "dev"])
def test_register_refuses_untested_vllm_when_opted_in(clean_registry, monkeypatch, version):
    import vllm

    enum, cpu_tl, original = clean_registry
    monkeypatch.setattr(vllm, "__version__", version)
    monkeypatch.delenv(plugin.ENV_ENABLE, raising=False)
    plugin.register()  # not opted in: no check, vLLM untouched
    monkeypatch.setenv(plugin.ENV_ENABLE, "1")
    with pytest.raises(plugin.UnsupportedVllmVersion) as err:
        plugin.register()
    assert f"found vLLM '{version}'" in str(err.value) and "0.32.x" in str(err.value)
    assert enum.CPU_ATTN.get_path() == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    assert cpu_tl._compute_slot_mapping_kernel_impl is original


def test_vllm_032_releases_accepted():
    for version in ("0.32.0", "0.32.1", "0.32.0+cpu", "0.32.1.dev4+g12ab"):
        plugin.check_vllm_version(version)


def test_backend_contract():
    from vllm.v1.attention.backend import AttentionBackend, MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from cp_attention.integrations.vllm.backend import CPVllmBackend, CPVllmImpl

    assert issubclass(CPVllmBackend, AttentionBackend)
    assert CPVllmBackend.get_name() in AttentionBackendEnum.__members__
    assert CPVllmBackend.supports_dcp() and CPVllmBackend.supports_pcp()  # cp_utils.py:36
    assert CPVllmImpl.can_return_lse_for_decode  # vllm/v1/worker/cp_utils.py:51
    assert CPVllmBackend.forward_includes_kv_cache_update
    assert CPVllmBackend.supports_dtype(torch.float32) and CPVllmBackend.supports_dtype(torch.bfloat16)
    sizes = CPVllmBackend.get_supported_kernel_block_sizes()
    assert sizes == [MultipleOf(16)] and CPVllmBackend.supports_block_size(32)
    assert not CPVllmBackend.supports_block_size(8)


def test_cp_config_from_vllm_parallel_config():
    from vllm.config import ParallelConfig

    pc = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2,
                        cp_kv_cache_interleave_size=16)
    cfg = cp_config_from_vllm(pc, block_size=32, decode_threshold=1)
    assert (cfg.tp_size, cfg.dcp_size, cfg.pcp_size, cfg.block_size, cfg.cp_kv_interleave_size,
            cfg.kv_shard, cfg.kv_world) == (4, 2, 1, 32, 16, "dcp", 2)
    with pytest.raises(ValueError, match="cp_kv_interleave_size"):
        cp_config_from_vllm(pc, block_size=24)


@pytest.mark.parametrize("tp, pcp, dcp, expected", [
    (2, 1, 2, (1, 2, "dcp", 2)),  # DCP over consecutive TP ranks
    (1, 2, 1, (2, 1, "dcp", 1)),  # PCP alone: full KV on every PCP rank
    (2, 2, 1, (2, 1, "dcp", 1)),
    (2, 2, 2, (2, 1, "cp", 2)),  # vLLM's DCP group spans the PCP ranks: KV sharded over PCP
    (1, 2, 2, (2, 1, "cp", 2)),
])
def test_cp_config_maps_both_pcp_layouts(tp, pcp, dcp, expected):
    from vllm.config import ParallelConfig

    pc = ParallelConfig(tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
                        decode_context_parallel_size=dcp)
    cfg = cp_config_from_vllm(pc, block_size=32)
    assert (cfg.pcp_size, cfg.dcp_size, cfg.kv_shard, cfg.kv_world) == expected


def test_cp_config_layout_matches_vllm_groups():
    """vLLM's own group construction (parallel_state.py:2222): DCP spans PCP first. Our KV
    shard of every worker must equal vLLM's DCP rank, and DCP groups = our KV groups."""
    import torch as t

    for tp, pcp, dcp in [(2, 2, 2), (1, 2, 2), (4, 1, 2), (2, 2, 1)]:
        all_ranks = t.arange(tp * pcp).reshape(1, 1, 1, pcp, tp)  # as initialize_model_parallel
        ranks = all_ranks.transpose(-1, -2) if dcp > 1 else all_ranks
        groups = [g.tolist() for g in ranks.reshape(-1, dcp).unbind(0)]
        from vllm.config import ParallelConfig

        cfg = cp_config_from_vllm(ParallelConfig(tensor_parallel_size=tp,
                                                 prefill_context_parallel_size=pcp,
                                                 decode_context_parallel_size=dcp), 32)
        for group in groups:
            for vllm_dcp_rank, world_rank in enumerate(group):
                pcp_rank, tp_rank = divmod(world_rank, tp)
                ours = CPRanks.of(cfg, world_rank)
                assert expected_vllm_dcp_rank(cfg, pcp_rank, tp_rank) == (vllm_dcp_rank if dcp > 1 else 0)
                assert cfg.kv_rank(ours.pcp_rank, ours.dcp_rank) == (vllm_dcp_rank if dcp > 1 else 0)


def test_cp_config_refuses_dcp_over_tp_and_pcp():
    from vllm.config import ParallelConfig

    pc = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                        decode_context_parallel_size=4)
    with pytest.raises(UnsupportedLayout, match="--decode-context-parallel-size 4"):
        cp_config_from_vllm(pc, block_size=32)


def _engine_config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(model), skip_tokenizer_init=True, load_format="safetensors",
                enforce_eager=True, block_size=32, max_model_len=256)
    return EngineArgs(**{**args, **kwargs}).create_engine_config()


@pytest.fixture
def pcp_plugin(monkeypatch, clean_registry):
    """The plugin registered (undone afterwards by clean_registry)."""
    monkeypatch.setenv(plugin.ENV_ENABLE, "1")
    plugin.register()


def test_vllm_rejects_pcp_without_plugin(tmp_path, monkeypatch, clean_registry):
    """Without CP_ATTENTION_VLLM=1 vLLM's own refusal stays (vllm/config/vllm.py:2960/3198)."""
    from tiny_model import make_tiny_llama

    monkeypatch.delenv(plugin.ENV_ENABLE, raising=False)
    plugin.register()
    with pytest.raises(ValueError, match="Model Runner V1 does not support: prefill context"):
        _engine_config(make_tiny_llama(tmp_path / "tiny"), prefill_context_parallel_size=2)


def test_plugin_lifts_pcp_refusal_and_selects_pcp_worker(tmp_path, pcp_plugin):
    from cp_attention.integrations.vllm.config_hook import PCP_WORKER

    model = make_tiny_llama_dir(tmp_path)
    config = _engine_config(model, prefill_context_parallel_size=2)
    assert config.parallel_config.worker_cls == PCP_WORKER
    plain = _engine_config(model)  # pcp = 1: vLLM's own worker
    assert plain.parallel_config.worker_cls != PCP_WORKER
    explicit = _engine_config(model, prefill_context_parallel_size=2, worker_cls=PCP_WORKER)
    assert explicit.parallel_config.worker_cls == PCP_WORKER  # usable as --worker-cls


def make_tiny_llama_dir(tmp_path):
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path / "tiny", num_kv_heads=2)


@pytest.mark.parametrize("kwargs, flag", [
    ({"enforce_eager": False}, "--enforce-eager"),
    ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size"),
    ({"enable_lora": True}, "--enable-lora"),
    ({"worker_cls": "my.Worker"}, "--worker-cls my.Worker"),
])
def test_plugin_refuses_unsupported_pcp_combinations(tmp_path, pcp_plugin, kwargs, flag):
    """Each refusal happens while the config is built and names the flag."""
    with pytest.raises(ValueError) as err:
        _engine_config(make_tiny_llama_dir(tmp_path), prefill_context_parallel_size=2, **kwargs)
    assert flag in str(err.value), str(err.value)


@pytest.mark.parametrize("pcp, dcp, no_hybrid, replicated", [
    (2, 2, False, True),  # PCP x DCP with the hybrid KV cache manager: window KV whole per rank
    (2, 2, True, False),  # hybrid manager off: window layers kept as full attention, sharded
    (2, 1, False, False),  # no DCP: every rank keeps every layer's KV whole anyway
    (1, 1, False, False),
])
def test_window_kv_replicated_rule(tmp_path, pcp_plugin, pcp, dcp, no_hybrid, replicated):
    """Which deployments keep sliding-window KV whole on every DCP rank, and the CPConfig those
    layers' builders and impls then share: vLLM's (pcp, 1) mapping (no KV group, no merge)."""
    from cp_attention.integrations.vllm.adapter import engine_cp_config, window_kv_replicated

    config = _engine_config(make_tiny_llama_dir(tmp_path), prefill_context_parallel_size=pcp,
                            decode_context_parallel_size=dcp,
                            disable_hybrid_kv_cache_manager=no_hybrid)
    assert window_kv_replicated(config) is replicated
    whole = engine_cp_config(config, kv_replicated=True)
    assert (whole.pcp_size, whole.dcp_size, whole.kv_shard, whole.kv_world) == (pcp, 1, "dcp", 1)
    sharded = engine_cp_config(config)
    assert sharded.kv_world == dcp and (whole is sharded) == (dcp == 1)


def test_plugin_runs_ngram_speculation_under_pcp(tmp_path, pcp_plugin):
    """ngram drafts come from token ids on the host (no draft KV): accepted with pcp = 2 and
    pcp = dcp = 2, with the PCP worker and decode_threshold 1 + speculative tokens."""
    from cp_attention.integrations.vllm.adapter import engine_cp_config
    from cp_attention.integrations.vllm.config_hook import PCP_WORKER

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    for dcp in (1, 2):
        config = _engine_config(make_tiny_llama_dir(tmp_path / f"d{dcp}"),
                                prefill_context_parallel_size=2,
                                decode_context_parallel_size=dcp, speculative_config=spec)
        assert config.parallel_config.worker_cls == PCP_WORKER
        assert engine_cp_config(config).decode_threshold == 4


def test_plugin_refuses_draft_model_speculation_under_pcp(tmp_path, pcp_plugin):
    """A draft model keeps its own KV cache, which PCP does not shard: refused, naming the
    method and the flag."""
    model = make_tiny_llama_dir(tmp_path)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as err:
        _engine_config(model, prefill_context_parallel_size=2, speculative_config=spec)
    text = str(err.value)
    assert "--speculative-config" in text and "'draft_model'" in text, text
    assert "only 'ngram' runs" in text, text


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (9, 3), (4, 4)])
def test_vllm_refuses_dcp_for_gqa_without_plugin(tmp_path, clean_registry, monkeypatch, heads,
                                                 kv_heads):
    """vLLM's own rule (vllm/config/model.py:1566): DCP on a GQA model needs tp > KV heads."""
    from tiny_model import make_tiny_llama

    monkeypatch.delenv(plugin.ENV_ENABLE, raising=False)
    model = make_tiny_llama(tmp_path / "m", num_kv_heads=kv_heads, num_attention_heads=heads,
                            hidden_size=16 * heads)  # HF: hidden a multiple of the heads
    with pytest.raises(ValueError, match="requires `--tensor-parallel-size`"):
        _engine_config(model, prefill_context_parallel_size=2, decode_context_parallel_size=2)


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 1), (9, 3, 1), (4, 4, 1), (4, 2, 2),
                                                 (4, 1, 2)])
def test_plugin_runs_dcp_over_pcp_for_any_kv_heads(tmp_path, pcp_plugin, heads, kv_heads, tp):
    """pcp = dcp = 2 (KV sharded over the PCP ranks) is accepted for any KV-head count, with
    the PCP worker and our kv_shard="cp" mapping; the DCP value vLLM sees is kept."""
    from tiny_model import make_tiny_llama

    from cp_attention.integrations.vllm.config_hook import PCP_WORKER

    model = make_tiny_llama(tmp_path / "m", num_kv_heads=kv_heads, num_attention_heads=heads,
                            hidden_size=16 * heads)  # HF: hidden a multiple of the heads
    config = _engine_config(model, prefill_context_parallel_size=2,
                            decode_context_parallel_size=2, tensor_parallel_size=tp)
    pc = config.parallel_config
    assert (pc.prefill_context_parallel_size, pc.decode_context_parallel_size) == (2, 2)
    assert pc.worker_cls == PCP_WORKER
    ours = cp_config_from_vllm(pc, config.cache_config.block_size)
    assert (ours.pcp_size, ours.dcp_size, ours.tp_size, ours.kv_shard, ours.kv_world) == (
        2, 1, tp, "cp", 2)


@pytest.mark.parametrize("kwargs, message", [
    # DCP over TP ranks (pcp = 1) still needs tp > KV heads: vLLM's refusal, plus our hint
    ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
     "--prefill-context-parallel-size 2 --decode-context-parallel-size 2 shards the KV"),
    # DCP over TP x PCP: vLLM's GQA rule, then ours (dcp = 1 or pcp only)
    ({"tensor_parallel_size": 2, "prefill_context_parallel_size": 2,
      "decode_context_parallel_size": 4}, "requires `--tensor-parallel-size` (2)"),
    # dcp not in (1, pcp, tp * pcp): vLLM's ParallelConfig refuses it before any hook
    ({"prefill_context_parallel_size": 2, "decode_context_parallel_size": 3},
     "valid DCP sizes are"),
])
def test_plugin_keeps_refusing_dcp_layouts_it_cannot_run(tmp_path, pcp_plugin, kwargs, message):
    with pytest.raises(ValueError) as err:
        _engine_config(make_tiny_llama_dir(tmp_path), **kwargs)
    assert message in str(err.value), str(err.value)


def test_dcp_hook_leaves_parallel_config_and_is_idempotent(tmp_path, pcp_plugin):
    from vllm.config import ModelConfig

    from cp_attention.integrations.vllm.config_hook import install_pcp_config_hook

    hooked = ModelConfig.verify_with_parallel_config
    assert not install_pcp_config_hook() and ModelConfig.verify_with_parallel_config is hooked
    config = _engine_config(make_tiny_llama_dir(tmp_path), prefill_context_parallel_size=2,
                            decode_context_parallel_size=2)
    config.model_config.verify_with_parallel_config(config.parallel_config)  # again: no error
    assert config.parallel_config.decode_context_parallel_size == 2


def test_pcp_refusal_list_covers_multimodal_and_mla():
    """Flags vLLM cannot even build a config for on this tiny model: checked on the list."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from cp_attention.integrations.vllm.config_hook import pcp_unsupported

    def config(**model):
        mc = dict(enforce_eager=True, is_multimodal_model=False, is_encoder_decoder=False,
                  use_mla=False, runner_type="generate")
        return SimpleNamespace(
            parallel_config=ParallelConfig(prefill_context_parallel_size=2),
            model_config=SimpleNamespace(**{**mc, **model}),
            cache_config=SimpleNamespace(block_size=32, kv_sharing_fast_prefill=False,
                                         enable_prefix_caching=True),
            speculative_config=None, lora_config=None, kv_transfer_config=None)

    assert pcp_unsupported(config()) == []
    assert "multimodal" in " ".join(pcp_unsupported(config(is_multimodal_model=True)))
    assert "MLA" in " ".join(pcp_unsupported(config(use_mla=True)))
    assert "--runner pooling" in " ".join(pcp_unsupported(config(runner_type="pooling")))


# -- slot mapping -----------------------------------------------------------------------------
@pytest.mark.parametrize("world,interleave,block_size", [(1, 1, 16), (2, 1, 16), (2, 16, 32),
                                                         (4, 4, 16), (4, 16, 16), (2, 2, 32)])
def test_shim_slots_equal_vllm_formula(world, interleave, block_size):
    rng = np.random.default_rng(world * 100 + interleave + block_size)
    computed = rng.integers(0, 200, size=5)
    new = rng.integers(1, 40, size=5)
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]))
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(computed, new)]))
    table = torch.from_numpy(rng.permutation(5 * 16).reshape(5, 16)).to(torch.int32)
    owners = np.zeros(len(positions), dtype=int)
    for rank in range(world):
        shim = cp_slot_mapping(qsl, positions, table, block_size, world, rank, interleave)
        ours = vllm_formula_slots(qsl, positions, table, block_size, world, rank,
                                  interleave).numpy()
        np.testing.assert_array_equal(shim.numpy(), ours)
        owners += ours >= 0
    assert (owners == 1).all()  # every token stored by exactly one DCP rank


def test_shim_impl_delegates_world_one_and_pads():
    calls = []
    impl = make_slot_mapping_impl(lambda *args: calls.append(args))
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 7, 8])
    table = torch.tensor([[4, 5], [6, 7]], dtype=torch.int32)
    out = torch.full((8,), 123, dtype=torch.int64)
    impl(5, 8, qsl, positions, table, 2, out, 4, 1, 0, 1, -1, 1024)
    assert len(calls) == 1 and calls[0][6] is out and (out == 123).all()
    impl(5, 8, qsl, positions, table, 2, out, 4, 2, 1, 1, -1, 1024)
    # world 2, rank 1, block 4: virtual block 8 tokens; odd positions are rank 1's
    assert out.tolist() == [-1, 4 * 4 + 0, -1, 6 * 4 + 3, -1, -1, -1, -1]


def test_world_one_matches_vllm_cpu_kernel():
    """vLLM's own CPU C++ kernel (the function we delegate to) agrees with our formula."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    original = getattr(cpu_tl._compute_slot_mapping_kernel_impl, "__wrapped__",
                       cpu_tl._compute_slot_mapping_kernel_impl)
    cm, positions = vllm_batch([0, 40, 63], [8, 1, 37], block_size=16)
    out = torch.full((64,), 99, dtype=torch.int64)
    original(46, 64, cm.query_start_loc, positions, cm.block_table_tensor,
             cm.block_table_tensor.stride(0), out, 16)
    assert torch.equal(out[:46], cm.slot_mapping)


# -- batch translation and the slot-mapping check ----------------------------------------------
def test_step_from_vllm_drops_padding_and_reorders_rows():
    # vLLM order: one-token prompt, decode, chunked prefill with context, padding request
    cm, _ = vllm_batch([0, 40, 63, 0], [1, 1, 37, 0], block_size=16)
    step, meta = build(cm, CPConfig(block_size=16, kv_shard="dcp"))
    assert step.num_computed_tokens.tolist() == [0, 40, 63]
    assert step.num_scheduled_tokens.tolist() == [1, 1, 37] and step.num_new_tokens == 39
    rows = row_order(meta, step.num_new_tokens)
    assert rows is not None and rows[:3].tolist() == [1, 0, 2]  # decode first, then the prompt
    assert rows.sort().values.tolist() == list(range(39))
    check_slot_mapping(meta, cm.slot_mapping, step.num_new_tokens, step)


@pytest.mark.parametrize("interleave", [1, 16])
def test_dcp_slot_mapping_check_accepts_vllm_and_rejects_corruption(interleave):
    config = CPConfig(tp_size=2, dcp_size=2, block_size=32, cp_kv_interleave_size=interleave,
                      kv_shard="dcp")
    for rank in range(2):
        cm, _ = vllm_batch([0, 40, 63], [5, 1, 37], block_size=32, world=2, rank=rank,
                           interleave=interleave)
        step, meta = build(cm, config, CPRanks(0, rank, rank))
        check_slot_mapping(meta, cm.slot_mapping, step.num_new_tokens, step)
        stored = slots_in_vllm_order(meta, step.num_new_tokens, step) >= 0
        assert 0 < int(stored.sum()) < step.num_new_tokens  # DCP: each rank stores a share
        bad = cm.slot_mapping.clone()
        first = int(torch.nonzero(stored)[0, 0])
        bad[first] += 1
        with pytest.raises(SlotMappingMismatch, match=f"token {first} "):
            check_slot_mapping(meta, bad, step.num_new_tokens, step)
        other = vllm_batch([0, 40, 63], [5, 1, 37], block_size=32, world=2, rank=1 - rank,
                           interleave=interleave)[0]
        with pytest.raises(SlotMappingMismatch, match="refusing to write the cache"):
            check_slot_mapping(meta, other.slot_mapping, step.num_new_tokens, step)


# -- KV cache view ------------------------------------------------------------------------------
def test_kv_cache_view_write_and_paged_attention():
    from cp_attention.integrations.vllm.backend import kv_cache_view

    torch.manual_seed(0)
    blocks, heads, bs, dim = 6, 2, 16, 32
    cache = torch.zeros(blocks, heads, bs, 2 * dim)  # vLLM's per-layer tensor (LBHNC)
    view = kv_cache_view(cache, dim)
    assert view.shape == (2, blocks, bs, heads, dim) and view.data_ptr() == cache.data_ptr()
    length = 37
    k, v = torch.randn(length, heads, dim), torch.randn(length, heads, dim)
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    pos = torch.arange(length)
    slots = table[0, pos // bs].long() * bs + pos % bs
    ops = ReferenceOps()
    ops.reshape_and_cache(k, v, view[0], view[1], slots)
    for p in (0, 15, 16, 36):
        blk, off = int(table[0, p // bs]), p % bs
        assert torch.equal(cache[blk, :, off, :dim], k[p]) and torch.equal(cache[blk, :, off, dim:], v[p])
    assert int((cache != 0).any(-1).sum()) == length * heads  # nothing else written
    q = torch.randn(3, 4, dim)
    out, lse = ops.paged_attention(q, view[0], view[1], table, torch.tensor([0, 3]),
                                   torch.tensor([length]), scale=dim ** -0.5)
    ref_out, ref_lse = dense_attention(q, k, v, torch.full((3,), length - 1), dim ** -0.5)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# -- below the PCP boundary ------------------------------------------------------------------------
def test_pcp_metadata_from_vllm_shaped_batch():
    """What a PCP-capable vLLM would need from us: per-rank split of a vLLM batch and the full
    (kv_shard="dcp", dcp=1) slot mapping on every PCP rank, equal to vLLM's formula."""
    computed, new = [30, 0, 63, 50], [1, 21, 37, 1]  # decode, prefill, chunked prefill, decode
    cm, _ = vllm_batch(computed, new, block_size=16)
    config = CPConfig(pcp_size=2, tp_size=1, block_size=16, kv_shard="dcp")
    seen = np.zeros(int(sum(new)), dtype=int)
    cu = np.concatenate([[0], np.cumsum(new)])
    for rank in range(2):
        step, meta = build(cm, config, CPRanks(rank, 0, 0))
        rows = meta.local_token_idx[:meta.num_local_rows].numpy()
        assert rows[:meta.num_decode_tokens].tolist() == [0, 59]  # decodes on every rank, first
        np.add.at(seen, rows[meta.num_decode_tokens:][rows[meta.num_decode_tokens:] >= 0], 1)
        # step rows: decodes, then each prefill's padded tokens in order (pads: -1)
        step_tokens = [0, 59]
        for req, chunk in zip(meta.prefill_reqs, meta.chunk_lens):
            padded = np.arange(2 * config.pcp_size * chunk)
            step_tokens += np.where(padded < new[req], cu[req] + padded, -1).tolist()
        step_tokens = np.asarray(step_tokens)
        expected = np.full(len(step_tokens), -1)
        expected[step_tokens >= 0] = cm.slot_mapping.numpy()[step_tokens[step_tokens >= 0]]
        np.testing.assert_array_equal(meta.step_slot_mapping.numpy(), expected)
        check_slot_mapping(meta, cm.slot_mapping, step.num_new_tokens, step)  # PCP check
        bad = cm.slot_mapping.clone()
        bad[30] += 1  # a prefill token only one PCP rank computes: both ranks must notice
        with pytest.raises(SlotMappingMismatch, match="token 30 "):
            check_slot_mapping(meta, bad, step.num_new_tokens, step)
        with pytest.raises(ValueError, match="pcp_size > 1"):
            row_order(meta, step.num_new_tokens)  # PCP rows are not a permutation of vLLM's
    prefill_tokens = np.arange(1, 59)
    assert (seen[prefill_tokens] == 1).all()  # each prefill token on exactly one PCP rank


@pytest.mark.parametrize("dcp_over_pcp", [False, True])
def test_pcp_slot_mapping_check_with_kv_sharded_over_pcp(dcp_over_pcp):
    """vLLM pcp=2 dcp=2: each PCP rank stores the tokens its vLLM DCP rank owns (virtual
    blocks of 2 x block_size); our kv_shard="cp" metadata must produce exactly vLLM's slots."""
    from vllm.config import ParallelConfig

    pc = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                        decode_context_parallel_size=2 if dcp_over_pcp else 1)
    config = cp_config_from_vllm(pc, block_size=16)
    computed, new = [30, 0, 63, 5], [1, 21, 37, 1]
    for pcp_rank in range(2):
        world, rank = (2, pcp_rank) if dcp_over_pcp else (1, 0)
        cm, _ = vllm_batch(computed, new, block_size=16, world=world, rank=rank)
        step, meta = build(cm, config, CPRanks(pcp_rank, 1, 0))
        check_slot_mapping(meta, cm.slot_mapping, step.num_new_tokens, step)
        if dcp_over_pcp:
            other, _ = vllm_batch(computed, new, block_size=16, world=2, rank=1 - pcp_rank)
            with pytest.raises(SlotMappingMismatch):
                check_slot_mapping(meta, other.slot_mapping, step.num_new_tokens, step)


@pytest.mark.parametrize("new", [[1, 21, 37, 1], [5, 6, 1, 3], [1]])
def test_hidden_restore_rows_from_every_pcp_rank(new):
    """Model input rows per PCP rank and the restore of wanted rows (pure index math): with
    hidden = f(token) on every rank, the restored rows equal f(wanted token) exactly, whichever
    rank computed them (last token of 6- and 5-token prompts lands on PCP rank 1)."""
    computed = [30 if n == 1 else 0 for n in new]
    cm, positions = vllm_batch(computed, new, block_size=16)
    config = CPConfig(pcp_size=2, block_size=16, kv_shard="dcp")
    num_tokens = int(sum(new))
    wanted_sets = [cm.query_start_loc_cpu[1:].long() - 1, torch.arange(num_tokens)]
    feature = torch.randn(num_tokens, 8, dtype=torch.float64)
    for wanted in wanted_sets:
        packs, owners = [], []
        for rank in range(2):
            step, meta = build(cm, config, CPRanks(rank, 0, 0))
            token_idx, pos = local_input_rows(meta)
            real = meta.local_token_idx[:meta.num_local_rows] >= 0
            assert torch.equal(pos[real], positions[token_idx[real]])  # RoPE positions
            hidden = feature[token_idx]  # what the model computes for this rank's rows
            held = rows_holding(meta, wanted)
            owners.append(held >= 0)
            packs.append(pack_held_rows(hidden, held))
        restored = pick_held_rows(torch.stack(packs), wanted)
        assert torch.equal(restored, feature[wanted])
        assert bool((owners[0] | owners[1]).all())
    if new == [5, 6, 1, 3]:  # prompts of 5 and 6 tokens end on rank 1 (chunks of 2)
        last = cm.query_start_loc_cpu[1:].long() - 1
        step, meta1 = build(cm, config, CPRanks(1, 0, 0))
        step, meta0 = build(cm, config, CPRanks(0, 0, 0))
        assert (rows_holding(meta1, last[:2]) >= 0).all() and (rows_holding(meta0, last[:2]) < 0).all()
    with pytest.raises(RuntimeError, match="held by no PCP rank"):
        pick_held_rows(torch.stack([torch.zeros(2, 9), torch.zeros(2, 9)]), torch.tensor([3, 4]))


# -- the impl: ops named in its log line, PCP handshake with the runner --------------------------
@pytest.mark.parametrize("forced, named", [("reference", "ops ReferenceOps (pure-torch fallback)"),
                                           ("auto", "ops CpuOps (C++ CPU kernels)")])
def test_impl_log_names_the_ops_in_use(tmp_path, monkeypatch, forced, named):
    import logging

    from vllm.config import set_current_vllm_config

    from cp_attention.integrations.vllm.backend import CPVllmImpl

    config = _engine_config(make_tiny_llama_dir(tmp_path))  # (re)configures vLLM's logging
    monkeypatch.setenv("CP_ATTENTION_OPS", forced)
    load_cpu_extension.cache_clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(plugin.LOGGER_NAME)
    logger.addHandler(handler)
    try:
        with set_current_vllm_config(config):
            impl = CPVllmImpl(4, 32, 32 ** -0.5, 2)
    finally:
        logger.removeHandler(handler)
        load_cpu_extension.cache_clear()
    lines = [r.getMessage() for r in records if "cp_attention impl active" in r.getMessage()]
    assert len(lines) == 1 and f"BaseAttentionImpl, {named}," in lines[0], lines
    assert type(impl.inner.ops).__name__ in named


@pytest.mark.parametrize("kwargs, threshold, window_cache", [
    ({}, 1, "all"),
    ({"prefill_context_parallel_size": 2}, 1, "all"),
    ({"prefill_context_parallel_size": 2, "enable_prefix_caching": False}, 1, "window"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "prompt_lookup_max": 2}}, 3, "all"),
])
def test_builder_and_impl_hold_the_engine_config(tmp_path, pcp_plugin, monkeypatch, kwargs,
                                                  threshold, window_cache):
    """The config hook, a layer's builder and its impl take one CPConfig object
    (``adapter.engine_cp_config``); its decode_threshold, 1 + speculative tokens, is what the
    builder declares as vLLM's reorder_batch_threshold; a window layer's cache keeps every
    token only where prefix caching may read them."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cp_attention.integrations.vllm import backend
    from cp_attention.integrations.vllm.adapter import engine_cp_config

    monkeypatch.delenv("CP_ATTENTION_VLLM_REORDER", raising=False)
    monkeypatch.setattr(backend, "vllm_ranks", lambda cfg: CPRanks())  # one process, no groups
    monkeypatch.setattr(backend, "vllm_groups",
                        lambda cfg: CPGroups(cfg, CPRanks(), torch.device("cpu")))
    config = _engine_config(make_tiny_llama_dir(tmp_path), **kwargs)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with set_current_vllm_config(config):
        builder = backend.CPVllmMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
        impl = backend.CPVllmImpl(4, 32, 32 ** -0.5, 2)
    assert builder.config is impl.config is engine_cp_config(config)
    assert builder.config.decode_threshold == builder.reorder_batch_threshold == threshold
    assert builder.config.block_size == 32
    assert builder.config.window_cache == window_cache
    other = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="kernel block size 16 != its --block-size 32"):
        backend.CPVllmMetadataBuilder(other, ["layer.1"], config, torch.device("cpu"))


def test_pcp_impl_refuses_rows_the_runner_did_not_select(tmp_path, pcp_plugin, monkeypatch):
    """vLLM's real builder and impl at pcp=2 (rank 0; one process cannot hold vLLM's PCP group,
    so the group lookup is replaced: nothing communicates before the check). The metadata
    comes unmarked from the builder; only the PCP runner marks it, as it feeds the local rows."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cp_attention.integrations.vllm import backend

    config = _engine_config(make_tiny_llama_dir(tmp_path), prefill_context_parallel_size=2)
    monkeypatch.setattr(backend, "vllm_ranks", lambda cfg: CPRanks(0, 0, 0))
    monkeypatch.setattr(backend, "vllm_groups",
                        lambda cfg: CPGroups(cfg, CPRanks(0, 0, 0), torch.device("cpu")))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with set_current_vllm_config(config):
        builder = backend.CPVllmMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
        impl = backend.CPVllmImpl(4, 32, 32 ** -0.5, 2)
    cm, _ = vllm_batch([30, 0], [1, 21], block_size=32)  # a decode and a 21-token prefill
    meta = builder.build(0, cm)
    n, total = meta.inner.num_local_rows, cm.num_actual_tokens
    assert not meta.local_rows_fed and n != total  # 1 decode + 12 of 24 padded prefill rows
    q, kv = torch.randn(total, 4, 32), torch.randn(total, 2, 32)
    cache, out = torch.zeros(16, 2, 32, 64), torch.zeros(total, 4, 32)
    with pytest.raises(backend.PCPRowsNotSelected, match="local_rows_fed=False"):
        impl.forward(None, q[:n], kv[:n], kv[:n], cache, meta, output=out[:n])
    meta.local_rows_fed = True  # marked, but vLLM passed the global rows
    with pytest.raises(backend.PCPRowsNotSelected, match=f"got {total} rows"):
        impl.forward(None, q, kv, kv, cache, meta, output=out)


def test_impl_forward_equals_vllm_cpu_attn_over_steps(tmp_path, monkeypatch):
    """Our builder + impl against vLLM's own CPU_ATTN builder + impl, in process, on the same
    inputs over four steps (prefills, decodes, padded T, rows permuted against vLLM's order):
    outputs equal, padding rows untouched, the layer's KV view made once."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from cp_attention.integrations.vllm import backend

    heads, kv_heads, dim, bs = 4, 2, 32, 32
    monkeypatch.setattr(backend, "vllm_ranks", lambda cfg: CPRanks())  # one process, no groups
    config = _engine_config(make_tiny_llama_dir(tmp_path))
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=dim,
                             dtype=torch.float32)
    with set_current_vllm_config(config):
        ours_b = backend.CPVllmMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
        ours = backend.CPVllmImpl(heads, dim, dim ** -0.5, kv_heads)
        ref_b = cpu_attn.CPUAttentionMetadataBuilder(spec, [], config, torch.device("cpu"))
        ref = cpu_attn.CPUAttentionBackendImpl(heads, dim, dim ** -0.5, kv_heads, None, None, "auto")
    layer = SimpleNamespace(isa=ref_b.isa, _k_scale_float=1.0, _v_scale_float=1.0)
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(24, generator=gen).view(3, 8).to(torch.int32)
    cache_ours, cache_ref = torch.zeros(24, kv_heads, bs, 2 * dim), torch.zeros(24, kv_heads, bs, 2 * dim)
    computed = np.zeros(3, dtype=int)
    for new, pad, permuted in [([40, 7, 70], 0, False), ([1, 1, 1], 0, False),
                               ([1, 1, 5], 3, False), ([3, 1, 1], 2, True)]:
        cm, _ = vllm_batch(computed, new, block_size=bs)
        cm.block_table_tensor = table  # the same blocks every step
        cm.slot_mapping = vllm_formula_slots(cm.query_start_loc_cpu, cm.positions, table, bs, 1, 0, 1)
        n = int(sum(new))
        q, k, v = (torch.randn(n + pad, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
        out_ours, out_ref = torch.full((n + pad, heads, dim), 7.0), torch.full((n + pad, heads, dim), 7.0)
        meta = ours_b.build(0, cm)
        assert (meta.row_idx is not None) == permuted
        ours.forward(None, q, k, v, cache_ours, meta, output=out_ours)
        ref_meta = ref_b.build(0, cm)
        ref.do_kv_cache_update(layer, k[:n], v[:n], cache_ref, cm.slot_mapping)
        ref.forward(layer, q, k, v, cache_ref, ref_meta, output=out_ref)
        torch.testing.assert_close(out_ours[:n], out_ref[:n], atol=1e-5, rtol=1e-5)
        assert bool((out_ours[n:] == 7).all())
        computed = computed + np.asarray(new)
    assert ours._kv_cache is cache_ours
