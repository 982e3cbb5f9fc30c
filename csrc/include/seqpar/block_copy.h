// Index math shared by the CPU and CUDA block-copy kernels.
//
// A "block copy" moves data between strided tensors and one flat buffer made of
// blocks laid end to end. Block b is `tensor[t].narrow(split_dim[t], start, length)`
// stored in C order (row-major over the tensor's own dim order). Packing reads the
// strided blocks and writes the flat buffer (the all-to-all send buffer); unpacking
// reads the flat buffer and writes the strided blocks (straight into the output
// layout, which may be a permuted view such as (B, S, H, D) over (B, H, S, D) memory).
//
// Both kernels see a block as rows (BlockRows) and find a row's offset with the same
// function (row_offset). The CUDA kernel's whole loop (copy_block_rows) is a host and
// device function too, so that a test runs it on the CPU (seqpar_testing ops in
// csrc/block_copy_plan.cpp): a machine without a GPU checks its arithmetic.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define SEQPAR_HOST_DEVICE __host__ __device__ __forceinline__
#define SEQPAR_UNROLL _Pragma("unroll")
#define SEQPAR_NO_UNROLL _Pragma("unroll 1")
#else
#define SEQPAR_HOST_DEVICE inline
#define SEQPAR_UNROLL
#define SEQPAR_NO_UNROLL
#endif

