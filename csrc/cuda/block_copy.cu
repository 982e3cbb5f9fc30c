// CUDA kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// One CTA row (blockIdx.y) per block, so no thread searches for its block; threads
// stride over the block's units. A unit is 16 bytes whenever every tensor's innermost
// dim is contiguous and everything is 16-byte aligned (headdim 64/80/128 in bf16 always
// is): the index math then runs once per 16 bytes instead of once per element, which
// is what lets a copy reach memory bandwidth.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_to_copy.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "seqpar/block_copy.h"
#include "seqpar/block_copy_plan.h"

namespace seqpar {
namespace {

struct KernelLayouts {
  StridedLayout layouts[kMaxTensors];
  char* bases[kMaxTensors];
};

// Where the kernel finds the block list. Up to kInlineBlocks descriptors travel as a
// kernel argument (a Ulysses exchange of q, k and v over up to 21 ranks, a reshard over
// up to 64): the launch then needs no pinned host buffer and no host-to-device copy,
// and a CUDA graph that captures it keeps the list in its kernel node (a captured copy
// from a pinned buffer reads that host memory again at every replay, when the caching
// host allocator may have handed it to another call). Longer lists go through pinned
// and then device memory. 64 descriptors (2,560 B) plus the layouts (704 B) stay
// under the 4 KiB kernel-argument limit of every CUDA version.
constexpr int kInlineBlocks = 64;

struct InlineBlocks {
  BlockDescriptor blocks[kInlineBlocks];
  __device__ __forceinline__ BlockDescriptor operator[](unsigned index) const {
    return blocks[index];
  }
};

struct DeviceBlocks {
  const BlockDescriptor* blocks;
  __device__ __forceinline__ BlockDescriptor operator[](unsigned index) const {
    return blocks[index];
  }
};

template <typename Unit, typename Index, typename BlockList>
__global__ void block_copy_kernel(KernelLayouts layouts, BlockList blocks, Unit* flat,
                                  bool to_flat) {
  const BlockDescriptor block = blocks[blockIdx.y];
  const StridedLayout& layout = layouts.layouts[block.tensor_index];
  Unit* strided = reinterpret_cast<Unit*>(layouts.bases[block.tensor_index]);
  Unit* flat_block = flat + block.flat_offset;
  const Index numel = static_cast<Index>(block.numel);
  for (Index unit = blockIdx.x * blockDim.x + threadIdx.x; unit < numel;
       unit += gridDim.x * blockDim.x) {
    const Index offset = strided_offset<Index>(layout, block, unit);
    if (to_flat) flat_block[unit] = strided[offset];
    else strided[offset] = flat_block[unit];
  }
}

// The widest unit (in bytes, up to 16) that divides every stride, inner extent, range,
// flat offset and pointer of the plan, given that each innermost dim has stride 1.
int64_t widest_unit(const BlockCopyPlan& plan, const char* flat) {
  for (int64_t unit = 16; unit > plan.element_size; unit /= 2) {
    if (unit % plan.element_size != 0) continue;
    const int64_t per_unit = unit / plan.element_size;
    bool fits = reinterpret_cast<uintptr_t>(flat) % unit == 0;
    for (int64_t t = 0; t < plan.num_tensors && fits; ++t) {
      const StridedLayout& layout = plan.layouts[t];
      const int inner = layout.ndim - 1;
      fits = layout.strides[inner] == 1 && reinterpret_cast<uintptr_t>(plan.bases[t]) % unit == 0;
      for (int dim = 0; dim < inner && fits; ++dim) fits = layout.strides[dim] % per_unit == 0;
      if (fits && inner != layout.split_dim) fits = layout.sizes[inner] % per_unit == 0;
    }
    for (const BlockDescriptor& block : plan.blocks) {
      if (!fits) break;
      // Flat offsets count every block of the buffer, also those the plan leaves to
      // other code (overlapping ranges), whose sizes need not be whole units.
      fits = block.flat_offset % per_unit == 0 && block.numel % per_unit == 0;
      const StridedLayout& layout = plan.layouts[block.tensor_index];
      if (fits && layout.ndim - 1 == layout.split_dim) {
        fits = block.start % per_unit == 0 && block.length % per_unit == 0;
      }
    }
    if (fits) return unit;
  }
  return plan.element_size;
}

// The plan in units of `per_unit` elements: inner extents and the other strides shrink.
void to_units(BlockCopyPlan& plan, int64_t per_unit) {
  if (per_unit == 1) return;
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    StridedLayout& layout = plan.layouts[t];
    const int inner = layout.ndim - 1;
    for (int dim = 0; dim < inner; ++dim) layout.strides[dim] /= per_unit;
    layout.sizes[inner] /= per_unit;
  }
  for (BlockDescriptor& block : plan.blocks) {
    const StridedLayout& layout = plan.layouts[block.tensor_index];
    if (layout.ndim - 1 == layout.split_dim) {
      block.start /= per_unit;
      block.length /= per_unit;
    }
    block.flat_offset /= per_unit;
    block.numel /= per_unit;
  }
}

// Whether every unit index, and every offset into a tensor, fits in int32 (with room
// for the grid-stride loop's last increment).
bool fits_int32(const BlockCopyPlan& plan) {
  constexpr int64_t kLimit = (int64_t{1} << 31) - (int64_t{1} << 26);
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    const StridedLayout& layout = plan.layouts[t];
    int64_t largest_offset = 0;
    for (int dim = 0; dim < layout.ndim; ++dim) {
      largest_offset += (layout.sizes[dim] - 1) * layout.strides[dim];
    }
    if (largest_offset >= kLimit) return false;
  }
  for (const BlockDescriptor& block : plan.blocks) {
    if (block.numel >= kLimit) return false;
  }
  return true;
}

