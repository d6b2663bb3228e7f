// The CPU attention kernels as torch operators: torch.ops.cp_attention.<name> (schemas, the
// CPU kernels, and Meta kernels giving the output shapes, so that the ops trace under
// torch.compile / make_fx). Built by cp_attention/ops/cpu_build.py.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "merge_states.h"
#include "paged_attention.h"
#include "varlen_attention.h"

namespace {

// out [T, H, D] and lse [T, H], float32, for queries [T, H, D] (symbolic sizes allowed).
std::tuple<at::Tensor, at::Tensor> attention_outputs_meta(const at::Tensor& q) {
  const auto options = q.options().dtype(at::kFloat);
  return {at::empty_symint(q.sym_sizes(), options),
          at::empty_symint({q.sym_size(0), q.sym_size(1)}, options)};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_meta(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&) {
  return attention_outputs_meta(q);
}

std::tuple<at::Tensor, at::Tensor> merge_attn_states_meta(const at::Tensor& out_a,
                                                          const at::Tensor&, const at::Tensor&,
                                                          const at::Tensor&) {
  return attention_outputs_meta(out_a);
}

void reshape_and_cache_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&) {}

std::tuple<at::Tensor, at::Tensor> cache_and_paged_attention_meta(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&) {
  return attention_outputs_meta(q);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_meta(
    const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, bool, int64_t, const std::optional<at::Tensor>&) {
  return attention_outputs_meta(q);
}

}  // namespace

// Shapes and semantics: paged_attention.h, varlen_attention.h, merge_states.h. Every op
// returns (out float32 [T, Hq, D], lse float32 [T, Hq]) except reshape_and_cache, which writes
// the caches in place.
TORCH_LIBRARY(cp_attention, m) {
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor seq_lens, float scale, Tensor? kv_start=None, "
        "Tensor? kv_end=None) -> (Tensor, Tensor)");
  m.def("merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> "
        "(Tensor, Tensor)");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("cache_and_paged_attention(Tensor q, Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, Tensor block_table, Tensor cu_seqlens_q, "
        "Tensor seq_lens, float scale, Tensor? kv_start=None, Tensor? kv_end=None) -> "
        "(Tensor, Tensor)");
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, float scale, bool causal, int window=0, "
        "Tensor? seqused_k=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cp_attention, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("merge_attn_states", &merge_attn_states_cpu);
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("cache_and_paged_attention", &cache_and_paged_attention_cpu);
  m.impl("varlen_attention", &varlen_attention_cpu);
}

TORCH_LIBRARY_IMPL(cp_attention, Meta, m) {
  m.impl("paged_attention", &paged_attention_meta);
  m.impl("merge_attn_states", &merge_attn_states_meta);
  m.impl("reshape_and_cache", &reshape_and_cache_meta);
  m.impl("cache_and_paged_attention", &cache_and_paged_attention_meta);
  m.impl("varlen_attention", &varlen_attention_meta);
}
