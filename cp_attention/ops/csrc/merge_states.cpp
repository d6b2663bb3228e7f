// One pass per row over both partials: the weights of attention_common.h's merge_weights,
// out = w_a out_a + w_b out_b. The torch version (ops/merge.py) makes about ten full-size
// temporaries; this reads each input once.
#include "merge_states.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "attention_common.h"

namespace {

void check_pair(const at::Tensor& out, const at::Tensor& lse, const char* name) {
  TORCH_CHECK_VALUE(out.dim() == 3 && lse.dim() == 2 && lse.size(0) == out.size(0) &&
                    lse.size(1) == out.size(1),
                    "merge_attn_states: ", name, " must be out [T, H, D] with lse [T, H], got ",
                    out.sizes(), " and ", lse.sizes());
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat,
                    "merge_attn_states: the C++ merge takes float32 partials");
  TORCH_CHECK_VALUE(out.stride(2) == 1 || out.size(2) <= 1,
                    "merge_attn_states: the head_size dimension must be contiguous");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_attn_states_cpu(const at::Tensor& out_a,
                                                         const at::Tensor& lse_a,
                                                         const at::Tensor& out_b,
                                                         const at::Tensor& lse_b) {
  check_pair(out_a, lse_a, "part a");
  check_pair(out_b, lse_b, "part b");
  TORCH_CHECK_VALUE(out_a.sizes() == out_b.sizes(), "merge_attn_states: parts differ in shape: ",
                    out_a.sizes(), " vs ", out_b.sizes());
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), dim = out_a.size(2);
  at::Tensor out = at::empty({tokens, heads, dim}, out_a.options());
  at::Tensor lse = at::empty({tokens, heads}, lse_a.options());
  const float* oa = out_a.data_ptr<float>();
  const float* ob = out_b.data_ptr<float>();
  const float* la = lse_a.data_ptr<float>();
  const float* lb = lse_b.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* l = lse.data_ptr<float>();
  const int64_t oa_t = out_a.stride(0), oa_h = out_a.stride(1);
  const int64_t ob_t = out_b.stride(0), ob_h = out_b.stride(1);
  const int64_t la_t = lse_a.stride(0), la_h = lse_a.stride(1);
  const int64_t lb_t = lse_b.stride(0), lb_h = lse_b.stride(1);
  at::parallel_for(0, tokens * heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const float parts[2] = {la[t * la_t + h * la_h], lb[t * lb_t + h * lb_h]};
      float w[2];
      l[row] = cp_attention::merge_weights(parts, 1, 2, w);
      float* dst = o + row * dim;
      if (l[row] == cp_attention::kNegInf) {  // both parts empty
        std::memset(dst, 0, dim * sizeof(float));
        continue;
      }
      const float* src_a = oa + t * oa_t + h * oa_h;
      const float* src_b = ob + t * ob_t + h * ob_h;
      for (int64_t d = 0; d < dim; ++d) dst[d] = w[0] * src_a[d] + w[1] * src_b[d];
    }
  });
  return {out, lse};
}
