#include "seqpar/block_copy_plan.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace seqpar {
namespace {

// Sizes and strides of `tensor` with size-1 dims dropped and neighbouring dims merged
// where memory allows, keeping `split_dim` on its own because blocks narrow it.
StridedLayout coalesced_layout(const at::Tensor& tensor, int64_t split_dim) {
  StridedLayout layout{};
  layout.ndim = 0;
  layout.split_dim = -1;
  for (const auto dim : c10::irange(tensor.dim())) {
    const int64_t size = tensor.size(dim);
    const int64_t stride = tensor.stride(dim);
    const bool is_split = dim == split_dim;
    if (size == 1 && !is_split) continue;
    const int last = layout.ndim - 1;
    if (!is_split && last >= 0 && last != layout.split_dim &&
        layout.strides[last] == size * stride) {
      layout.sizes[last] *= size;
      layout.strides[last] = stride;
      continue;
    }
    TORCH_CHECK(layout.ndim < kMaxDims, "seqpar block copy: tensor of shape ", tensor.sizes(),
                " and strides ", tensor.strides(), " has more than ", kMaxDims,
                " dims that cannot be merged; make it contiguous first");
    if (is_split) layout.split_dim = layout.ndim;
    layout.sizes[layout.ndim] = size;
    layout.strides[layout.ndim] = stride;
    ++layout.ndim;
  }
  return layout;
}

void check_ranges(at::IntArrayRef split_dims, at::IntArrayRef starts, at::IntArrayRef lengths,
                  int64_t num_tensors) {
  TORCH_CHECK(num_tensors > 0 && num_tensors <= kMaxTensors,
              "seqpar block copy: between 1 and ", kMaxTensors, " tensors, got ", num_tensors);
  TORCH_CHECK(static_cast<int64_t>(split_dims.size()) == num_tensors,
              "seqpar block copy: one split dim per tensor, got ", split_dims.size(),
              " for ", num_tensors, " tensors");
  TORCH_CHECK(starts.size() == lengths.size() && starts.size() % num_tensors == 0 &&
                  !starts.empty(),
              "seqpar block copy: starts and lengths need world_size x num_tensors entries, got ",
              starts.size(), " and ", lengths.size(), " for ", num_tensors, " tensors");
}

// Block numel: the tensor's numel with split_dim's extent replaced by `length`.
int64_t block_numel(at::IntArrayRef shape, int64_t split_dim, int64_t length) {
  int64_t numel = length;
  for (const auto dim : c10::irange(shape.size())) {
    if (static_cast<int64_t>(dim) != split_dim) numel *= shape[dim];
  }
  return numel;
}

// Lists the blocks of the tensors whose `included` flag is set, in buffer order
// (rank-major, then tensor), with their flat offsets counted over all tensors.
void add_blocks(BlockCopyPlan& plan, const std::vector<std::vector<int64_t>>& shapes,
                at::IntArrayRef split_dims, at::IntArrayRef starts, at::IntArrayRef lengths,
                const std::vector<bool>& included) {
  const int64_t num_tensors = static_cast<int64_t>(shapes.size());
  const int64_t world_size = static_cast<int64_t>(starts.size()) / num_tensors;
  int64_t flat_offset = 0;
  for (const auto rank : c10::irange(world_size)) {
    for (const auto t : c10::irange(num_tensors)) {
      const int64_t index = rank * num_tensors + t;
      const int64_t extent = shapes[t][split_dims[t]];
      TORCH_CHECK(starts[index] >= 0 && lengths[index] >= 0 &&
                      starts[index] + lengths[index] <= extent,
                  "seqpar block copy: range [", starts[index], ", ",
                  starts[index] + lengths[index], ") of tensor ", t, " for rank ", rank,
                  " is outside its dim ", split_dims[t], " of size ", extent);
      const int64_t numel = block_numel(shapes[t], split_dims[t], lengths[index]);
      if (numel > 0 && included[t]) {
        plan.blocks.push_back(BlockDescriptor{t, starts[index], lengths[index], flat_offset, numel});
      }
      flat_offset += numel;
    }
  }
}

void fill_layouts(BlockCopyPlan& plan, const std::vector<at::Tensor>& tensors,
                  at::IntArrayRef split_dims) {
  plan.num_tensors = static_cast<int64_t>(tensors.size());
  plan.element_size = static_cast<int64_t>(tensors[0].element_size());
  for (const auto t : c10::irange(tensors.size())) {
    plan.layouts[t] = coalesced_layout(tensors[t], split_dims[t]);
    plan.bases[t] = static_cast<char*>(tensors[t].data_ptr());
  }
}

int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

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

// Whether every unit index, and every offset into a tensor, fits in int32, with room
// for the last increment of the kernel's grid-stride loops (at most
// kUnitsInFlight x 65535 x kCudaThreadsPerCta < 2^26).
bool fits_int32(const BlockCopyPlan& plan) {
  constexpr int64_t kLimit = (int64_t{1} << 31) - (int64_t{1} << 26);
  static_assert(int64_t{kUnitsInFlight} * 65535 * kCudaThreadsPerCta < (int64_t{1} << 26));
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

}  // namespace

CudaBlockCopyLaunch plan_cuda_launch(BlockCopyPlan& plan, const char* flat) {
  CudaBlockCopyLaunch launch{};
  launch.unit_bytes = widest_unit(plan, flat);
  to_units(plan, launch.unit_bytes / plan.element_size);
  launch.int32_index = fits_int32(plan);
  int64_t largest = 0;
  for (const BlockDescriptor& block : plan.blocks) largest = std::max(largest, block.numel);
  // Enough CTAs to cover the largest block with one segment (kPassesPerSegment x
  // kUnitsInFlight units) per thread; the grid-stride loops do the rest. gridDim.x is
  // kept to gridDim.y's limit, 65535, which fits_int32's margin assumes.
  constexpr int64_t kUnitsPerCta = int64_t{kCudaThreadsPerCta} * kUnitsInFlight * kPassesPerSegment;
  launch.ctas_per_block = std::clamp<int64_t>((largest + kUnitsPerCta - 1) / kUnitsPerCta, 1, 65535);
  return launch;
}

at::Tensor pack_blocks(at::TensorList inputs, at::IntArrayRef split_dims, at::IntArrayRef starts,
                       at::IntArrayRef lengths, BlockCopyKernel kernel) {
  const int64_t num_tensors = static_cast<int64_t>(inputs.size());
  check_ranges(split_dims, starts, lengths, num_tensors);
  std::vector<at::Tensor> tensors(inputs.begin(), inputs.end());
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> dims;
  for (const auto t : c10::irange(num_tensors)) {
    TORCH_CHECK(tensors[t].scalar_type() == tensors[0].scalar_type() &&
                    tensors[t].device() == tensors[0].device(),
                "seqpar::pack_blocks: all inputs need one dtype and device, got ",
                tensors[t].scalar_type(), " on ", tensors[t].device(), " and ",
                tensors[0].scalar_type(), " on ", tensors[0].device());
    const int64_t dim = wrap_dim(split_dims[t], tensors[t].dim());
    TORCH_CHECK(dim >= 0 && dim < tensors[t].dim(), "seqpar::pack_blocks: split dim ",
                split_dims[t], " is out of range for input of shape ", tensors[t].sizes());
    dims.push_back(dim);
    shapes.emplace_back(tensors[t].sizes().begin(), tensors[t].sizes().end());
  }
  int64_t total = 0;
  for (const auto index : c10::irange(starts.size())) {
    const int64_t t = static_cast<int64_t>(index) % num_tensors;
    total += block_numel(shapes[t], dims[t], lengths[index]);
  }
  at::Tensor buffer = at::empty({total}, tensors[0].options());
  if (total == 0) return buffer;
  BlockCopyPlan plan;
  fill_layouts(plan, tensors, dims);
  add_blocks(plan, shapes, dims, starts, lengths, std::vector<bool>(num_tensors, true));
  kernel(plan, static_cast<char*>(buffer.data_ptr()), /*to_flat=*/true);
  return buffer;
}

std::vector<at::Tensor> unpack_blocks(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                      at::IntArrayRef out_dim_orders,
                                      at::IntArrayRef split_dims, at::IntArrayRef starts,
                                      at::IntArrayRef lengths, BlockCopyKernel kernel) {
  const int64_t num_tensors = static_cast<int64_t>(split_dims.size());
  check_ranges(split_dims, starts, lengths, num_tensors);
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous(),
              "seqpar::unpack_blocks: buffer must be flat and contiguous, got shape ",
              buffer.sizes(), " strides ", buffer.strides());
  TORCH_CHECK(out_shapes.size() == out_dim_orders.size() && out_shapes.size() % num_tensors == 0,
              "seqpar::unpack_blocks: out_shapes (", out_shapes.size(), " entries) and out_dim_orders (",
              out_dim_orders.size(), ") need ndim entries per output, ", num_tensors, " outputs");
  const int64_t ndim = static_cast<int64_t>(out_shapes.size()) / num_tensors;
  std::vector<at::Tensor> outputs;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> dims;
  for (const auto t : c10::irange(num_tensors)) {
    std::vector<int64_t> shape(out_shapes.begin() + t * ndim, out_shapes.begin() + (t + 1) * ndim);
    std::vector<int64_t> order(out_dim_orders.begin() + t * ndim,
                               out_dim_orders.begin() + (t + 1) * ndim);
    std::vector<int64_t> sorted_order = order;
    std::sort(sorted_order.begin(), sorted_order.end());
    std::vector<int64_t> identity(ndim);
    std::iota(identity.begin(), identity.end(), 0);
    TORCH_CHECK(sorted_order == identity, "seqpar::unpack_blocks: out_dim_orders ", order,
                " is not a permutation of ", ndim, " dims");
    // Strides of a tensor whose memory order lists dims outermost first.
    std::vector<int64_t> strides(ndim);
    int64_t stride = 1;
    for (int64_t k = ndim - 1; k >= 0; --k) {
      strides[order[k]] = stride;
      stride *= std::max<int64_t>(shape[order[k]], 1);
    }
    outputs.push_back(at::empty_strided(shape, strides, buffer.options()));
    const int64_t dim = wrap_dim(split_dims[t], ndim);
    TORCH_CHECK(dim >= 0 && dim < ndim, "seqpar::unpack_blocks: split dim ", split_dims[t],
                " is out of range for output of shape ", shape);
    dims.push_back(dim);
    shapes.push_back(shape);
  }
  int64_t total = 0;
  for (const auto index : c10::irange(starts.size())) {
    const int64_t t = static_cast<int64_t>(index) % num_tensors;
    total += block_numel(shapes[t], dims[t], lengths[index]);
  }
  TORCH_CHECK(total == buffer.numel(), "seqpar::unpack_blocks: the blocks hold ", total,
              " elements but the buffer has ", buffer.numel());

