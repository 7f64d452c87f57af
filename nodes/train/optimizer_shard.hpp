// ZeRO stage 1 (Rajbhandari et al. 2020): the optimizer's state sharded over the data-parallel
// ranks (the optimizer's `shard: states`).
//
// Each rank updates only its slice of each of the model's flat parameter buffers
// (common/flat_buffers.hpp: one per dtype and device, the parameters in module order) and keeps
// optimizer moments for those elements only; then the ranks' updated slices are all-gathered, so
// every rank holds the whole model again for the next forward. The gradients are all-reduced
// whole, as without sharding (the allreduce node), so the global norm for clipping is the same on
// every rank. Two ways to cut a buffer:
//   - element-wise (AdamW, SGD): rank r the elements [r L, (r + 1) L), L = ceil(numel / world). A
//     slice cuts through parameters: the update sees each parameter's piece as a 1-D parameter of
//     its own, which decays as its whole parameter does;
//   - by whole tensors (Adafactor, whose factored moments need whole rows and columns): each cut
//     moved up to the next parameter's start, so a rank owns whole parameters, about 1/world of
//     the elements (a parameter larger than L makes its rank's share larger).
// Every element gets the update the unsharded optimizer gives it, so the results are the same bit
// for bit on the CPU.
//
// Checkpoints do not depend on the world size: before the checkpoint node snapshots the state,
// every rank takes part in gathering the moments (collect_sharded_state, its StateIO::collect),
// and rank 0 writes whole tensors by the parameters' names, as an unsharded optimizer does. A
// resume, at this world size or another, slices them again.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/flat_buffers.hpp"

namespace flowrun {

namespace comm {
class Channel;
}

struct ShardPlan {
  int rank = 0, world = 1;  // world 1: not sharded
  struct Group {
    int64_t numel = 0;           // the whole buffer
    std::vector<int64_t> cuts;   // rank q's elements: [cuts[q], cuts[q + 1]); world + 1 of them
    int64_t slice = 0;           // the largest rank's share (the all-gather's block)
    int64_t begin = 0, end = 0;  // this rank's elements
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
// (its shape); a part of one, a 1-D view. A piece of an undefined grad is undefined.
struct ShardPieces {
  std::vector<std::pair<std::string, torch::Tensor>> params;
  std::vector<torch::Tensor> grads;
};
ShardPieces shard_pieces(const ShardPlan& plan, const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         const std::vector<torch::Tensor>& grads);

// Every rank's slice of each buffer into every rank's buffers (an all-gather per buffer, over
// `channel`, through a staging buffer of world x the largest slice). Collective: every rank calls it.
void allgather_slices(const ShardPlan& plan, const std::vector<torch::Tensor>& buffers, comm::Channel& channel,
                      const std::string& what);

}  // namespace flowrun
