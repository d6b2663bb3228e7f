// The one Python module of the CPU attention kernels (built by cp_attention/ops/cpu_build.py).
#include <torch/extension.h>

#include "merge_states.h"
#include "paged_attention.h"
#if __has_include("varlen_attention.h")
#include "varlen_attention.h"
#define CP_ATTENTION_HAS_VARLEN 1
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cp_attention CPU attention kernels";
  m.def("paged_attention", &paged_attention_cpu,
        "paged attention (q, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens, "
        "scale, kv_start, kv_end) -> (out fp32, lse fp32)");
  m.def("merge_attn_states", &merge_attn_states_cpu,
        "LSE merge of two float32 partials (out_a, lse_a, out_b, lse_b) -> (out, lse)");
  m.def("reshape_and_cache", &reshape_and_cache_cpu,
        "store key/value rows at slot_mapping (-1 skipped) of strided caches");
  m.def("cache_and_paged_attention", &cache_and_paged_attention_cpu,
        "reshape_and_cache then paged_attention (q, key, value, key_cache, value_cache, "
        "slot_mapping, block_table, cu_seqlens_q, seq_lens, scale, kv_start, kv_end) -> "
        "(out fp32, lse fp32)");
#ifdef CP_ATTENTION_HAS_VARLEN
  m.def("varlen_attention", &varlen_attention_cpu,
        "varlen attention (q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window<=0: none, "
        "seqused_k=None) -> (out fp32, lse fp32)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("scale"), py::arg("causal"), py::arg("window"),
        py::arg("seqused_k") = py::none());
#endif
}
