// Tensor parallel's building blocks (Megatron-LM, Shoeybi et al. 2019, section 3), over a group
// of the mesh (the tp group, parallel/mesh.hpp): the two conjugate operators that make a pair of
// linear layers, split column-then-row, cost one all-reduce forward and one backward.
//
//   x ─ copy_to_tp(x) ─ column-split linear (W1's rows: this rank's out/tp) ─ gelu ─
//       row-split linear (W2's columns: in/tp) ─ reduce_from_tp(·) ─ + b2 ─ y
//
//   copy_to_tp(x):     forward: x as it is (every rank holds it);  backward: the gradient summed
//                      over the group (each rank's branch contributed a part)   (Megatron's f)
//   reduce_from_tp(y): forward: y summed over the group;  backward: the gradient as it is  (g)
//
// With a group of one both are the identity. The collectives go through parallel/collectives.hpp
// (MPI for CPU tensors, NCCL for CUDA ones); the tp ranks of a replica read the same batch, so
// what enters copy_to_tp is the same on each.
#pragma once
#include <torch/torch.h>

#include <memory>

#include "parallel/collectives.hpp"

namespace flowrun::parallel {

torch::Tensor copy_to_tp(const torch::Tensor& x, const std::shared_ptr<Group>& tp);
torch::Tensor reduce_from_tp(const torch::Tensor& y, const std::shared_ptr<Group>& tp);

// This rank's block of `whole` along `dim` when it is cut into group-size equal blocks (the
// column-split linear's rows of W and b: dim 0; the row-split one's columns of W: dim 1). The
// size along dim must divide; else an error naming `what`, the size and the group's.
torch::Tensor tp_block(const torch::Tensor& whole, int64_t dim, const Group& tp, const std::string& what);

// Over the vocabulary (Megatron-LM's VocabParallelEmbedding and vocab-parallel cross-entropy):
// each rank holds rows [first, first + V/tp) of the token table.
//   vocab_parallel_embedding(ids, table): the rows of the ids this rank holds, zeros for the
//     others, summed over the group: every rank gets the whole embedding.
//   vocab_parallel_cross_entropy(logits, targets, first): the mean over rows of the
//     cross-entropy of logits [N, V/tp] (this rank's columns of the whole [N, V]) against
//     targets [N] (ids into the whole vocabulary), in fp32: the max, the sum of exponentials and
//     the target's logit each one all-reduce of N numbers, never the whole logits; backward
//     writes this rank's columns of softmax - one-hot.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& table,
                                       const std::shared_ptr<Group>& tp);
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const std::shared_ptr<Group>& tp);

// How a model's whole tensor is laid out over the tp group: replicated (dim < 0), or split along
// `dim`; a tensor that fuses `runs` equal runs along dim (GPT's q|k|v projection: 3) is split
// run by run, a rank's part being its block of each run, in order (so q, k and v keep their
// heads together on each rank).
struct TpSplit {
  int64_t dim = -1;
  int64_t runs = 1;
  bool split() const { return dim >= 0; }
};
// This rank's part of `whole` (whole itself when replicated or the group is of one).
torch::Tensor tp_part(const torch::Tensor& whole, const TpSplit& s, const Group& tp, const std::string& what);

}  // namespace flowrun::parallel
