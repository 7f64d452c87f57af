// ModelState: the object behind a model node's `params` state port (port type `params`),
// held in a Value as std::shared_ptr<ModelState>.
//
// It is a libtorch module plus how to run it on a batch. Model nodes (mlp; later gpt, dit,
// ...) create one in setup() and own it; forward_backward reads it, optimizer writes it, ema
// keeps a deep copy. A model either passes a ForwardFn or derives from ModelState and
// overrides forward() (and clone(), if its module is not torch::nn::Cloneable).
//
// Trainable parameters are the module's parameters with requires_grad() set, in module
// registration order (torch's named_parameters order). Gradients (common/grads.hpp) and
// optimizer moments are aligned with that order. LoRA-style models freeze the base weights
// (requires_grad(false)) and leave only the adapters trainable.
//
// Its parts, each in a file of its own: how its tensors lie over the ranks of a parallel run
// (models/model_layout.hpp: tensor-parallel parts, pipeline stages, ZeRO-3 shards, what an
// export gathers) and what its training holds in memory (models/model_memory.hpp); here,
// the module, its forward, and what the model can do beyond forward (export its adapters,
// condition a batch, encode/decode images, caption).
//
// `flat`: the trainable parameters' data may live in flat buffers (common/flat_buffers.hpp).
// The optimizer makes them so on its first update; readers that combine whole models (ema)
// use the buffers while flat.buffers_of(trainable_parameters()) still finds them there.
//
// Concurrency: the executor orders accesses (a write waits for earlier reads and writes; a
// read waits for the last earlier write), so a node touches parameter data only inside run()
// and only as its port's access allows: readers (forward_backward, ema) never write
// parameter data; forward_backward writes only the parameters' .grad().
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/flat_buffers.hpp"
#include "common/tensor_map.hpp"
#include "models/model_layout.hpp"
#include "models/model_memory.hpp"

namespace flowrun {

struct KvCache;  // models/generate.hpp

struct ModelState : ModelLayout, ModelMemory {
  using ForwardFn = std::function<torch::Tensor(torch::nn::Module&, const TensorMap&)>;
  using Named = std::vector<std::pair<std::string, torch::Tensor>>;

  std::shared_ptr<torch::nn::Module> module;
  ForwardFn forward_fn;
  std::string kind;  // model type ("mlp"), for messages
  FlatParams flat;   // empty in a copy (clone()): the copy's tensors are its own

  // Files the model offers for tools outside flowrun, written into a checkpoint folder beside
  // its tensors when the checkpoint node has `exports: true` (a LoRA model: its adapters in
  // PEFT's layout, lora::peft_export). The checkpoint calls `exporter` when it snapshots the
  // state, under its read access; the writer it returns holds copies of what it needs and runs
  // later on the checkpoint's writer thread, given the folder to write into. Unset, or an
  // empty writer: nothing to export. Copies (clone(), the EMA) keep it.
  using ExportWriter = std::function<void(const std::string& dir)>;
  std::function<ExportWriter(const ModelState&)> exporter;

  // A frozen encoder of batches (vae_encode's params) says how it conditions one, so a reader of
  // its state (the evaluator) encodes batches as the node does without knowing its type: the
  // entries it adds to `batch`, deterministic (the posterior mean, never a sample), given the
  // state itself (`self`: copies keep a working hook). Unset: the model conditions nothing.
  std::function<TensorMap(ModelState& self, const TensorMap& batch)> condition;

  // What a model can do beyond forward, said by the model's own code (models/), so that nodes
  // reading its state (objectives, evaluators) need not know its type. `self`: the state itself
  // (a clone, the EMA's, keeps working hooks). Unset: the model cannot.
  // An autoencoder (vae/ states): images -> (mean, logvar) on the model's device and dtype, and
  // latents -> images; either is unset for a VAE of one part.
  struct Autoencoder {
    int64_t in_channels = 0, downsample = 1;  // images [B, in_channels, H, W], H and W multiples of downsample
    int64_t latent_channels = 0;
    double scaling_factor = 1.0;              // latents for a diffusion model: (mean or sample) x this
    std::function<std::pair<torch::Tensor, torch::Tensor>(ModelState& self, const torch::Tensor& x)> encode;
    std::function<torch::Tensor(ModelState& self, const torch::Tensor& z)> decode;
  };
  std::shared_ptr<const Autoencoder> autoencoder;
  // A captioner (CapPa): images -> image tokens once, then decoded greedily from `start` (int64
  // [B]) for `steps` tokens stopping at `eos`, or in one parallel pass; both -> [B, steps].
  struct Captioner {
    std::function<torch::Tensor(ModelState& self, const torch::Tensor& images)> encode;
    std::function<torch::Tensor(ModelState& self, const torch::Tensor& encoded, const torch::Tensor& start, int64_t steps,
                                int64_t eos)>
        greedy;
    std::function<torch::Tensor(ModelState& self, const torch::Tensor& encoded, int64_t steps)> parallel;
  };
  std::shared_ptr<const Captioner> captioner;
  // A causal language model's decoding with a KV cache (models/generate.hpp, which samples with
  // it): ids [B, t] at positions [B, t], `mask` [B, 1, t, L] additive over the L - t keys the
  // cache holds and these t (0: attend, -inf: not), the cache grown by the t -> logits [B, t, V].
  struct CausalLm {
    std::function<torch::Tensor(ModelState& self, const torch::Tensor& ids, const torch::Tensor& positions,
                                const torch::Tensor& mask, KvCache& cache)>
        decode;
    int64_t context = 0;  // positions it was built for
  };
  std::shared_ptr<const CausalLm> causal_lm;

