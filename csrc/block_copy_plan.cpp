#include "seqpar/block_copy_plan.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <numeric>

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

}  // namespace

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

}  // namespace seqpar
