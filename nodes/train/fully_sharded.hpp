// ZeRO stage 3 (the zero node's `stage: params`; Rajbhandari et al. 2020, PyTorch's FSDP): the
// model's parameters sharded over the data-parallel ranks the way stages 1 and 2 shard
// the optimizer's moments and the gradients (optimizer_shard.hpp: the flat layout of the
// trainable parameters in module order, rank q keeping its elements [cuts[q], cuts[q + 1])).
//
// Between uses every trainable parameter holds no data (its shape over one element of storage,
// every stride 0: the module, the names, the shapes and autograd's identity of each parameter
// unchanged, writes refused, reads seeing one number); this rank keeps its
// slice of the flat buffer, which the optimizer updates in place (slice_pieces) and an EMA
// averages slice by slice. Units: each block (an item of one of the model's outermost
// ModuleLists: what run_block runs) and each run of the other parameters in module order
// (embeddings before the blocks; final norms and a head after). A unit is gathered by one
// all-gather of the ranks' pieces of its range of the flat buffer (uneven blocks: most ranks hold
// none of a small unit) into a buffer of its own, its parameters pointed into it; let go, the
// buffer is freed.
//
// A use (ParamUse, models/param_use.hpp; one at a time, by the node that owns the use: a reader
// runs a copy, ModelState::clone) gathers the other parameters when it opens and each block when
// run_block reaches it, issuing the next block's all-gather then (the one before, for the
// recomputes in backward), so that it runs during this block's compute; a block is let go after
// its forward when it was recomputed or ran without grad (gathered again for its recompute in
// backward), else once backward has made every one of its gradients (grad_done); everything when
// the use closes. So forward_backward without activation checkpointing holds the whole model at
// the turn from forward to backward (the blocks are kept: autograd saved them), and with
// `checkpoint: blocks` the other parameters and two or three blocks (the one running, the one
// arriving, one whose gradients are being made); an evaluator two blocks at a time.
//
// Frozen parameters (a LoRA's base) are sharded the same way into a flat buffer of their own
// (part 1; the trainable ones, part 0, are what the optimizer and the EMA see); a unit's
// all-gathers fetch both parts of its range. A block with frozen weights is let go once its
// backward is done, not at its last gradient (a frozen weight makes only the input's gradient,
// in a node autograd may run after the adapters'): a recomputed block when its recompute's
// backward returns (backward_done), a kept one when the use closes.
//
// One data-parallel rank: the slice is the whole buffer, and the parameters point into it for
// good (nothing gathered, nothing freed).
#pragma once
#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/model_state.hpp"
#include "models/param_use.hpp"
#include "train/optimizer_shard.hpp"

namespace flowrun {

class ShardedParams : public ModelState::Shards {
 public:
  // Shards `model`'s trainable parameters (whole on every rank now) as `plan` cuts them (made for
  // them, one flat buffer: one dtype and device; refused otherwise, naming them), and its frozen
  // ones (a LoRA's base) alike over the same ranks: this rank keeps its slices, the parameters
  // let go of their data.
  static std::shared_ptr<ShardedParams> make(ModelState& model, const ShardPlan& plan);

  const ShardPlan& plan() const { return parts_[0].plan; }
  // Stage 2's plan for the same cut (forward_backward hands each gradient to the allreduce with it).
  const std::shared_ptr<const GradShard>& grad_shard() const { return grad_shard_; }
  // The trainable parameters by name as placeholders with their shapes, dtype and device (one
  // element of storage seen at every index: what each holds between uses), for code that needs
  // what a parameter is. Made once (bind).
  const ModelState::Named& shapes() const { return placeholders_; }
  // The bytes of the whole parameters, and of the largest unit (what a gathered block adds).
  double bytes() const;
  double largest_unit_bytes() const;
  int units() const { return static_cast<int>(units_.size()); }

  std::unique_ptr<ParamUse> open(parallel::Group* group, const std::string& what) override;
  std::map<std::string, torch::Tensor> wholes(parallel::Group& group) override;
  std::map<std::string, torch::Tensor> load(const std::map<std::string, torch::Tensor>& whole) override;
  std::vector<Range> ranges() override;
  std::shared_ptr<Shards> copy_for(ModelState& copy) const override;
  std::shared_ptr<torch::nn::Module> fresh_module() const override;
  std::vector<torch::Tensor>& slices() override { return parts_[0].slices; }

