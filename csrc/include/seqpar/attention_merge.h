// The merge of one attention block's (out, lse) into ring attention's running result,
// shared by the CPU (csrc/cpu/attention_merge.cpp) and CUDA (csrc/cuda/attention_merge.cu)
// kernels of seqpar::attention_merge_.
//
// Per row, with lse and block_lse in natural-log units:
//   new_lse = logaddexp(lse, block_lse) = max + log1p(exp(-|lse - block_lse|))
//   out     = out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse)
// Both weights are <= 1, so large logits cannot overflow. A row whose block_lse is -inf
// (the block had no key for it) is left exactly as it was (-inf/-inf stays -inf, no NaN).
// A row whose running lse is -inf takes block_out as is, whatever out held (torch.empty
// garbage included): the convention of the Triton step kernel too.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>

#include "seqpar/block_copy.h"  // SEQPAR_HOST_DEVICE

namespace seqpar {

struct MergeWeights {
  bool skip;       // block_lse == -inf: the row is left untouched
  float new_lse;
  float w_old;     // weight of the running out; 0 means "replace" (0 * NaN would be NaN)
  float w_block;   // weight of block_out
};

SEQPAR_HOST_DEVICE MergeWeights merge_weights(float lse, float block_lse) {
  const float negative_infinity = -INFINITY;
  if (block_lse == negative_infinity) return {true, lse, 1.0f, 0.0f};
  if (lse == negative_infinity) return {false, block_lse, 0.0f, 1.0f};
  // The weights are exp(x - new_lse), taken as exp((x - max) - log1p(..)) so that the
  // rounding of new_lse to fp32 (an absolute error of ulp(|lse|), large for large
  // logits: measured 8e-5 in out) does not enter them.
  const float gap = fabsf(lse - block_lse);
  const float log_sum = log1pf(expf(-gap));
  const float w_max = expf(-log_sum);
  const float w_min = expf(-gap - log_sum);
  const bool old_is_max = lse >= block_lse;
  return {false, fmaxf(lse, block_lse) + log_sum, old_is_max ? w_max : w_min,
          old_is_max ? w_min : w_max};
}

// One set of argument checks and error messages for both devices (defined in the CPU file).
void check_attention_merge_args(const at::Tensor& out, const at::Tensor& lse,
                                const at::Tensor& block_out, const at::Tensor& block_lse);

}  // namespace seqpar
