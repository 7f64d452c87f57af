// Objectives: what forward_backward minimises and what an evaluator scores, as components.
//
// An objective is a small node type (mse_loss, lm_loss, diffusion_loss, or one from a plugin)
// that owns its settings once and offers them as a state port `objective` (port type
// `objective`), which forward_backward, evaluator and sampler read:
//
//   loss: { type: diffusion_loss, with: { prediction: v, cond_drop: 0.1 } }
//   fb:   { type: forward_backward, in: { batch: data.batch, objective: loss.objective, model: model.params } }
//   eval: { type: evaluator, in: { objective: loss.objective, model: ema.params, data: data.dataset } }
//
// The state is created in setup and never written, so reading it adds no ordering: the
// executor overlaps the readers exactly as before. The node's run() does nothing.
//
// Writing one: derive from Objective, take the settings in the constructor, register it with
// one line beside a schema (schemas/TYPE.yaml) that declares the `objective` output:
//
//   class ZLoss : public flowrun::Objective {
//    public:
//     explicit ZLoss(flowrun::SetupContext& ctx) : z_(ctx.params().get<double>("z")) {}
//     std::vector<std::string> needs() const override { return {"tokens"}; }
//     torch::Tensor loss(flowrun::ModelState& m, const flowrun::TensorMap& b) const override;
//     int64_t targets(const flowrun::TensorMap& b) const override;
//   };
//   FLOWRUN_OBJECTIVE(z_loss, ZLoss)                               // built-in
//   reg.add(kSchema, flowrun::objective_factory<ZLoss>(), FLOWRUN_PLUGIN_FILE);  // plugin
//
// examples/plugins/zloss is a complete plugin; docs/nodes.md walks through it.
#pragma once
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor_map.hpp"
#include "models/model_state.hpp"
#include "node.hpp"
#include "registry.hpp"

namespace flowrun {

namespace diffusion {
struct NoiseSchedule;
enum class Prediction;
}  // namespace diffusion

// What a sampler needs of an objective that trains a denoiser: the noise schedule the model
// learns and what it predicts (train/diffusion.hpp). diffusion_loss offers it; so can a plugin's
// objective (Objective::denoising), and the sampler then draws with it.
class Denoising {
 public:
  virtual ~Denoising() = default;
  virtual const diffusion::NoiseSchedule& noise_schedule() const = 0;
  virtual diffusion::Prediction prediction() const = 0;
};

// What a caption evaluator needs of an objective that trains a captioner: the batch key of the
// images, where greedy decoding starts, and a caption's targets with their mask as the loss
// counts them. caption_loss offers it (Objective::captioning).
class Captioning {
 public:
  virtual ~Captioning() = default;
  virtual const std::string& image_key() const = 0;
  virtual torch::Tensor start_tokens(const torch::Tensor& input_ids) const = 0;                // int64 [B]
  virtual std::pair<torch::Tensor, torch::Tensor> labels_of(const torch::Tensor& input_ids,
                                                            const torch::Tensor& mask) const = 0;  // [B, L] each
};

class Objective {
 public:
  virtual ~Objective() = default;

  // The batch keys loss() and targets() read (with forward_backward's `cond` merged in). The
  // callers check them first (check_needs), so a missing key is one error listing the batch's.
  virtual std::vector<std::string> needs() const = 0;

  // The mean loss of the model on a (micro-)batch, a 0-d tensor with autograd attached.
  // Inside forward_backward it runs in a TrainingScope (models/dropout.hpp): random draws come
  // from the scope's generator, seeded by (run seed, step, rank, micro-batch). In an evaluator
  // there is no scope: the loss must then be deterministic (a fixed seed for its draws).
  virtual torch::Tensor loss(ModelState& model, const TensorMap& batch) const = 0;

  // How many targets that mean averages over (lm: B*T tokens; mse, diffusion: rows):
  // forward_backward's `tokens` output and the evaluator's weights (the mean over several
  // batches is sum(loss_i * targets_i) / sum(targets_i)).
  virtual int64_t targets(const TensorMap& batch) const = 0;

  // What an evaluator reports beside the mean loss, each a function of it (lm_loss: ppl =
  // exp(loss)). The evaluator outputs each under its name.
  struct Report {
    std::string name, doc;
    std::function<double(double mean_loss)> of;
  };
  virtual std::vector<Report> reports() const { return {}; }

  // What it offers the nodes that need more than its loss, by interface (never a cast to a
  // concrete objective): a sampler needs denoising(), a caption evaluator captioning().
  // nullptr: not offered.
  virtual const Denoising* denoising() const { return nullptr; }
  virtual const Captioning* captioning() const { return nullptr; }

  // Its node type ("lm_loss"), for messages; set by ObjectiveNode.
  std::string type = "objective";
};

// Throws naming the objective and listing the batch's keys if a key of needs() is missing.
void check_needs(const Objective& objective, const TensorMap& batch);

// The node that owns one objective: builds OBJ from its parameters in setup, owns it as the
// state output `objective`, does nothing per step.
template <class OBJ>
class ObjectiveNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    std::shared_ptr<Objective> o;
    try {
      o = std::make_shared<OBJ>(ctx);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    o->type = ctx.type();
    ctx.own_state("objective", o);
  }
  void run(StepContext&) override {}
};

template <class OBJ>
NodeFactory objective_factory() {
  return [] { return std::unique_ptr<Node>(new ObjectiveNode<OBJ>()); };
}

}  // namespace flowrun

// Register built-in objective TYPE implemented by CLASS (constructible from SetupContext&);
// its schema is schemas/TYPE.yaml, with the output `objective: { kind: state, type: objective }`.
#define FLOWRUN_OBJECTIVE(TYPE, CLASS) FLOWRUN_NODE(TYPE, ::flowrun::ObjectiveNode<CLASS>)