  // Classify each output by its ranges: disjoint ranges are copied by the kernel
  // (after zero-filling any gap); overlapping ranges are summed in the op-math dtype.
  const int64_t world_size = static_cast<int64_t>(starts.size()) / num_tensors;
  std::vector<bool> by_kernel(num_tensors, true);
  for (const auto t : c10::irange(num_tensors)) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const auto rank : c10::irange(world_size)) {
      const int64_t index = rank * num_tensors + t;
      if (lengths[index] > 0) ranges.emplace_back(starts[index], lengths[index]);
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t covered_until = 0;
    bool disjoint = true;
    bool gapless = true;
    for (const auto& [start, length] : ranges) {
      disjoint = disjoint && start >= covered_until;
      gapless = gapless && start <= covered_until;
      covered_until = std::max(covered_until, start + length);
    }
    gapless = gapless && covered_until == shapes[t][dims[t]];
    if (!disjoint) by_kernel[t] = false;
    else if (!gapless) outputs[t].zero_();
  }
  if (total > 0) {
    BlockCopyPlan plan;
    fill_layouts(plan, outputs, dims);
    add_blocks(plan, shapes, dims, starts, lengths, by_kernel);
    if (!plan.blocks.empty()) kernel(plan, static_cast<char*>(buffer.data_ptr()), /*to_flat=*/false);
  }
  // Overlapping ranges only arise in backward passes (gradients of a tensor that was
  // sent to several ranks), on small tensors: ATen's ops are fast enough there. The
  // sum runs in the op-math dtype (fp32 for fp16/bf16) and is rounded once. Dtypes
  // without one (uint16, float8, ...) never get here: they have no gradients.
  if (std::all_of(by_kernel.begin(), by_kernel.end(), [](bool kernel) { return kernel; })) {
    return outputs;
  }
  const auto math_type = at::toOpMathType(buffer.scalar_type());
  std::vector<at::Tensor> accumulators(num_tensors);
  for (const auto t : c10::irange(num_tensors)) {
    if (!by_kernel[t]) accumulators[t] = at::zeros(shapes[t], buffer.options().dtype(math_type));
  }
  int64_t flat_offset = 0;
  for (const auto rank : c10::irange(world_size)) {
    for (const auto t : c10::irange(num_tensors)) {
      const int64_t index = rank * num_tensors + t;
      const int64_t numel = block_numel(shapes[t], dims[t], lengths[index]);
      if (!by_kernel[t] && numel > 0) {
        std::vector<int64_t> block_shape = shapes[t];
        block_shape[dims[t]] = lengths[index];
        accumulators[t]
            .narrow(dims[t], starts[index], lengths[index])
            .add_(buffer.narrow(0, flat_offset, numel).view(block_shape));
      }
      flat_offset += numel;
    }
  }
  for (const auto t : c10::irange(num_tensors)) {
    if (!by_kernel[t]) outputs[t].copy_(accumulators[t]);
  }
  return outputs;
}