template <typename Unit, typename BlockList>
void launch(const BlockCopyPlan& plan, const BlockList& blocks, char* flat, bool to_flat,
            cudaStream_t stream) {
  KernelLayouts layouts;
  int64_t largest = 0;
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    layouts.layouts[t] = plan.layouts[t];
    layouts.bases[t] = plan.bases[t];
  }
  for (const BlockDescriptor& block : plan.blocks) largest = std::max(largest, block.numel);
  constexpr int kThreads = 256;
  // Enough CTAs to cover the largest block with ~4 units per thread; the grid-stride
  // loop does the rest. gridDim.y is at most 65535 blocks (ranks x tensors).
  const int64_t ctas = std::min<int64_t>((largest + 4 * kThreads - 1) / (4 * kThreads), 65535);
  const dim3 grid(static_cast<unsigned>(std::max<int64_t>(ctas, 1)),
                  static_cast<unsigned>(plan.blocks.size()));
  if (fits_int32(plan)) {
    block_copy_kernel<Unit, int32_t><<<grid, kThreads, 0, stream>>>(
        layouts, blocks, reinterpret_cast<Unit*>(flat), to_flat);
  } else {
    block_copy_kernel<Unit, int64_t><<<grid, kThreads, 0, stream>>>(
        layouts, blocks, reinterpret_cast<Unit*>(flat), to_flat);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

struct alignas(16) Unit16 {
  uint4 value;
};

template <typename BlockList>
void launch_widest(int64_t unit, const BlockCopyPlan& plan, const BlockList& blocks, char* flat,
                   bool to_flat, cudaStream_t stream) {
  switch (unit) {
    case 16: return launch<Unit16>(plan, blocks, flat, to_flat, stream);
    case 8: return launch<uint64_t>(plan, blocks, flat, to_flat, stream);
    case 4: return launch<uint32_t>(plan, blocks, flat, to_flat, stream);
    case 2: return launch<uint16_t>(plan, blocks, flat, to_flat, stream);
    case 1: return launch<uint8_t>(plan, blocks, flat, to_flat, stream);
    default: TORCH_CHECK(false, "seqpar block copy: unsupported element size ", unit);
  }
}

void block_copy_cuda(const BlockCopyPlan& original_plan, char* flat, bool to_flat) {
  TORCH_CHECK(original_plan.blocks.size() <= 65535, "seqpar block copy: ",
              original_plan.blocks.size(), " blocks exceed the CUDA grid's y limit");
  BlockCopyPlan plan = original_plan;
  const int64_t unit = widest_unit(plan, flat);
  to_units(plan, unit / plan.element_size);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (plan.blocks.size() <= kInlineBlocks) {
    InlineBlocks blocks{};
    std::copy(plan.blocks.begin(), plan.blocks.end(), blocks.blocks);
    return launch_widest(unit, plan, blocks, flat, to_flat, stream);
  }
  // The long list travels to the device through pinned memory, asynchronously.
  const int64_t descriptor_bytes =
      static_cast<int64_t>(plan.blocks.size() * sizeof(BlockDescriptor));
  at::Tensor host_blocks = at::empty(
      {descriptor_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host_blocks.data_ptr(), plan.blocks.data(), descriptor_bytes);
  at::Tensor device_blocks = host_blocks.to(
      at::TensorOptions().device(at::kCUDA, c10::cuda::current_device()), /*non_blocking=*/true);
  const DeviceBlocks blocks{reinterpret_cast<const BlockDescriptor*>(device_blocks.data_ptr())};
  launch_widest(unit, plan, blocks, flat, to_flat, stream);
}

at::Tensor pack_blocks_cuda(at::TensorList inputs, at::IntArrayRef split_dims,
                            at::IntArrayRef starts, at::IntArrayRef lengths) {
  TORCH_CHECK(!inputs.empty(), "seqpar::pack_blocks: needs at least one input");
  const c10::cuda::CUDAGuard guard(inputs[0].device());
  return pack_blocks(inputs, split_dims, starts, lengths, block_copy_cuda);
}

std::vector<at::Tensor> unpack_blocks_cuda(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                           at::IntArrayRef out_dim_orders,
                                           at::IntArrayRef split_dims, at::IntArrayRef starts,
                                           at::IntArrayRef lengths) {
  const c10::cuda::CUDAGuard guard(buffer.device());
  return unpack_blocks(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths,
                       block_copy_cuda);
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CUDA, m) {
  m.impl("pack_blocks", &pack_blocks_cuda);
  m.impl("unpack_blocks", &unpack_blocks_cuda);
}

}  // namespace seqpar
