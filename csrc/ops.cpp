// The one list of seqpar op schemas, and the Python module that loads them.
//
// Kernels live beside their device: csrc/cpu/*.cpp and csrc/cuda/*.cu register
// implementations with TORCH_LIBRARY_IMPL. Fake kernels and autograd are in
// seqpar_kernels/ops/.
#include <pybind11/pybind11.h>
#include <torch/library.h>

TORCH_LIBRARY(seqpar, m) {
  // Reads tensor t's range [starts[r*T+t], +lengths[r*T+t]) along split_dims[t] for each
  // rank r and writes them to one flat buffer, rank-major then tensor, each block in C order.
  m.def(
      "pack_blocks(Tensor[] inputs, int[] split_dims, int[] starts, int[] lengths) -> Tensor");
  // The inverse: allocates outputs of the given shapes whose memory order lists dims
  // outermost first (out_dim_orders), and writes each block into its range. Ranges of
  // one output that overlap are summed; parts that no range covers are zero.
  m.def(
      "unpack_blocks(Tensor buffer, int[] out_shapes, int[] out_dim_orders, int[] split_dims, "
      "int[] starts, int[] lengths) -> Tensor[]");
  // Ring attention's merge: folds a block's attention (block_out, block_lse) into the
  // running fp32 (out, lse), in place. out, block_out: (B, S, H, D); lse, block_lse:
  // fp32 (B, H, S); any strides; block_out fp32, fp16 or bf16. Rows whose block_lse is
  // -inf are left untouched. Python side: seqpar_kernels/ops/ring_attention.py.
  m.def("attention_merge_(Tensor(a!) out, Tensor(b!) lse, Tensor block_out, Tensor block_lse) -> ()");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef SEQPAR_WITH_CUDA
  info["cuda"] = true;
  info["cuda_archs"] = SEQPAR_CUDA_ARCHS_STRING;
  info["cuda_toolkit"] = SEQPAR_CUDA_TOOLKIT_VERSION;
#else
  info["cuda"] = false;
  info["cuda_archs"] = "";
  info["cuda_toolkit"] = "";
#endif
  info["torch"] = SEQPAR_TORCH_VERSION;
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, module) {
  module.doc() = "seqpar-kernels compiled ops (registered under torch.ops.seqpar)";
  module.def("build_info", &build_info,
             "What this build compiled: cuda (bool), cuda_archs, cuda_toolkit, torch");
}
