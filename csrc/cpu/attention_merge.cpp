// CPU kernel of seqpar::attention_merge_: ring attention's merge of one block's
// attention result into the running result, in place (the math: seqpar/attention_merge.h).
//
// Work is split over rows with at::parallel_for, in (b, s, h) order because out is
// (B, S, H, D) in memory in the common case; a row of headdim elements with unit stride
// runs a loop the compiler vectorizes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "seqpar/attention_merge.h"

namespace seqpar {

void check_attention_merge_args(const at::Tensor& out, const at::Tensor& lse,
                                const at::Tensor& block_out, const at::Tensor& block_lse) {
  TORCH_CHECK(out.dim() == 4, "seqpar::attention_merge_: out must be (B, S, H, D), got shape ",
              out.sizes());
  TORCH_CHECK(block_out.sizes() == out.sizes(),
              "seqpar::attention_merge_: block_out must have out's shape ", out.sizes(), ", got ",
              block_out.sizes());
  const int64_t batch = out.size(0), seqlen = out.size(1), heads = out.size(2);
  const std::array<int64_t, 3> lse_shape{batch, heads, seqlen};
  TORCH_CHECK(lse.sizes() == at::IntArrayRef(lse_shape),
              "seqpar::attention_merge_: lse must be (B, H, S) = ", at::IntArrayRef(lse_shape),
              " for out of shape ", out.sizes(), ", got ", lse.sizes());
  TORCH_CHECK(block_lse.sizes() == at::IntArrayRef(lse_shape),
              "seqpar::attention_merge_: block_lse must be (B, H, S) = ",
              at::IntArrayRef(lse_shape), ", got ", block_lse.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat &&
                  block_lse.scalar_type() == at::kFloat,
              "seqpar::attention_merge_: out, lse and block_lse must be float32, got ",
              out.scalar_type(), ", ", lse.scalar_type(), ", ", block_lse.scalar_type());
  const auto block_dtype = block_out.scalar_type();
  TORCH_CHECK(block_dtype == at::kFloat || block_dtype == at::kHalf || block_dtype == at::kBFloat16,
              "seqpar::attention_merge_: block_out must be float32, float16 or bfloat16, got ",
              block_dtype);
  TORCH_CHECK(lse.device() == out.device() && block_out.device() == out.device() &&
                  block_lse.device() == out.device(),
              "seqpar::attention_merge_: all tensors must be on one device, got ", out.device(),
              ", ", lse.device(), ", ", block_out.device(), ", ", block_lse.device());
}

namespace {

// Elements per at::parallel_for task: below this a fork costs more than the work.
constexpr int64_t kElementsPerTask = 16 * 1024;

// out[d] = out[d] * w_old + block[d] * w_block over a unit-stride row: vectorized.
// w_old == 0 means "replace": out may hold garbage (0 * NaN would be NaN).
template <typename BlockT>
void merge_row_contiguous(float* __restrict out, const BlockT* __restrict block, int64_t count,
                          float w_old, float w_block) {
  if (w_old == 0.0f) {
    for (int64_t d = 0; d < count; ++d) out[d] = static_cast<float>(block[d]) * w_block;
  } else {
    for (int64_t d = 0; d < count; ++d) {
      out[d] = out[d] * w_old + static_cast<float>(block[d]) * w_block;
    }
  }
}

template <typename BlockT>
void merge_row_strided(float* out, int64_t out_stride, const BlockT* block, int64_t block_stride,
                       int64_t count, float w_old, float w_block) {
  for (int64_t d = 0; d < count; ++d) {
    const float previous = w_old == 0.0f ? 0.0f : out[d * out_stride] * w_old;
    out[d * out_stride] = previous + static_cast<float>(block[d * block_stride]) * w_block;
  }
}

template <typename BlockT>
void attention_merge_cpu_typed(const at::Tensor& out, const at::Tensor& lse,
                               const at::Tensor& block_out, const at::Tensor& block_lse) {
  const int64_t batch = out.size(0), seqlen = out.size(1), heads = out.size(2);
  const int64_t head_dim = out.size(3);
  const int64_t rows = batch * seqlen * heads;
  if (rows == 0) return;
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  const auto* block_data = static_cast<const BlockT*>(block_out.const_data_ptr());
  const float* block_lse_data = block_lse.const_data_ptr<float>();
  const auto os = out.strides();
  const auto bs = block_out.strides();
  const auto ls = lse.strides();
  const auto bls = block_lse.strides();
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(head_dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % heads;
      const int64_t s = (row / heads) % seqlen;
      const int64_t b = row / (heads * seqlen);
      float* lse_ptr = lse_data + b * ls[0] + h * ls[1] + s * ls[2];
      const float block_lse_value = block_lse_data[b * bls[0] + h * bls[1] + s * bls[2]];
      const MergeWeights w = merge_weights(*lse_ptr, block_lse_value);
      if (w.skip) continue;
      float* out_row = out_data + b * os[0] + s * os[1] + h * os[2];
      const BlockT* block_row = block_data + b * bs[0] + s * bs[1] + h * bs[2];
      if (os[3] == 1 && bs[3] == 1) {
        merge_row_contiguous(out_row, block_row, head_dim, w.w_old, w.w_block);
      } else {
        merge_row_strided(out_row, os[3], block_row, bs[3], head_dim, w.w_old, w.w_block);
      }
      *lse_ptr = w.new_lse;
    }
  });
}

void attention_merge_cpu(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                         const at::Tensor& block_lse) {
  check_attention_merge_args(out, lse, block_out, block_lse);
  switch (block_out.scalar_type()) {
    case at::kFloat: return attention_merge_cpu_typed<float>(out, lse, block_out, block_lse);
    case at::kHalf: return attention_merge_cpu_typed<c10::Half>(out, lse, block_out, block_lse);
    case at::kBFloat16:
      return attention_merge_cpu_typed<c10::BFloat16>(out, lse, block_out, block_lse);
    default: TORCH_CHECK(false, "seqpar::attention_merge_: unsupported block_out dtype");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CPU, m) { m.impl("attention_merge_", &attention_merge_cpu); }

}  // namespace seqpar