namespace {

// ---- The CUDA kernel's loop, run on the host for tests ----
//
// seqpar_testing::pack_blocks_cuda_loop and unpack_blocks_cuda_loop are pack_blocks and
// unpack_blocks whose copy is copy_block_rows (seqpar/block_copy.h), the loop that every
// thread of the CUDA kernel runs, called for every thread of the grid that the CUDA
// launch would use (plan_cuda_launch: the same units, index type and grid), one thread
// after another, on CPU tensors. So a machine without a GPU checks the CUDA kernel's
// row, segment and tail arithmetic. Every access goes through CheckedUnits, which fails
// on a unit outside its block and on a unit written twice, and the copy fails unless
// every unit of every block was written; the tests compare the values with the CPU
// kernel's. Not used by the library. It lives here, not beside the CPU kernel: in
// csrc/cpu/block_copy.cpp its templates made GCC (12, -O3) compile block_copy_cpu's
// row loop as a function of its own instead of inlining it, as it does without them.

// Units [0, size) from `origin`, seen through an index that starts at unit `position`
// (copy_block_rows indexes the tensor from its base and the buffer from its start).
// writes[writes_base + u] counts the stores to unit u.
template <typename Unit>
struct CheckedUnits {
  using value_type = Unit;

  char* origin = nullptr;
  int64_t size = 0;
  int64_t position = 0;
  std::vector<int32_t>* writes = nullptr;
  int64_t writes_base = 0;
  const char* what = "";

