// CPU kernels of seqpar::pack_blocks and seqpar::unpack_blocks.
//
// Work is split into rows (BlockRows in seqpar/block_copy.h, which the CUDA kernel
// shares): a row is the longest run of a block that is contiguous in the strided
// tensor, one copy; rows with a non-unit innermost stride copy element by element.
// Large copies write their destination with streaming (non-temporal) stores.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <climits>
#include <vector>

// Streaming stores through SSE2, which every x86-64 CPU has; elsewhere plain copies.
#if defined(__SSE2__) || defined(_M_X64)
#define SEQPAR_STREAMING_STORES 1
#include <emmintrin.h>
#endif

#include "seqpar/block_copy.h"
#include "seqpar/block_copy_plan.h"

#if defined(__GNUC__)
#define SEQPAR_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SEQPAR_ALWAYS_INLINE inline
#endif

namespace seqpar {
namespace {

// Below this many bytes a thread's share is not worth the fork (at::parallel_for grain).
constexpr int64_t kBytesPerTask = 64 * 1024;

template <typename Unit>
void copy_strided_row(char* strided, int64_t stride, char* flat, int64_t count, bool to_flat) {
  auto* strided_units = reinterpret_cast<Unit*>(strided);
  auto* flat_units = reinterpret_cast<Unit*>(flat);
  // Pointer steps, not i * stride: no multiply per element.
  if (to_flat) {
    for (int64_t i = 0; i < count; ++i, strided_units += stride) flat_units[i] = *strided_units;
  } else {
    for (int64_t i = 0; i < count; ++i, strided_units += stride) *strided_units = flat_units[i];
  }
}

// Copies that write at least this many bytes in all store their whole cache lines with
// streaming (non-temporal) stores: such a destination outgrows a core's L2 anyway, and a
// plain store first reads each line it writes (read for ownership) and evicts the source.
// Below it the result stays in cache for the op that reads it next. docs/tuning.md has
// the measurements.
constexpr int64_t kStreamingBytes = int64_t{1} << 20;
constexpr int64_t kLineBytes = 64;

// Copies whole 64-byte lines to a line-aligned destination with streaming stores. Only
// rows made of whole lines stream (rows_fill_lines): plain stores to partial lines
// beside streamed ones make the prefetchers pull those into the cache, and each
// streamed line then costs an eviction. The caller fences (stream_fence) before its
// writes may be read.
SEQPAR_ALWAYS_INLINE void copy_lines_streaming(char* destination, const char* source,
                                               size_t bytes) {
#if defined(SEQPAR_STREAMING_STORES)
  for (size_t done = 0; done < bytes; done += static_cast<size_t>(kLineBytes)) {
    // The line is loaded whole before any of it is stored: one write-combining flush.
    const auto* from = reinterpret_cast<const __m128i*>(source + done);
    auto* to = reinterpret_cast<__m128i*>(destination + done);
    const __m128i part0 = _mm_loadu_si128(from);
    const __m128i part1 = _mm_loadu_si128(from + 1);
    const __m128i part2 = _mm_loadu_si128(from + 2);
    const __m128i part3 = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, part0);
    _mm_stream_si128(to + 1, part1);
    _mm_stream_si128(to + 2, part2);
    _mm_stream_si128(to + 3, part3);
  }
#else
  std::memcpy(destination, source, bytes);
#endif
}

// Orders this thread's streaming stores before whatever publishes them (the end of its
// at::parallel_for task): they are weakly ordered.
inline void stream_fence(bool stream) {
#if defined(SEQPAR_STREAMING_STORES)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// Rows up to this size are copied by an inlined loop of 16-byte moves rather than a
// memcpy call: Ulysses with many ranks cuts rows of one head (128 bytes for D=64 in
// bf16), where the call costs as much as the copy. Measured on a 2-core Xeon, pack of
// 32 destinations x (q, k, v) with 128-byte rows, one thread: 2.6 ms -> 2.0 ms.
constexpr size_t kInlineCopyBytes = 512;

struct alignas(16) Bytes16 {
  char bytes[16];
};

// How each row of a block is copied, decided once per block so that the row loops
// test nothing per row.
enum class RowMethod {
  kStreaming,  // contiguous whole lines at line-aligned destinations: streaming stores
  kInline,     // contiguous, a multiple of 16 bytes up to kInlineCopyBytes: 16-byte moves
  kMemcpy,     // contiguous, any other length
  kStrided,    // a non-unit stride inside the row: element by element
};

struct RowCopy {
  RowMethod method;
  size_t bytes;          // of a row
  int64_t count;         // elements of a row
  int64_t stride;        // between a row's elements in the strided tensor (elements)
  int64_t element_size;  // bytes
};

bool line_aligned(const void* address) {
  return reinterpret_cast<uintptr_t>(address) % kLineBytes == 0;
}

// Whether every row of the block is whole cache lines of its destination: each row's
// bytes a multiple of a line and its first byte on a line boundary (in the buffer when
// packing, in the strided tensor when unpacking).
bool rows_fill_lines(const BlockCopyPlan& plan, const BlockDescriptor& block,
                     const BlockRows& shape, const char* flat, bool to_flat) {
  const int64_t element_size = plan.element_size;
  if (shape.inner_stride != 1 || (shape.row_length * element_size) % kLineBytes != 0) return false;
  if (to_flat) return line_aligned(flat + block.flat_offset * element_size);
  const StridedLayout& layout = plan.layouts[block.tensor_index];
  for (int d = 0; d < shape.outer_ndim; ++d) {
    if ((layout.strides[d] * element_size) % kLineBytes != 0) return false;
  }
  return line_aligned(plan.bases[block.tensor_index] + shape.start_offset * element_size);
}

RowCopy row_copy(const BlockRows& shape, int64_t element_size, bool stream) {
  RowCopy copy{RowMethod::kMemcpy, static_cast<size_t>(shape.row_length * element_size),
               shape.row_length, shape.inner_stride, element_size};
  if (shape.inner_stride != 1) copy.method = RowMethod::kStrided;
  else if (stream) copy.method = RowMethod::kStreaming;
  else if (copy.bytes <= kInlineCopyBytes && copy.bytes % 16 == 0) copy.method = RowMethod::kInline;
  return copy;
}

void copy_strided_row(const RowCopy& copy, char* strided, char* flat, bool to_flat) {
  switch (copy.element_size) {
    case 1: return copy_strided_row<uint8_t>(strided, copy.stride, flat, copy.count, to_flat);
    case 2: return copy_strided_row<uint16_t>(strided, copy.stride, flat, copy.count, to_flat);
    case 4: return copy_strided_row<uint32_t>(strided, copy.stride, flat, copy.count, to_flat);
    case 8: return copy_strided_row<uint64_t>(strided, copy.stride, flat, copy.count, to_flat);
    case 16: return copy_strided_row<Bytes16>(strided, copy.stride, flat, copy.count, to_flat);
    default: {
      const int64_t step = copy.stride * copy.element_size;
      for (int64_t i = 0; i < copy.count; ++i, strided += step, flat += copy.element_size) {
        if (to_flat) std::memcpy(flat, strided, copy.element_size);
        else std::memcpy(strided, flat, copy.element_size);
      }
    }
  }
}

// Copies `rows` rows: row i starts at strided + i * strided_step (bytes) in the tensor
// and at flat + i * copy.bytes in the buffer. One loop per method and direction, each
// with its copy inlined: as a call per row, entry and exit cost about as much as
// copying a 256-byte row.
template <RowMethod kMethod, bool kToFlat>
void copy_rows_as(const RowCopy& copy, char* strided, int64_t strided_step, char* flat,
                  int64_t rows) {
  const size_t bytes = copy.bytes;
  for (int64_t i = 0; i < rows; ++i, strided += strided_step, flat += bytes) {
    char* destination = kToFlat ? flat : strided;
    const char* source = kToFlat ? strided : flat;
    if constexpr (kMethod == RowMethod::kStreaming) {
      copy_lines_streaming(destination, source, bytes);
    } else if constexpr (kMethod == RowMethod::kInline) {
      for (size_t b = 0; b < bytes; b += 16) std::memcpy(destination + b, source + b, 16);
    } else if constexpr (kMethod == RowMethod::kMemcpy) {
      std::memcpy(destination, source, bytes);
    } else {
      copy_strided_row(copy, strided, flat, kToFlat);
    }
  }
}

template <bool kToFlat>
void copy_rows_to(const RowCopy& copy, char* strided, int64_t strided_step, char* flat,
                  int64_t rows) {
  switch (copy.method) {
    case RowMethod::kStreaming:
      return copy_rows_as<RowMethod::kStreaming, kToFlat>(copy, strided, strided_step, flat, rows);
    case RowMethod::kInline:
      return copy_rows_as<RowMethod::kInline, kToFlat>(copy, strided, strided_step, flat, rows);
    case RowMethod::kMemcpy:
      return copy_rows_as<RowMethod::kMemcpy, kToFlat>(copy, strided, strided_step, flat, rows);
    case RowMethod::kStrided:
      return copy_rows_as<RowMethod::kStrided, kToFlat>(copy, strided, strided_step, flat, rows);
  }
}

SEQPAR_ALWAYS_INLINE void copy_rows(const RowCopy& copy, char* strided, int64_t strided_step,
                                    char* flat, int64_t rows, bool to_flat) {
  if (to_flat) copy_rows_to<true>(copy, strided, strided_step, flat, rows);
  else copy_rows_to<false>(copy, strided, strided_step, flat, rows);
}

// A block is copied as rows (BlockRows, shared with the CUDA kernel): each row one
// copy (RowCopy), the outer dims walked with an odometer. Measured on a 2-core Xeon,
// Ulysses' q pack (B*S, H, D): one memcpy per (token, head) row plus index division
// per row made the kernel 1.45x slower than permute().contiguous(); rows of (heads of
// one rank) x D elements and no division per row remove that.

// Walks a block's outer dims in C order and keeps the strided offset of the current
// row (relative to the block's start): row_offset's divisions to start, none per step.
struct RowOdometer {
  int outer_ndim;
  int64_t index[kMaxDims];
  int64_t extents[kMaxDims];
  int64_t strides[kMaxDims];
  int64_t offset;

  void start(const StridedLayout& layout, const BlockDescriptor& block, const BlockRows& shape,
             int64_t row) {
    outer_ndim = shape.outer_ndim;
    for (int d = 0; d < outer_ndim; ++d) {
      extents[d] = block_extent(layout, block, d);
      strides[d] = layout.strides[d];
    }
    offset = row_offset<int64_t>(layout, block, outer_ndim, row, index);
  }

  void step() {
    for (int d = outer_ndim - 1; d >= 0; --d) {
      offset += strides[d];
      if (++index[d] < extents[d]) return;
      offset -= index[d] * strides[d];
      index[d] = 0;
    }
  }

  // Rows from here to the end of the innermost outer dim: a run, whose rows lie
  // run_step() units apart in the tensor.
  int64_t run_left() const {
    return outer_ndim == 0 ? INT64_MAX : extents[outer_ndim - 1] - index[outer_ndim - 1];
  }
  int64_t run_step() const { return outer_ndim == 0 ? 0 : strides[outer_ndim - 1]; }

  // Moves `rows` rows on, at most run_left().
  void advance(int64_t rows) {
    if (outer_ndim == 0) return;
    const int d = outer_ndim - 1;
    if (index[d] + rows < extents[d]) {
      index[d] += rows;
      offset += rows * strides[d];
      return;
    }
    index[d] += rows - 1;
    offset += (rows - 1) * strides[d];
    step();
  }
};

// Row-interleaved traversal: when every block's split dim lies inside its rows (the
// blocks of a tensor then share their outer dims, e.g. Ulysses' per-destination head
// groups of one token), walk the outer index once and copy that row of every block.
// The strided side is then read (or written) in its own memory order, and the flat
// side as one sequential stream per block. Within a row the blocks go tensor by
// tensor, so each strided tensor's row is read front to back.
//
// With many blocks the flat side's streams outnumber what the prefetchers track, so
// above kMaxRowStreams blocks a visit covers several rows: each block then moves
// kVisitBytes or more of its flat stream at a time (one page), while the visit's
// strided rows stay in L2 for the next block. Measured on a 2-core Xeon, one thread,
// bf16 pack of Ulysses' q, k, v; median ms of 5 runs of the permute().contiguous()
// baseline, of the simpler alternative ("simple": row by row up to 64 blocks, block by
// block above) and of this traversal ("visits"):
//   blocks  case                        baseline  simple  visits
//   12      P=4  H=16   D=128 S=2048    6.0       4.9     4.9
//   24      P=8  H=32/8 D=128 S=2048    5.5       5.9     5.8
//   48      P=16 H=32/8 D=64  S=2048    6.7       4.7     3.5
//   96      P=32 H=32   D=128 S=1024    7.1       10.7    5.6
//   96      P=32 H=32   D=64  S=2048    7.5       13.2    5.8  (row by row: 19)
//   192     P=64 H=64/8 D=64  S=1024    10.8      8.8     6.5
// Visits of 4 rows at 12 blocks cost 6.6 ms: row by row stays below the threshold.
constexpr size_t kMaxRowStreams = 64;
constexpr int64_t kVisitBytes = 4096;
constexpr int64_t kMaxRowsPerVisit = 64;

bool rows_interleave(const BlockCopyPlan& plan, const std::vector<BlockRows>& shapes) {
  int outer_ndim[kMaxTensors];
  std::fill(outer_ndim, outer_ndim + kMaxTensors, -1);
  for (size_t b = 0; b < shapes.size(); ++b) {
    const int64_t t = plan.blocks[b].tensor_index;
    if (plan.layouts[t].split_dim < shapes[b].outer_ndim || shapes[b].rows != shapes[0].rows) {
      return false;
    }
    // The blocks of one tensor then share its outer dims (all before the split dim).
    if (outer_ndim[t] < 0) outer_ndim[t] = shapes[b].outer_ndim;
    if (outer_ndim[t] != shapes[b].outer_ndim) return false;
  }
  return true;
}

void block_copy_interleaved(const BlockCopyPlan& plan, const std::vector<BlockRows>& shapes,
                            char* flat, bool to_flat, bool stream) {
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t element_size = plan.element_size;
  const int64_t rows = shapes[0].rows;
  int64_t row_bytes_all = 0;
  int64_t shortest_row_bytes = INT64_MAX;
  for (const BlockRows& shape : shapes) {
    row_bytes_all += shape.row_length * element_size;
    shortest_row_bytes = std::min(shortest_row_bytes, shape.row_length * element_size);
  }
  const int64_t rows_per_visit =
      shapes.size() <= kMaxRowStreams
          ? 1
          : std::clamp<int64_t>(kVisitBytes / std::max<int64_t>(1, shortest_row_bytes), 1,
                                kMaxRowsPerVisit);
  const int64_t grain =
      std::max<int64_t>(rows_per_visit, kBytesPerTask / std::max<int64_t>(1, row_bytes_all));
  // Blocks in tensor order (stable: each tensor's blocks keep their order along the
  // split dim, which is their order in the strided row).
  std::vector<int64_t> visit_order(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) visit_order[b] = b;
  std::stable_sort(visit_order.begin(), visit_order.end(), [&](int64_t a, int64_t b) {
    return plan.blocks[a].tensor_index < plan.blocks[b].tensor_index;
  });
  // The first block of each tensor carries its outer dims.
  std::vector<int64_t> first_block(plan.num_tensors, -1);
  std::vector<RowCopy> copies(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    auto& first = first_block[plan.blocks[b].tensor_index];
    if (first < 0) first = b;
    const bool stream_rows =
        stream && rows_fill_lines(plan, plan.blocks[b], shapes[b], flat, to_flat);
    copies[b] = row_copy(shapes[b], element_size, stream_rows);
  }
  at::parallel_for(0, rows, grain, [&](int64_t row_begin, int64_t row_end) {
    RowOdometer odometers[kMaxTensors];
    // visit_offsets[t][i]: offset of the visit's i-th row in tensor t (the odometer's
    // reading, taken once per row and tensor rather than once per row and block).
    int64_t visit_offsets[kMaxTensors][kMaxRowsPerVisit];
    for (int64_t t = 0; t < plan.num_tensors; ++t) {
      const int64_t b = first_block[t];
      if (b >= 0) odometers[t].start(plan.layouts[t], plan.blocks[b], shapes[b], row_begin);
    }
    for (int64_t visit_begin = row_begin; visit_begin < row_end; visit_begin += rows_per_visit) {
      const int64_t visit_rows = std::min(rows_per_visit, row_end - visit_begin);
      for (int64_t t = 0; t < plan.num_tensors; ++t) {
        if (first_block[t] < 0) continue;
        for (int64_t i = 0; i < visit_rows; ++i) {
          visit_offsets[t][i] = odometers[t].offset;
          odometers[t].step();
        }
      }
      for (const int64_t b : visit_order) {
        const BlockDescriptor& block = plan.blocks[b];
        const BlockRows& shape = shapes[b];
        const RowCopy& copy = copies[b];
        char* strided = plan.bases[block.tensor_index] + shape.start_offset * element_size;
        char* packed = flat + (block.flat_offset + visit_begin * shape.row_length) * element_size;
        const int64_t* offsets = visit_offsets[block.tensor_index];
        for (int64_t i = 0; i < visit_rows; ++i, packed += copy.bytes) {
          copy_rows(copy, strided + offsets[i] * element_size, 0, packed, 1, to_flat);
        }
      }
    }
    stream_fence(stream);
  });
}

void block_copy_cpu(const BlockCopyPlan& plan, char* flat, bool to_flat) {
  const int64_t num_blocks = static_cast<int64_t>(plan.blocks.size());
  const int64_t element_size = plan.element_size;
  std::vector<BlockRows> shapes(num_blocks);
  // rows_before[b]: rows of all blocks before b, so a flat row index finds its block.
  std::vector<int64_t> rows_before(num_blocks + 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    shapes[b] = block_rows(plan.layouts[plan.blocks[b].tensor_index], plan.blocks[b]);
    rows_before[b + 1] = rows_before[b] + shapes[b].rows;
  }
  int64_t total_units = 0;
  for (const BlockDescriptor& block : plan.blocks) total_units += block.numel;
  const bool stream = total_units * element_size >= kStreamingBytes;
  if (rows_interleave(plan, shapes)) {
    return block_copy_interleaved(plan, shapes, flat, to_flat, stream);
  }
  const int64_t total_rows = rows_before[num_blocks];
  const int64_t mean_row_bytes = std::max<int64_t>(1, total_units * element_size / total_rows);
  const int64_t grain = std::max<int64_t>(1, kBytesPerTask / mean_row_bytes);
  at::parallel_for(0, total_rows, grain, [&](int64_t row_begin, int64_t row_end) {
    int64_t b = std::upper_bound(rows_before.begin(), rows_before.end(), row_begin) -
                rows_before.begin() - 1;
    int64_t row = row_begin;
    while (row < row_end) {
      const BlockDescriptor& block = plan.blocks[b];
      const BlockRows& shape = shapes[b];
      const bool stream_rows = stream && rows_fill_lines(plan, block, shape, flat, to_flat);
      const RowCopy copy = row_copy(shape, element_size, stream_rows);
      char* strided = plan.bases[block.tensor_index] + shape.start_offset * element_size;
      // The odometer starts at this task's first row of the block.
      RowOdometer odometer;
      odometer.start(plan.layouts[block.tensor_index], block, shape, row - rows_before[b]);
      const int64_t last_row = std::min(row_end, rows_before[b + 1]);
      char* packed = flat + (block.flat_offset + (row - rows_before[b]) * shape.row_length) * element_size;
      const int64_t run_step_bytes = odometer.run_step() * element_size;
      // Runs along the innermost outer dim: one loop of rows a fixed step apart, the
      // odometer's carry once per run.
      while (row < last_row) {
        const int64_t run = std::min(last_row - row, odometer.run_left());
        copy_rows(copy, strided + odometer.offset * element_size, run_step_bytes, packed, run,
                  to_flat);
        packed += run * static_cast<int64_t>(copy.bytes);
        row += run;
        odometer.advance(run);
      }
      ++b;
    }
    stream_fence(stream);
  });
}

at::Tensor pack_blocks_cpu(at::TensorList inputs, at::IntArrayRef split_dims,
                           at::IntArrayRef starts, at::IntArrayRef lengths) {
  return pack_blocks(inputs, split_dims, starts, lengths, block_copy_cpu);
}

std::vector<at::Tensor> unpack_blocks_cpu(const at::Tensor& buffer, at::IntArrayRef out_shapes,
                                          at::IntArrayRef out_dim_orders,
                                          at::IntArrayRef split_dims, at::IntArrayRef starts,
                                          at::IntArrayRef lengths) {
  return unpack_blocks(buffer, out_shapes, out_dim_orders, split_dims, starts, lengths,
                       block_copy_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(seqpar, CPU, m) {
  m.impl("pack_blocks", &pack_blocks_cpu);
  m.impl("unpack_blocks", &unpack_blocks_cpu);
}

}  // namespace seqpar
