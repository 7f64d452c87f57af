// Where a rank's tensors lie in the whole ones, as pieces (TensorPiece, below): what a
// per-rank checkpoint writes of each state, and reads back into it at any other layout.
//
//   tensor parallel   a rank's part of a split tensor (TpSplit: along `dim`, in `runs` runs, GPT's
//                     q|k|v fused) is one box of the whole per run: rank r of R holds, of run k,
//                     [k n/runs + r b, k n/runs + (r + 1) b) along dim, b = n / (runs R);
//   ZeRO              a rank's slice of a flat buffer holds a range of a parameter's row-major
//                     elements (train/optimizer_shard.hpp); a range of a box is at most 2 d - 1
//                     boxes, each contiguous in the range (a partial first row, whole rows, a
//                     partial last row, recursively), so its pieces are views of the slice.
//
// Both together: a ZeRO range of a tp part is cut into the part's boxes first, then each at the
// part's runs.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "parallel/tensor_parallel.hpp"

namespace flowrun {

// A part of a whole tensor that a rank holds: `data` is the box [offsets, offsets + data.sizes())
// of the tensor `name`, whose whole shape is `whole` (what a per-rank checkpoint writes and reads:
// formats/checkpoint_io.hpp). Listed for a save or a load, `data` is a view of the live tensor.
struct TensorPiece {
  std::string name;
  std::vector<int64_t> whole, offsets;
  torch::Tensor data;
};

}  // namespace flowrun

namespace flowrun::parallel {

// How this rank's tensor lies in the whole: its split (none: whole) and its place among the tp
// ranks. A split the tensor lacks the dimension of (a moment's 0-d step) is none.
struct Placement {
  TpSplit split;
  int rank = 0, ranks = 1;
  static Placement whole() { return {}; }
};

// The pieces of `local` (this rank's tensor, whole or its tp part), views of it.
void add_pieces(std::vector<TensorPiece>& out, const std::string& name, const torch::Tensor& local, const Placement& p);
// The pieces of the elements [offset, offset + data.numel()) of the row-major flattening of this
// rank's tensor of shape `local` (whole or its tp part), held as the 1-D `data`: views of data.
void add_range_pieces(std::vector<TensorPiece>& out, const std::string& name, const torch::Tensor& data,
                      const std::vector<int64_t>& local, int64_t offset, const Placement& p);

}  // namespace flowrun::parallel
