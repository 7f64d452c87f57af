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

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "parallel/collectives.hpp"

namespace flowrun::parallel {

// The node's own channel over its tp ranks, open on this thread (collectives.hpp ThreadChannel).
class TpChannel : public ThreadChannel {
 public:
  explicit TpChannel(Group* g) : ThreadChannel(Dim::tp, g) {}
};

// A node's own group over its tp ranks, for TpChannel (call in setup: collective over the world,
// every rank in file order); null when run.parallel.tp is 1.
std::shared_ptr<Group> own_tp_group(const std::string& node, const RunInfo& run);
// The same over the node's data-parallel ranks (ZeRO-3's gathers), null when dp is 1.
std::shared_ptr<Group> own_dp_group(const std::string& node, const RunInfo& run);
// The same over the node's pipeline stages (a StageChannel's), null when pp is 1.
std::shared_ptr<Group> own_pp_group(const std::string& node, const RunInfo& run);

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
// Logits whose last dimension is this rank's vocabulary columns (a split head's), whole on every
// rank: an all-gather over the open channel (generation samples from the whole row).
torch::Tensor gather_vocab_logits(const torch::Tensor& logits, const std::shared_ptr<Group>& tp);
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           const std::shared_ptr<Group>& tp);

// How a model's whole tensor is laid out over the tp group: replicated (dim < 0), or split along
// `dim`; a tensor that fuses `runs` equal runs along dim (GPT's q|k|v projection: 3) is split
// run by run, a rank's part being its block of each run, in order (so q, k and v keep their
// heads together on each rank).
// `experts`: split over the expert-parallel ranks (run.parallel.ep, expert_parallel.hpp) instead
// of the tp ranks: a mixture of experts' expert tensors, by their dim 0 (whole over tp).
struct TpSplit {
  int64_t dim = -1;
  int64_t runs = 1;
  bool experts = false;
  bool split() const { return dim >= 0; }
};
// This rank's part of `whole` (whole itself when replicated or the group is of one).
torch::Tensor tp_part(const torch::Tensor& whole, const TpSplit& s, const Group& tp, const std::string& what);
// The whole tensor from every rank's `part` (tp_part's inverse): an all-gather, collective over
// the group (every member, in the same order). `part` itself when replicated or the group is of one.
torch::Tensor tp_whole(const torch::Tensor& part, const TpSplit& s, Group& tp, const std::string& what);

// A split model's layout, for the states that hold its tensors by name (its parameters, their
// optimizer moments, an EMA's copy): the tp group (the model node's: this rank's place among
// the tp ranks), and each parameter's split by its name.
// Checkpoints name the whole tensors by today's names, whatever the layout: each rank writes and
// reads its parts as boxes of them (parallel/placement.hpp, by `split`). wholes() gathers the
// parts (collective over `over`, the gathering node's own channel over the same tp ranks) for
// what must be whole: a checkpoint's exports (exports: true); parts() cuts whole tensors (a
// weights file, a whole state) into this rank's. A tensor is split only when it has the split's
// dimension (a moment's 0-d step counter is not). `param_of` maps a state's tensor name to its
// parameter's ("h.0.mlp.c_fc.weight.exp_avg" -> "h.0.mlp.c_fc.weight"); identity by default.
// Expert parallel's split (TpSplit::experts) is the same over `ep`, this rank's place among the ep
// ranks: a layout with only that one has no tp group. group_of says which a split is over.
struct TpLayout {
  std::shared_ptr<Group> group;
  std::function<TpSplit(const std::string& param)> split;
  std::shared_ptr<Group> ep;  // null at ep 1
  // The ranks a split is over (tp's or ep's place; null: none, the tensor whole).
  Group* group_of(const TpSplit& s) const {
    Group* g = (s.experts ? ep : group).get();
    return s.split() && g && g->size() > 1 ? g : nullptr;
  }

  // `over`: the gathering node's channel over the tp ranks (null at tp 1); `over_ep` the same over
  // the ep ranks (null at ep 1).
  using Names = std::function<std::string(const std::string&)>;
  std::map<std::string, torch::Tensor> wholes(const std::map<std::string, torch::Tensor>& parts, Group* over,
                                              const Names& param_of = nullptr, Group* over_ep = nullptr) const;
  // `source` (a file) prefixes the tensor's name in errors.
  std::map<std::string, torch::Tensor> parts(const std::map<std::string, torch::Tensor>& wholes,
                                             const Names& param_of = nullptr, const std::string& source = "") const;
  // The same for a state whose tensors are split otherwise than their parameters (an optimizer's
  // factored statistics): `split_of` gives each tensor's own split by its name.
  using SplitOf = std::function<TpSplit(const std::string& name)>;
  std::map<std::string, torch::Tensor> wholes_by(const std::map<std::string, torch::Tensor>& parts, Group* over,
                                                 const SplitOf& split_of, Group* over_ep = nullptr) const;
  std::map<std::string, torch::Tensor> parts_by(const std::map<std::string, torch::Tensor>& wholes,
                                                const SplitOf& split_of, const std::string& source = "") const;
};

}  // namespace flowrun::parallel