  struct Reference {
    const CheckedUnits* units;
    int64_t unit;

    operator Unit() const {
      Unit value;
      std::memcpy(&value, units->address(unit), sizeof(Unit));
      return value;
    }
    const Reference& operator=(const Unit& value) const {
      std::memcpy(units->address(unit), &value, sizeof(Unit));
      int32_t& count = (*units->writes)[units->writes_base + unit];
      TORCH_CHECK(++count == 1, "seqpar block copy, CUDA loop on the host: ", units->what,
                  " unit ", units->writes_base + unit, " written twice");
      return *this;
    }
  };

  char* address(int64_t unit) const {
    TORCH_CHECK(unit >= 0 && unit < size, "seqpar block copy, CUDA loop on the host: ", what,
                " unit ", writes_base + unit, " is outside the block's units [", writes_base,
                ", ", writes_base + size, ")");
    return origin + unit * static_cast<int64_t>(sizeof(Unit));
  }
  CheckedUnits operator+(int64_t count) const {
    CheckedUnits moved = *this;
    moved.position += count;
    return moved;
  }
  Reference operator[](int64_t index) const { return Reference{this, position + index}; }
};

struct alignas(16) HostUnit16 {
  uint64_t low;
  uint64_t high;
};

// Largest offset (in units) of a unit of the block, or of the whole tensor with
// whole_tensor: all strides are non-negative, so the last index along every dim.
int64_t largest_offset(const StridedLayout& layout, const BlockDescriptor& block, bool whole_tensor) {
  int64_t offset = whole_tensor ? 0 : block.start * layout.strides[layout.split_dim];
  for (int d = 0; d < layout.ndim; ++d) {
    const int64_t extent = whole_tensor ? layout.sizes[d] : block_extent(layout, block, d);
    offset += (extent - 1) * layout.strides[d];
  }
  return offset;
}

template <typename Unit, typename Index>
void run_cuda_loop(const BlockCopyPlan& plan, char* flat, bool to_flat, int64_t ctas) {
  const int64_t unit_bytes = static_cast<int64_t>(sizeof(Unit));
  int64_t buffer_units = 0;
  for (const BlockDescriptor& block : plan.blocks) {
    buffer_units = std::max(buffer_units, block.flat_offset + block.numel);
  }
  std::vector<int32_t> buffer_writes(buffer_units, 0);
  std::vector<int32_t> tensor_writes[kMaxTensors];
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    const int64_t largest = largest_offset(plan.layouts[t], BlockDescriptor{}, /*whole_tensor=*/true);
    tensor_writes[t].assign(std::max<int64_t>(largest, 0) + 1, 0);
  }
  const Index threads = static_cast<Index>(ctas * kCudaThreadsPerCta);
  for (const BlockDescriptor& block : plan.blocks) {
    const StridedLayout& layout = plan.layouts[block.tensor_index];
    const int64_t first = block.start * layout.strides[layout.split_dim];
    const CheckedUnits<Unit> tensor_view{
        plan.bases[block.tensor_index] + first * unit_bytes,
        largest_offset(layout, block, /*whole_tensor=*/false) - first + 1,
        -first, &tensor_writes[block.tensor_index], first, "tensor"};
    const CheckedUnits<Unit> buffer_view{
        flat + block.flat_offset * unit_bytes, block.numel, -block.flat_offset, &buffer_writes,
        block.flat_offset, "buffer"};
    // Every thread of this block's grid row, numbered as the CUDA kernel numbers them
    // (blockIdx.x * blockDim.x + threadIdx.x).
    for (Index thread = 0; thread < threads; ++thread) {
      if (to_flat) {
        copy_block_rows<true, Index>(layout, block, tensor_view, buffer_view, thread, threads);
      } else {
        copy_block_rows<false, Index>(layout, block, tensor_view, buffer_view, thread, threads);
      }
    }
  }
  if (to_flat) {
    for (const BlockDescriptor& block : plan.blocks) {
      const auto begin = buffer_writes.begin() + block.flat_offset;
      const int64_t written = std::accumulate(begin, begin + block.numel, int64_t{0});
      TORCH_CHECK(written == block.numel, "seqpar block copy, CUDA loop on the host: ", written,
                  " of the ", block.numel, " units of the block at buffer unit ",
                  block.flat_offset, " were written");
    }
    return;
  }
  // The blocks of one output are disjoint and no unit was stored twice, so the stores
  // add up to the blocks' units only if every unit of every block was stored.
  int64_t expected[kMaxTensors] = {};
  for (const BlockDescriptor& block : plan.blocks) expected[block.tensor_index] += block.numel;
  for (int64_t t = 0; t < plan.num_tensors; ++t) {
    const int64_t written =
        std::accumulate(tensor_writes[t].begin(), tensor_writes[t].end(), int64_t{0});
    TORCH_CHECK(written == expected[t], "seqpar block copy, CUDA loop on the host: ", written,
                " units of output ", t, " were written, its blocks hold ", expected[t]);
  }
}

