// The ZeRO plan of a training run (Rajbhandari et al. 2020): what the data-parallel ranks shard.
// A `zero` node decides it (nodes/parallel/zero_node.cpp, schemas/zero.yaml) and owns it as its
// state `plan`, made at setup and never written; the nodes it concerns read it through a port,
// so the graph file, `flowrun dot` and `flowrun explain` show who shards what:
//
//   zero: { type: zero, with: { stage: gradients } }
//   fb:   { type: forward_backward, in: { ..., zero: zero.plan } }   # lets each gradient go to the allreduce
//   sync: { type: allreduce, in: { ready: fb.ready } }                # reduce-scatters (the items carry the slices)
//   opt:  { type: optimizer, in: { ..., zero: zero.plan } }           # keeps and updates its slice
//
// Stage params (ZeRO-3) also shards the parameters: the optimizer shards the model at its setup
// (train/fully_sharded.hpp), and the nodes that run it gather each block around its use.
//
// How the optimizer and the allreduce cut the buffers: train/optimizer_shard.hpp.
#pragma once
#include <stdexcept>
#include <string>

namespace flowrun {

struct ZeroPlan {
  enum class Stage {
    none,       // every rank keeps everything
    states,     // stage 1: the optimizer's moments and update, 1/dp each
    gradients,  // stage 2: and the averaged gradients, reduce-scattered instead of all-reduced
    params,     // stage 3: and the parameters, gathered around their use (train/fully_sharded.hpp)
  };
  Stage stage = Stage::none;
  // cut: tensors: the slices cut at parameter starts, so a rank owns whole parameters (what
  // Adafactor's factored moments need); elements: cut anywhere, 1/dp each exactly.
  bool whole_tensors = false;

  bool shards_states() const { return stage != Stage::none; }
  bool shards_gradients() const { return stage == Stage::gradients || stage == Stage::params; }
  bool shards_params() const { return stage == Stage::params; }
  static Stage parse(const std::string& s) {
    if (s == "none") return Stage::none;
    if (s == "states") return Stage::states;
    if (s == "gradients") return Stage::gradients;
    if (s == "params") return Stage::params;
    throw std::invalid_argument("ZeRO stage '" + s + "': expected none, states, gradients or params");
  }
  static const char* name(Stage s) {
    return s == Stage::none ? "none" : s == Stage::states ? "states" : s == Stage::gradients ? "gradients" : "params";
  }
};

}  // namespace flowrun