namespace seqpar {

// Dims left after coalescing. Coalescing merges neighbouring dims that are
// contiguous with each other, so even non-contiguous inputs rarely need more than 4.
constexpr int kMaxDims = 10;
// q, k and v travel together in Ulysses; a reshard moves one tensor.
constexpr int kMaxTensors = 4;

// The layout of one strided tensor, in units of the copy (an element, or a
// vector of elements when the CUDA kernel copies 16 bytes at a time).
struct StridedLayout {
  int32_t ndim;
  int32_t split_dim;  // the dim the blocks narrow
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

// One block: which tensor, its range along split_dim, and where it lies in the buffer.
struct BlockDescriptor {
  int64_t tensor_index;
  int64_t start;        // first index along split_dim
  int64_t length;       // extent along split_dim
  int64_t flat_offset;  // first unit of the block in the flat buffer
  int64_t numel;        // units in the block
};

// The block's extent along `dim`: its length along the split dim, the tensor's size
// along any other.
SEQPAR_HOST_DEVICE int64_t block_extent(const StridedLayout& layout, const BlockDescriptor& block,
                                        int dim) {
  return dim == layout.split_dim ? block.length : layout.sizes[dim];
}

// A block seen as rows: the trailing dims that are contiguous in the strided tensor
// (the split dim included, with the block's extent) form one row; the dims before
// them (layout dims [0, outer_ndim)) number the rows in C order. Row r holds units
// [r * row_length, (r + 1) * row_length) of the block's part of the flat buffer and,
// in the strided tensor, the units start_offset + row_offset(r) + i * inner_stride.
// A block never starts inside a row: its first unit is row 0's first unit.
struct BlockRows {
  int64_t rows;
  int64_t row_length;    // units per row
  int64_t inner_stride;  // stride between a row's units (1 unless the innermost dim is strided)
  int64_t start_offset;  // offset of the block's first unit in the strided tensor
  int32_t outer_ndim;
};

SEQPAR_HOST_DEVICE BlockRows block_rows(const StridedLayout& layout, const BlockDescriptor& block) {
  BlockRows shape{};
  int dim = layout.ndim - 1;
  shape.row_length = block_extent(layout, block, dim);
  shape.inner_stride = layout.strides[dim];
  if (shape.inner_stride == 1) {
    while (dim > 0 && layout.strides[dim - 1] == shape.row_length) {
      --dim;
      shape.row_length *= block_extent(layout, block, dim);
    }
  }
  shape.outer_ndim = dim;
  shape.rows = 1;
  for (int d = 0; d < dim; ++d) shape.rows *= block_extent(layout, block, d);
  shape.start_offset = block.start * layout.strides[layout.split_dim];
  return shape;
}

// Offset of row `row` of a block in its strided tensor, relative to the block's first
// unit (BlockRows::start_offset): one division and modulo per outer dim. With
// `outer_index`, also the row's index along each outer dim (the CPU kernel's odometer
// starts from them). Index is int64_t in general; the CUDA kernel uses int32_t when
// every offset fits, because 64-bit division costs several times the instructions of
// 32-bit division.
template <typename Index>
SEQPAR_HOST_DEVICE Index row_offset(const StridedLayout& layout, const BlockDescriptor& block,
                                    int outer_ndim, Index row, Index* outer_index = nullptr) {
  // Unsigned division: every index is non-negative, and it skips the sign fix-ups of
  // signed division (about a quarter of its instructions on the GPU).
  using Unsigned = std::make_unsigned_t<Index>;
  Unsigned rest = static_cast<Unsigned>(row);
  Index offset = 0;
  // Not unrolled: rarely more than 2 outer dims, and the CUDA kernel inlines this 5 times.
  SEQPAR_NO_UNROLL
  for (int dim = outer_ndim - 1; dim >= 0; --dim) {
    const Unsigned extent = static_cast<Unsigned>(block_extent(layout, block, dim));
    const Index index = static_cast<Index>(rest % extent);
    rest /= extent;
    offset += index * static_cast<Index>(layout.strides[dim]);
    if (outer_index != nullptr) outer_index[dim] = index;
  }
  return offset;
}

// ---- The CUDA kernel's loop (csrc/cuda/block_copy.cu) ----
//
// The kernel runs one grid row of CTAs (blockIdx.y) per block; copy_block_rows is what
// each of its threads does, given its index among the threads of that grid row.
// Index arithmetic runs once per row (or per segment of a long row), never per unit:
// within a row the units are contiguous in the flat buffer and one stride apart in
// the tensor. Each thread loads kUnitsInFlight units into registers before it stores
// any, so that many loads wait on memory at once.
constexpr int kCudaThreadsPerCta = 256;
constexpr int kUnitsInFlight = 4;
// A thread makes at most this many passes (kUnitsInFlight units each) over a row, or
// over a segment of a long row, per computation of the row's offset: the divisions of
// row_offset are then spread over up to 16 units per thread. Segments keep long rows
// (a reshard's whole block can be one row) spread over the grid.
constexpr int kPassesPerSegment = 4;
constexpr int kUnitsPerSegmentLane = kUnitsInFlight * kPassesPerSegment;

// Threads that share a row, as a power of two: the fewest whose segment
// (kUnitsPerSegmentLane units each) covers the row, at most a warp. Thread `lane` of
// the group takes units lane, lane + lanes, ... so that a warp's load instruction reads
// `lanes` neighbouring units of each of its rows. Rows shorter than kUnitsInFlight go
// another way.
SEQPAR_HOST_DEVICE int row_lanes_log2(int64_t row_length) {
  int log2 = 0;
  while (log2 < 5 && (int64_t{kUnitsPerSegmentLane} << log2) < row_length) ++log2;
  return log2;
}

// What copy_block_rows reads and writes through: Unit* in the CUDA kernel; the host
// run of the tests passes a bounds-checked view whose value_type is the unit.
template <typename Units>
struct UnitOf {
  using type = typename Units::value_type;
};
template <typename Unit>
struct UnitOf<Unit*> {
  using type = Unit;
};

// Where a row's units are: unit i of the row is strided[strided_row + i * stride] in
// the tensor and flat[flat_row + i] in the buffer. Offsets are Index from one base
// pointer per block, so that on the GPU an address is one 32-bit multiply-add and one
// wide multiply-add (IMAD, IMAD.WIDE) and no 64-bit arithmetic.
template <bool kToFlat, typename Units, typename Index>
struct RowEnds {
  using Unit = typename UnitOf<Units>::type;
  Units strided;
  Units flat;
  Index stride;
  Index strided_row;
  Index flat_row;