// index_bits: 0 for the CUDA launch's choice, 64 to use int64 indices where int32 would
// do. ctas: 0 for the CUDA launch's gridDim.x, or another (fewer CTAs make each thread
// loop over more rows and segments).
void block_copy_cuda_loop(const BlockCopyPlan& original_plan, char* flat, bool to_flat,
                          int64_t index_bits, int64_t ctas) {
  TORCH_CHECK(index_bits == 0 || index_bits == 64, "seqpar_testing: index_bits is 0 or 64, got ",
              index_bits);
  TORCH_CHECK(ctas >= 0 && ctas <= 65535, "seqpar_testing: ctas is 0 or up to 65535, got ", ctas);
  BlockCopyPlan plan = original_plan;
  CudaBlockCopyLaunch launch = plan_cuda_launch(plan, flat);
  if (index_bits == 64) launch.int32_index = false;
  if (ctas > 0) launch.ctas_per_block = ctas;
  auto run = [&](auto unit) {
    using Unit = decltype(unit);
    if (launch.int32_index) run_cuda_loop<Unit, int32_t>(plan, flat, to_flat, launch.ctas_per_block);
    else run_cuda_loop<Unit, int64_t>(plan, flat, to_flat, launch.ctas_per_block);
  };
  switch (launch.unit_bytes) {
    case 16: return run(HostUnit16{});
    case 8: return run(uint64_t{});
    case 4: return run(uint32_t{});
    case 2: return run(uint16_t{});
    case 1: return run(uint8_t{});
    default: TORCH_CHECK(false, "seqpar block copy: unsupported element size ", launch.unit_bytes);
  }
}

