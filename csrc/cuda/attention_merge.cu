// CUDA kernel of seqpar::attention_merge_ (the math and the -inf conventions:
// seqpar/attention_merge.h, shared with the CPU kernel).
//
// A CTA is TX x TY threads: TY rows, TX threads along headdim per row. Each thread
// handles VEC consecutive elements at a time (VEC = 4 when every row has unit stride
// and is 16-byte aligned for out, 4-element aligned for block_out: one 16-byte load of
// out and an 8- or 16-byte load of block_out per thread), so a row of 128 fp32 is one
// warp's single vector load. Launched on the current stream; no host synchronisation.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "seqpar/attention_merge.h"

namespace seqpar {

namespace {

struct MergeArgs {
  float* out;
  float* lse;
  const void* block_out;
  const float* block_lse;
  int64_t seqlen, heads, head_dim, rows;
  int64_t out_strides[4];
  int64_t block_strides[4];
  int64_t lse_strides[3];
  int64_t block_lse_strides[3];
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T values[N];
};

template <typename BlockT, int VEC, int TX>
__global__ void attention_merge_kernel(MergeArgs args) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < args.rows;
  float lse = -INFINITY, block_lse = -INFINITY;
  float* lse_ptr = nullptr;
  float* out_row = nullptr;
  const BlockT* block_row = nullptr;
  if (active) {
    const int64_t h = row % args.heads;
    const int64_t s = (row / args.heads) % args.seqlen;
    const int64_t b = row / (args.heads * args.seqlen);
    lse_ptr = args.lse + b * args.lse_strides[0] + h * args.lse_strides[1] + s * args.lse_strides[2];
    lse = *lse_ptr;
    block_lse = args.block_lse[b * args.block_lse_strides[0] + h * args.block_lse_strides[1] +
                               s * args.block_lse_strides[2]];
    out_row = args.out + b * args.out_strides[0] + s * args.out_strides[1] + h * args.out_strides[2];
    block_row = static_cast<const BlockT*>(args.block_out) + b * args.block_strides[0] +
                s * args.block_strides[1] + h * args.block_strides[2];
  }
  const MergeWeights weights = merge_weights(lse, block_lse);
  const bool skip = !active || weights.skip;
  const float new_lse = weights.new_lse, w_old = weights.w_old, w_block = weights.w_block;
  if (!skip) {
    const int64_t out_stride = args.out_strides[3];
    const int64_t block_stride = args.block_strides[3];
    for (int64_t d = static_cast<int64_t>(threadIdx.x) * VEC; d < args.head_dim; d += TX * VEC) {
      if constexpr (VEC > 1) {
        // Unit strides and alignment were checked on the host.
        auto* out_pack = reinterpret_cast<Pack<float, VEC>*>(out_row + d);
        const Pack<BlockT, VEC> block = *reinterpret_cast<const Pack<BlockT, VEC>*>(block_row + d);
        Pack<float, VEC> result;
        if (w_old == 0.0f) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) result.values[i] = static_cast<float>(block.values[i]) * w_block;
        } else {
          const Pack<float, VEC> previous = *out_pack;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            result.values[i] = previous.values[i] * w_old + static_cast<float>(block.values[i]) * w_block;
          }
        }
        *out_pack = result;
      } else {
        float* o = out_row + d * out_stride;
        const float block = static_cast<float>(block_row[d * block_stride]);
        *o = (w_old == 0.0f ? 0.0f : *o * w_old) + block * w_block;
      }
    }
  }
  // Every thread of this row has read the old lse before one of them replaces it.
  __syncthreads();
  if (!skip && threadIdx.x == 0) *lse_ptr = new_lse;
}

bool aligned(const void* pointer, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0;
}

// VEC = 4 needs every row of both tensors to start on a 4-element boundary with unit
// stride along headdim, and 4 | headdim.
bool can_vectorize(const at::Tensor& out, const at::Tensor& block_out) {
  if (out.size(3) % 4 != 0 || out.stride(3) != 1 || block_out.stride(3) != 1) return false;
  for (int dim = 0; dim < 3; ++dim) {
    if (out.stride(dim) % 4 != 0 || block_out.stride(dim) % 4 != 0) return false;
  }
  return aligned(out.data_ptr(), 4 * sizeof(float)) &&
         aligned(block_out.const_data_ptr(), 4 * block_out.element_size());
}

template <typename BlockT, int VEC>
void launch_typed(const MergeArgs& args, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // Threads per row: enough to cover headdim in one pass up to a warp (rows stay within
  // one warp), never fewer than 4.
  const int64_t per_row = (args.head_dim + VEC - 1) / VEC;
  auto launch = [&](auto tx_constant) {
    constexpr int TX = decltype(tx_constant)::value;
    const dim3 block(TX, kThreads / TX);
    const int64_t ctas = (args.rows + block.y - 1) / block.y;
    TORCH_CHECK(ctas <= std::numeric_limits<int32_t>::max(),
                "seqpar::attention_merge_: too many rows (", args.rows, ")");
    attention_merge_kernel<BlockT, VEC, TX>
        <<<static_cast<unsigned>(ctas), block, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (per_row <= 4) launch(std::integral_constant<int, 4>{});
  else if (per_row <= 8) launch(std::integral_constant<int, 8>{});
  else if (per_row <= 16) launch(std::integral_constant<int, 16>{});
  else launch(std::integral_constant<int, 32>{});
}

template <typename BlockT>
void launch(const MergeArgs& args, bool vectorize, cudaStream_t stream) {
  if (vectorize) launch_typed<BlockT, 4>(args, stream);
  else launch_typed<BlockT, 1>(args, stream);
}

void attention_merge_cuda(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_out,
                          const at::Tensor& block_lse) {
  check_attention_merge_args(out, lse, block_out, block_lse);
  const int64_t rows = out.size(0) * out.size(1) * out.size(2);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  MergeArgs args;
  args.out = out.data_ptr<float>();
  args.lse = lse.data_ptr<float>();
  args.block_out = block_out.const_data_ptr();
  args.block_lse = block_lse.const_data_ptr<float>();
  args.seqlen = out.size(1);
  args.heads = out.size(2);
  args.head_dim = out.size(3);
  args.rows = rows;
  for (int dim = 0; dim < 4; ++dim) {
    args.out_strides[dim] = out.stride(dim);
    args.block_strides[dim] = block_out.stride(dim);
  }
  for (int dim = 0; dim < 3; ++dim) {
    args.lse_strides[dim] = lse.stride(dim);
    args.block_lse_strides[dim] = block_lse.stride(dim);
  }
  const bool vectorize = can_vectorize(out, block_out);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (block_out.scalar_type()) {
    case at::kFloat: return launch<float>(args, vectorize, stream);
    case at::kHalf: return launch<c10::Half>(args, vectorize, stream);
    case at::kBFloat16: return launch<c10::BFloat16>(args, vectorize, stream);
    default: TORCH_CHECK(false, "seqpar::attention_merge_: unsupported block_out dtype");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CUDA, m) { m.impl("attention_merge_", &attention_merge_cuda); }

}  // namespace seqpar