  SEQPAR_HOST_DEVICE Unit load(Index unit) const {
    if constexpr (kToFlat) return strided[strided_row + unit * stride];
    else return flat[flat_row + unit];
  }
  SEQPAR_HOST_DEVICE void store(Index unit, const Unit& value) const {
    if constexpr (kToFlat) flat[flat_row + unit] = value;
    else strided[strided_row + unit * stride] = value;
  }
};

// Copies the part of `block` that thread `thread` of `threads` (a multiple of 32)
// takes. `strided`: the block's tensor; `flat`: the buffer; kToFlat is packing.
template <bool kToFlat, typename Index, typename Units>
SEQPAR_HOST_DEVICE void copy_block_rows(const StridedLayout& layout, const BlockDescriptor& block,
                                        Units strided, Units flat, Index thread, Index threads) {
  using Unit = typename UnitOf<Units>::type;
  using Ends = RowEnds<kToFlat, Units, Index>;
  const BlockRows shape = block_rows(layout, block);
  const Index rows = static_cast<Index>(shape.rows);
  const Index length = static_cast<Index>(shape.row_length);
  const Index start = static_cast<Index>(shape.start_offset);
  Ends row_ends{strided, flat + block.flat_offset, static_cast<Index>(shape.inner_stride), 0, 0};
  if (length < kUnitsInFlight) {
    // Short rows (a head dim of 8 to 24 bf16 values that does not merge with the next
    // dim, a split innermost dim cut into short ranges): each thread takes
    // kUnitsInFlight rows, `threads` apart, and loads one unit of each at a time.
    for (Index first = thread; first < rows; first += threads * kUnitsInFlight) {
      Ends ends[kUnitsInFlight];
      bool valid[kUnitsInFlight];
      SEQPAR_UNROLL
      for (int j = 0; j < kUnitsInFlight; ++j) {
        const Index row = first + j * threads;
        valid[j] = row < rows;
        ends[j] = row_ends;
        if (!valid[j]) continue;
        ends[j].strided_row = start + row_offset<Index>(layout, block, shape.outer_ndim, row);
        ends[j].flat_row = row * length;
      }
      for (Index unit = 0; unit < length; ++unit) {
        Unit values[kUnitsInFlight];
        SEQPAR_UNROLL
        for (int j = 0; j < kUnitsInFlight; ++j) {
          if (valid[j]) values[j] = ends[j].load(unit);
        }
        SEQPAR_UNROLL
        for (int j = 0; j < kUnitsInFlight; ++j) {
          if (valid[j]) ends[j].store(unit, values[j]);
        }
      }
    }
    return;
  }
  // Rows of kUnitsInFlight units or more: `lanes` threads per row, each loading the
  // units lane, lane + lanes, ... of a pass. A row splits into segments of at most
  // kPassesPerSegment passes; (row, segment) pairs are the items the groups share.
  using Unsigned = std::make_unsigned_t<Index>;
  const int lanes_log2 = row_lanes_log2(shape.row_length);
  const Index lanes = Index{1} << lanes_log2;
  const Index lane = thread & (lanes - 1);
  const Index group = thread >> lanes_log2;
  const Index groups = threads >> lanes_log2;
  const Index pass_units = lanes * kUnitsInFlight;
  const Index segment_units = lanes * kUnitsPerSegmentLane;
  const Index segments_per_row = (length + segment_units - 1) >> (lanes_log2 + 4);
  static_assert(kUnitsPerSegmentLane == 16, "segments_per_row divides by a shift");
  const Index items = rows * segments_per_row;
  for (Index item = group; item < items; item += groups) {
    Index row = item;
    Index begin = 0;
    if (segments_per_row > 1) {
      row = static_cast<Index>(static_cast<Unsigned>(item) / static_cast<Unsigned>(segments_per_row));
      begin = (item - row * segments_per_row) * segment_units;
    }
    const Index end = length - begin < segment_units ? length : begin + segment_units;
    row_ends.strided_row = start + row_offset<Index>(layout, block, shape.outer_ndim, row);
    row_ends.flat_row = row * length;
    Index unit = begin + lane;
    // Whole passes (every slot inside the row) need no bounds checks.
    for (; unit + (kUnitsInFlight - 1) * lanes < end; unit += pass_units) {
      Unit values[kUnitsInFlight];
      SEQPAR_UNROLL
      for (int j = 0; j < kUnitsInFlight; ++j) values[j] = row_ends.load(unit + j * lanes);
      SEQPAR_UNROLL
      for (int j = 0; j < kUnitsInFlight; ++j) row_ends.store(unit + j * lanes, values[j]);
    }
    // At most one partial pass is left.
    if (unit < end) {
      Unit values[kUnitsInFlight];
      SEQPAR_UNROLL
      for (int j = 0; j < kUnitsInFlight; ++j) {
        if (unit + j * lanes < end) values[j] = row_ends.load(unit + j * lanes);
      }
      SEQPAR_UNROLL
      for (int j = 0; j < kUnitsInFlight; ++j) {
        if (unit + j * lanes < end) row_ends.store(unit + j * lanes, values[j]);
      }
    }
  }
}

}  // namespace seqpar