at::Tensor pack_blocks_cuda_loop(at::TensorList inputs, at::IntArrayRef split_dims,
                                 at::IntArrayRef starts, at::IntArrayRef lengths,
                                 int64_t index_bits, int64_t ctas) {
  return pack_blocks(inputs, split_dims, starts, lengths,
                     [&](const BlockCopyPlan& plan, char* flat, bool to_flat) {
                       block_copy_cuda_loop(plan, flat, to_flat, index_bits, ctas);
                     });
}

std::vector<at::Tensor> unpack_blocks_cuda_loop(const at::Tensor& buffer,
                                                at::IntArrayRef out_shapes,
                                                at::IntArrayRef out_dim_orders,
                                                at::IntArrayRef split_dims, at::IntArrayRef starts,
                                                at::IntArrayRef lengths, int64_t index_bits,
                                                int64_t ctas) {
  return unpack_blocks(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths,
                       [&](const BlockCopyPlan& plan, char* flat, bool to_flat) {
                         block_copy_cuda_loop(plan, flat, to_flat, index_bits, ctas);
                       });
}

}  // namespace

// Test-only ops, in their own namespace so that seqpar's schemas stay in csrc/ops.cpp.
TORCH_LIBRARY_FRAGMENT(seqpar_testing, m) {
  m.def(
      "pack_blocks_cuda_loop(Tensor[] inputs, int[] split_dims, int[] starts, int[] lengths, "
      "int index_bits=0, int ctas=0) -> Tensor");
  m.def(
      "unpack_blocks_cuda_loop(Tensor buffer, int[] out_shapes, int[] out_dim_orders, "
      "int[] split_dims, int[] starts, int[] lengths, int index_bits=0, int ctas=0) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(seqpar_testing, CPU, m) {
  m.impl("pack_blocks_cuda_loop", &pack_blocks_cuda_loop);
  m.impl("unpack_blocks_cuda_loop", &unpack_blocks_cuda_loop);
}

}  // namespace seqpar
