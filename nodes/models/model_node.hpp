// The model nodes (gpt, llama, dit, cappa, vae, mlp) own a module's parameters and do no per-step work.
// A family says what is its own (its config, how to build, initialise and load its module, what
// it adds to the state; how it splits and cuts, as its Family: models/family.hpp); ModelNode::setup
// says the rest once, in this order, for every family:
//
//   1. configure(ctx)        the family's config from `with:` (and a pretrained folder's
//                            config.json), checked; nothing allocated yet
//   2. check_model_fits      the parameter count against the run's device (common/memory.hpp)
//   3. build(seed, init)     the module as the node's ModelState, seeded values unless `weights`
//                            or `pretrained` will give every base value
//   4. `lora`                every base parameter frozen, adapters on the targeted layers
//                            (schemas/groups/lora.yaml; models/lora.hpp)
//   5. base values           `pretrained` (load_pretrained) or the `weights` file through a
//                            checkpoint's `latest` (load_weights); the adapters keep their init
//   6. `adapters`            a PEFT folder's adapters
//   7. finish(ctx, state)    what the family adds: activations estimate, captioner, warnings
//   8. own                   the parameter count logged, the module moved to the run's device,
//                            its adapters exportable, the state the node's `params` output
//
// A family node, whole (models/gpt/gpt_node.cpp is the full one):
//
//   class GptNode : public ModelNode {
//     Config cfg_; Gpt model_{nullptr};
//     Plan configure(SetupContext& ctx) override { /* read cfg_ */ return {describe(cfg_), count, layers}; }
//     std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) override {
//       model_ = Gpt(cfg_);
//       if (init) { init_weights(*model_, seed); how = "GPT-2 init, seed " + std::to_string(seed); }
//       return make_state(model_);
//     }
//     void load_weights(ModelState&, const std::string& path) override { load_hf_safetensors(*model_, path); }
//   };
#pragma once
#include <nlohmann/json.hpp>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/activation_checkpoint.hpp"
#include "models/family.hpp"
#include "models/model_state.hpp"
#include "node.hpp"

namespace flowrun {

namespace parallel {
class Group;
struct TpLayout;
}

class ModelNode : public Node {
 public:
  void setup(SetupContext& ctx) final;
  void run(StepContext&) override {}  // parameters change only through the optimizer

 protected:
  // What configure() tells the base about the model before anything is allocated.
  struct Plan {
    std::string what;               // the config in words: the log line, size errors
    double parameters = 0;          // the parameter count, checked against the device's memory
    int64_t layers = 0;             // blocks (check_model_fits bounds them)
    CheckpointPolicy checkpoint{};  // the model's `checkpoint:` (activation recomputation)
    bool pretrained = false;        // a `pretrained` folder gives the weights (load_pretrained)
    // What a `weights` file of this family is, for the error when it is missing:
    // "a Hugging Face GPT-2 model.safetensors or a checkpoint's model.safetensors".
    std::string weights_are = "a checkpoint's model.safetensors of this model";
  };

  // Reads and checks the node's config (ctx.params()); allocates no tensors.
  virtual Plan configure(SetupContext& ctx) = 0;
  // The module as the node's state; with `init`, its seeded init, said in `how` ("GPT-2 init,
  // seed 7"). Without, every base value comes from load_weights or load_pretrained next.
  virtual std::shared_ptr<ModelState> build(uint64_t seed, bool init, std::string& how) = 0;
  // A `weights` file (resolved, existing) into the module; adapter names are optional in it.
  virtual void load_weights(ModelState& state, const std::string& path) = 0;
  // The `pretrained` folder's weights (Plan::pretrained set); returns the folder.
  virtual std::string load_pretrained(ModelState& state);
  // Tensor parallel, for a family that splits (its Config::tp, Family::tp): this rank's place
  // among the model's tp ranks (run.parallel.tp; Group::place, no channel: the nodes running the
  // model open their own), null at tp 1.
  static std::shared_ptr<parallel::Group> tp_group(SetupContext& ctx);
  // Expert parallel, for a family with experts (llama's moe): this rank's place among the ep ranks
  // (run.parallel.ep), null at ep 1.
  static std::shared_ptr<parallel::Group> ep_group(SetupContext& ctx);
  // The tensors of `whole` by name: a family whose init is not tensor by tensor (cappa's) inits a
  // whole model and loads them, each rank keeping its parts and its stage's.
  static std::map<std::string, torch::Tensor> named_tensors(torch::nn::Module& whole);
  // Pipeline parallel (run.parallel.pp > 1): the model's blocks cut into pp x virtual_stages chunks
  // (run.parallel.stage_layers, or balanced by the family's block costs with its embedding's and
  // head's: parallel/pipeline_schedule.hpp), the chunks this rank holds (k % pp = its pp
  // coordinate), and the family's tied tensors where the first and last chunks are on different
  // ranks (Stages::tied). Null at pp 1. The family's tp (Family::tp) is set already.
  static std::shared_ptr<Stages> cut_into_stages(SetupContext& ctx, const Family& family);
  // A declared family's build() after making its module (this rank's parts and chunks) into
  // `state`: with `init`, the whole model's seeded init (init_declared; `how` = "<init_name>, seed
  // N"), then the layout told (hold_declared). Returns `state`.
  static std::shared_ptr<ModelState> declared_state(std::shared_ptr<ModelState> state, const Family& family,
                                                    uint64_t seed, bool init, const std::string& init_name,
                                                    std::string& how);
  // Saving back for tools outside flowrun: without adapters (`adapted` empty), a checkpoint with
  // `exports: true` writes the model as a folder transformers' from_pretrained loads
  // (common/pretrained.hpp write_pretrained): `config` as config.json, every tensor whole (a
  // sharded model's as the checkpoint gathered them) under `prefix` + its name, in safetensors
  // files of at most the node's `export_shard_mb`, and the tokenizer files of `copy_from` (the
  // pretrained folder it came from; "" for none). With adapters nothing here: ModelNode's PEFT
  // export of the adapters stands.
  // `rename`, when given, turns the tensors (the module's names, prefixed) into the file's (a
  // mixture of experts' fused experts written one by one, as the Hub's files are).
  using Rename = std::function<std::map<std::string, torch::Tensor>(const std::map<std::string, torch::Tensor>&)>;
  static void offer_hf_export(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted,
                              nlohmann::json config, const std::string& prefix, const std::string& copy_from,
                              Rename rename = nullptr);
  // The family's last word on its state: its activations estimate, a captioner, warnings.
  // `adapted`: the layers `lora` put adapters on.
  virtual void finish(SetupContext& ctx, ModelState& state, const std::vector<std::string>& adapted);
};

}  // namespace flowrun