 private:
  friend class ShardedUse;
  // The trainable parameters (part 0: the optimizer's plan and slice) and the frozen ones (part
  // 1: a LoRA's base; none in a model trained whole), each cut over the ranks the same way.
  struct Part {
    ShardPlan plan;
    std::vector<torch::Tensor> slices;        // this rank's slice of its flat buffer (one; none without parameters)
    std::vector<torch::Tensor> params;        // the module's parameters of this part (module order)
    std::vector<torch::Tensor> placeholders;  // per parameter: what it holds between uses
  };
  // A unit's range of one part's flat buffer, and its state.
  struct Span {
    int64_t lo = 0, hi = 0;   // its range of the part's flat buffer
    std::vector<int> params;  // its parameters of that part
    torch::Tensor gathered;   // the whole range, while gathered (its parameters point into it)
    torch::Tensor arriving;   // the whole range, while its all-gather (started ahead) runs
    parallel::Work pending_gather;
  };
  struct Unit {
    Span spans[2];            // per part
    bool block = false;       // a block's (let go after its forward or backward), else kept for the use
    int pending = 0;          // its trainable parameters' gradients not yet final in the current backward
    bool gathered() const { return spans[0].gathered.defined() || spans[1].gathered.defined(); }
    bool frozen() const { return !spans[1].params.empty(); }
  };
  ShardedParams() = default;
  void bind(ModelState& model);  // parts' params, units, placeholders from the model's module
  void let_go();                 // every parameter its placeholder (one rank: a view of the slice, for good)
  void start(int unit, parallel::Group* group, const std::string& what);   // its all-gathers issued
  void gather(int unit, parallel::Group* group, const std::string& what);  // started if not, waited for, pointed into
  void release(int unit);
  int world() const { return parts_[0].plan.world; }

  Part parts_[2];
  std::shared_ptr<const GradShard> grad_shard_;
  std::shared_ptr<torch::nn::Module> template_;  // the module with every parameter let go: copies start from it
  ModelState::Named placeholders_;           // the trainable parameters by name, their placeholders (shapes())
  std::vector<Unit> units_;
  std::vector<int> unit_of_param_;           // per trainable parameter
  std::map<const torch::nn::Module*, int> unit_of_block_;
  std::atomic<bool> in_use_{false};  // a use is open (one at a time)
};

// What a sharded step holds gathered beside its slice under `policy` (parallel::cost::zero3_gathered:
// the parameters outside the blocks, the blocks not recomputed, two in flight), in bytes of the
// module's parameters (placeholders count at their whole shapes): the cost model's rule.
double zero3_gathered_bytes(const torch::nn::Module& module, const CheckpointPolicy& policy);

// What a node that reads a model without training it (an evaluator, a sampler) runs: a sharded
// model's copy (ModelState::clone: its own parameters to gather, so that it never touches the
// ones forward_backward may be gathering at the same time) with a use open on it over the node's
// channel to the data-parallel ranks (`group`, made in its setup; null with one rank); any other
// model as it is.
//
//   ShardedReader reader(model, dp_group_.get(), ctx.who() + " of step 7");
//   const int64_t n = reader.agreed(batches);    // every rank runs as many forwards
//   evaluate(reader.model(), ...);
class ShardedReader {
 public:
  ShardedReader(ModelState& model, parallel::Group* group, const std::string& what);
  ModelState& model() { return copy_ ? *copy_ : model_; }
  bool sharded() const { return copy_ != nullptr; }
  // `n` forwards on this rank: when sharded the smallest over the ranks (each forward gathers
  // over all of them), else `n`. Collective when sharded.
  int64_t agreed(int64_t n);

 private:
  ModelState& model_;
  parallel::Group* group_;
  std::shared_ptr<ModelState> copy_;  // before use_: the use holds its parameters
  std::unique_ptr<ParamUse> use_;
};

}  // namespace flowrun
