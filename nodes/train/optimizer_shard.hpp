// ZeRO (Rajbhandari et al. 2020) over the data-parallel ranks, as a zero node's plan says
// (parallel/zero_plan.hpp; the optimizer and forward_backward read it):
//   - stage 1, `stage: states`: the optimizer's state sharded. Each rank updates only its slice
//     of each of the model's flat parameter buffers (common/flat_buffers.hpp: one per dtype and
//     device, the parameters in module order) and keeps optimizer moments for those elements
//     only; then the ranks' updated slices are all-gathered, so every rank holds the whole model
//     again for the next forward. The gradients are all-reduced whole (the allreduce node), so
//     the global norm for clipping is the same on every rank.
//   - stage 2, `stage: gradients`: the gradients sharded too. forward_backward hands each
//     finished gradient to the allreduce alone (no gradient buffer) and drops its own reference;
//     the allreduce packs a bucket's gradients by owner and reduce-scatters it (averaged, as the
//     all-reduce averages), so each rank keeps only the averaged gradients of its own slice, and
//     the rest is freed bucket by bucket while backward still runs. The optimizer takes the
//     global norm as the sum of the ranks' squared norms (one more all-reduce of a number).
// Two ways to cut a buffer:
//   - element-wise (AdamW, SGD): rank r the elements [r L, (r + 1) L), L = ceil(numel / world). A
//     slice cuts through parameters: the update sees each parameter's piece as a 1-D parameter of
//     its own, which decays as its whole parameter does;
//   - by whole tensors (Adafactor, whose factored moments need whole rows and columns): each cut
//     moved up to the next parameter's start, so a rank owns whole parameters, about 1/world of
//     the elements (a parameter larger than L makes its rank's share larger).
// Every element gets the update the unsharded optimizer gives it, so the results are the same bit
// for bit on the CPU (stage 2 with clipping: within rounding, the norm being summed in another
// order).
//
// Checkpoints do not depend on the world size: each rank writes its slices of the moments as
// pieces of the whole tensors, by the parameters' names as an unsharded optimizer's
// (StateIO::pieces in optimizer.cpp; parallel/placement.hpp), nothing gathered. A resume, at this
// world size or another, reads this rank's tensors whole (its tp parts of its stage's) and slices
// them at its first update, holding its replica's moments whole until then.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/flat_buffers.hpp"
#include "parallel/collectives.hpp"

namespace flowrun {

struct ShardPlan {
  int rank = 0, world = 1;  // world 1: not sharded
  struct Group {
    int64_t numel = 0;           // the whole buffer
    std::vector<int64_t> cuts;   // rank q's elements: [cuts[q], cuts[q + 1]); world + 1 of them
    int64_t begin = 0, end = 0;  // this rank's elements
    std::vector<size_t> counts() const;  // rank q's element count, for the all-gather
  };
  std::vector<Group> groups;  // per flat buffer
  // This rank's pieces of the parameters: parameter `param`'s elements [offset, offset + numel),
  // at [at, at + numel) of this rank's slice of buffer `group` (so at = the parameter's offset in
  // the buffer + offset - begin).
  struct Piece {
    int param = -1, group = 0;
    int64_t offset = 0, numel = 0, at = 0;
  };
  std::vector<Piece> pieces;
  FlatLayout layout;                        // of the whole parameters
  std::vector<std::string> names;            // of each parameter (module order)
  std::vector<std::vector<int64_t>> shapes;  // of each parameter

  // For the model's trainable parameters (named, module order), laid out in `layout`; cut
  // element-wise, or by whole tensors (`whole_tensors`).
  static ShardPlan make(const FlatLayout& layout, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                        int rank, int world, bool whole_tensors = false);
  bool whole_tensors = false;
  bool sharded() const { return world > 1; }
};

// This rank's pieces of `params` (named, as the model lists its trainable parameters) and of
// their `grads`: what the optimizer updates. A piece that is a whole parameter is that parameter
// (its shape); a part of one, a 1-D view. A piece of an undefined grad is undefined. A grad may be
// the whole parameter's or already this rank's piece (stage 2: what the allreduce kept).
struct ShardPieces {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<torch::Tensor> grads;
};
ShardPieces shard_pieces(const ShardPlan& plan, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         const std::vector<torch::Tensor>& grads);

// The same for a model whose parameters are sharded (ZeRO-3, fully_sharded.hpp): the pieces are
// views of this rank's slices (`slices`, per buffer) instead of the parameters, named and shaped
// as the plan says; `grads` this rank's pieces already (stage 2's).
ShardPieces slice_pieces(const ShardPlan& plan, const std::vector<torch::Tensor>& slices,
                         const std::vector<torch::Tensor>& grads);

// Every rank's slice of each buffer into every rank's buffers: an all-gather per buffer, in place,
// over `group` (MPI for CPU buffers, NCCL for CUDA ones). Collective: every rank calls it. Returns
// the collectives, to wait for.
std::vector<parallel::Work> allgather_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& buffers,
                                             parallel::Group& group, const std::string& what);

// Stage 2: what forward_backward attaches to every gradient it hands to the allreduce
// (GradReady::shard): the optimizer's plan and the layout the allreduce makes its buckets by
// (the gradient buffers' one, reverse module order: backward's).
struct GradShard {
  ShardPlan plan;
  FlatLayout buckets;
  static std::shared_ptr<const GradShard> make(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                               int rank, int world, bool whole_tensors);
};

// Stage 2, one bucket (positions [first, end) of shard.buckets): the parameters' gradients
// (`grads`, per parameter; undefined: zeros) into a send buffer of the bucket's size, by owner:
// rank q's block holds, parameter after parameter in bucket order, the elements rank q updates,
// divided by `divide_by` on the way. counts[q]: the size of rank q's block.
torch::Tensor pack_by_owner(const GradShard& shard, int first, int end, const std::vector<torch::Tensor>& grads,
                            std::vector<size_t>& counts, double divide_by = 1);
// This rank's block of a bucket (reduced) into `slices`: per flat buffer, this rank's slice of
// it (plan.groups[g].end - begin elements, at the plan's offsets).
void unpack_mine(const GradShard& shard, int first, int end, const torch::Tensor& mine,
                 const std::vector<torch::Tensor>& slices);
// Per parameter, this rank's piece of its gradient in `slices` (shaped like the parameter when
// it is a whole one, else 1-D); undefined where this rank owns none of it.
std::vector<torch::Tensor> pieces_of_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& slices);

}  // namespace flowrun