  // A term the model adds to any objective's loss, from its last forward with grad (a mixture of
  // experts' router load-balancing loss, weighted; models/moe.hpp), given the module (copies keep
  // a working hook); an undefined tensor when there is none. Unset: none.
  std::function<torch::Tensor(torch::nn::Module&)> extra_loss;
  // A mixture of experts: the named figures of how its routers spread the tokens over the
  // forwards with grad since the last call (models/moe.hpp load_metrics; forward_backward's
  // `experts` output), and they start again. Unset: the model routes nothing.
  std::function<std::vector<std::pair<std::string, double>>(torch::nn::Module&)> take_routing_metrics;

  ModelState() = default;
  ModelState(std::shared_ptr<torch::nn::Module> m, ForwardFn f, std::string k)
      : module(std::move(m)), forward_fn(std::move(f)), kind(std::move(k)) {}
  ModelState(const ModelState&) = default;
  ModelState& operator=(const ModelState&) = default;
  virtual ~ModelState() = default;

  // The model's output for a batch (autograd follows if grad mode is on).
  virtual torch::Tensor forward(const TensorMap& batch) {
    if (!module || !forward_fn) throw std::runtime_error("model state '" + kind + "' has no module or forward");
    return forward_fn(*module, batch);
  }

  // A deep copy: new parameter and buffer tensors (same values, device and requires_grad),
  // same forward. Default: torch::nn::Cloneable's clone(); a model whose module is not
  // Cloneable overrides this.
  virtual std::shared_ptr<ModelState> clone() const {
    if (!module) throw std::runtime_error("model state '" + kind + "' has no module to clone");
    torch::NoGradGuard no_grad;
    auto copy = std::make_shared<ModelState>(*this);
    copy->module = shards ? shards->fresh_module() : module->clone();
    copy->kept.clear();  // what other nodes keep for this model, not for the copy
    if (shards) copy->shards = shards->copy_for(*copy);  // ZeRO-3: its own slices
    // clone() copies values; keep each parameter's trainable flag as in the source.
    auto src = module->named_parameters(true);
    auto dst = copy->module->named_parameters(true);
    for (const auto& item : src) {
      torch::Tensor* d = dst.find(item.key());
      if (!d) throw std::runtime_error("model state '" + kind + "': clone lacks parameter '" + item.key() + "'");
      d->set_requires_grad(item.value().requires_grad());
    }
    return copy;
  }

  // Parameters by name (module order); trainable_only: those with requires_grad().
  Named named_parameters(bool trainable_only = false) const {
    Named out;
    if (!module) return out;
    for (const auto& item : module->named_parameters(true))
      if (!trainable_only || item.value().requires_grad()) out.emplace_back(item.key(), item.value());
    return out;
  }
  // The trainable parameters, in the order gradients travel (common/grads.hpp).
  std::vector<torch::Tensor> trainable_parameters() const {
    std::vector<torch::Tensor> out;
    if (!module) return out;
    for (const auto& p : module->parameters(true))
      if (p.requires_grad()) out.push_back(p);
    return out;
  }
  Named named_buffers() const {
    Named out;
    if (!module) return out;
    for (const auto& item : module->named_buffers(true)) out.emplace_back(item.key(), item.value());
    return out;
  }

  // Every parameter and buffer by name (a state dict; aliases, not copies): for checkpoints.
  std::map<std::string, torch::Tensor> tensors() const {
    std::map<std::string, torch::Tensor> out;
    for (auto& [k, v] : named_parameters()) out[k] = v;
    for (auto& [k, v] : named_buffers()) out[k] = v;
    return out;
  }
  // Copy values in by name (shapes must match). strict: every tensor of the model must be
  // given and no unknown names; otherwise missing ones keep their values.
  // Every tensor checked before any is copied: a refused load leaves the model as it was.
  // NaN or infinite values are refused (a run resumed from them fails at its first step,
  // blaming the learning rate).
  void load(const std::map<std::string, torch::Tensor>& in, bool strict = true) {
    torch::NoGradGuard no_grad;
    auto mine = tensors();
    for (const auto& [k, v] : in) {
      auto it = mine.find(k);
      if (it == mine.end()) {
        if (strict) throw std::runtime_error("model '" + kind + "': unknown tensor '" + k + "'");
        continue;
      }
      if (!it->second.sizes().equals(v.sizes()))
        throw std::runtime_error("model '" + kind + "': tensor '" + k + "' has shape " + shape_str(it->second) +
                                 ", the one given has " + shape_str(v));
      if (!all_finite(v))
        throw std::runtime_error("model '" + kind + "': tensor '" + k + "' holds NaN or infinite values");
    }
    if (strict)
      for (const auto& [k, _] : mine)
        if (!in.count(k)) throw std::runtime_error("model '" + kind + "': tensor '" + k + "' is missing");
    for (const auto& [k, v] : in)
      if (auto it = mine.find(k); it != mine.end()) it->second.copy_(v);
  }
};

// Frozen models (text encoders, a VAE): no parameter trains (requires_grad false) and eval
// mode (no dropout).
inline void freeze(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.set_requires_grad(false);
  m.eval();
}

// A deep copy of a frozen model's state of type S (a ModelState subclass with fields of its
// own): every field copied, the module cloned and frozen. What such an S's clone() returns.
template <class S>
std::shared_ptr<ModelState> clone_frozen(const S& s) {
  if (!s.module) throw std::runtime_error("model state '" + s.kind + "' has no module to clone");
  torch::NoGradGuard no_grad;
  auto copy = std::make_shared<S>(s);
  copy->module = s.module->clone();
  freeze(*copy->module);
  return copy;
}

}  // namespace flowrun
