// How a model family declares itself to the machinery every strategy shares, so that tensor
// parallel, pipeline stages, their init, their loads, checkpoints, the planner and the objective
// are written once over the declaration and a new family writes none of it.
//
// A family (gpt, dit, cappa, llama) states, in its module file, one Family from its config:
//
//   Family family(const Config& c) {
//     Family f;
//     f.tp = c.tp, f.stages = c.stages;                       // the layout its node chose
//     f.tp_split = tp_split;                                  // each parameter's split, by HF name
//     f.order = [c] { return whole_order(c); };               // every parameter, in init order
//     f.block_costs.assign(c.layers, 12.0 * c.dim * c.dim);   // what a pipeline stage cuts by
//     f.head_cost = static_cast<double>(c.vocab) * c.dim;
//     f.tied = {"wte.weight"};                                // the head is the token table
//     f.vocab_split_logits = true;                            // forward's logits under tp
//     f.generator = init_generator;                           // its init, one tensor at a time
//     f.init_one = [c](const std::string& n, torch::Tensor& t, at::Generator& g) { init_parameter(c, n, t, g); };
//     return f;
//   }
//
// and its schema says what the planner reads before any model exists (schema `family:`: the sizes
// run.parallel.tp must divide, whether its blocks are alike). Its node then calls
// ModelNode::cut_into_stages(ctx, family) at configure and ModelNode::declared_state at build
// (init_declared, hold_declared); its loader calls load_declared. What a family still writes
// itself: its module (each layer built as this rank's part: lora::split, layers::MlpOptions::tp;
// the blocks it holds, placeholders for the others), its chunk forward, and its init of one tensor.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/load_by_name.hpp"
#include "models/stages.hpp"
#include "parallel/tensor_parallel.hpp"

namespace flowrun {

struct ModelState;

// Parameters by name with their shape on this rank (a tp part's), in a model's init order.
using ParamOrder = std::vector<std::pair<std::string, std::vector<int64_t>>>;

struct Family {
  // The layout the family's node chose (its Config's): this rank's place among the tp ranks (null
  // at tp 1; ModelNode::tp_group) and its pipeline chunks (null at pp 1; cut_into_stages).
  std::shared_ptr<parallel::Group> tp;
  std::shared_ptr<const Stages> stages;
  // Expert parallel (a mixture of experts): this rank's place among the ep ranks (null at ep 1),
  // over which the tensors tp_split marks `experts` are split.
  std::shared_ptr<parallel::Group> ep;

  // Tensor parallel: each parameter's layout over the tp ranks by its whole model's name —
  // column-split (its outputs, dim 0 in torch's layout), row-split (its inputs), by vocabulary
  // rows, in runs (a fused q | k | v), or whole ({}). LoRA adapters' too (lora::adapter_tp_split).
  std::function<parallel::TpSplit(const std::string&)> tp_split;
  // The whole model's parameters in init order, each with its shape on this rank: what a staged
  // model's init draws (another stage's included, so the generator moves on alike) and the names
  // a staged load skips as another stage's. Asked for only when staged.
  std::function<ParamOrder()> order;
  // Pipeline parallel: each block's cost (its products per token), and the embedding's and the
  // head's, which the stage cut balances (parallel/pipeline_schedule.hpp balance).
  std::vector<double> block_costs;
  double embedding_cost = 0, head_cost = 0;
  // A mixture of experts: the experts a sparse layer has and each token's top_k (0: none); the
  // tensors tp_split marks `experts` are theirs (ModelLayout::is_expert).
  int64_t experts = 0, top_k = 0;
  // Parameters the model uses twice (a head tied to its token table): the last stage holds a copy
  // (Stages::tied), the planner counts them once (ModelLayout::tied).
  std::vector<std::string> tied;
  // What the forward returns under tp: a language model's logits as this rank's columns of the
  // vocabulary (its head split by vocabulary rows) rather than whole (ModelLayout::vocab_split_logits).
  bool vocab_split_logits = false;
  // The seeded init, one whole tensor at a time: the generator a seed makes, and what the whole
  // model's init does to the tensor `name` drawing from it. A family whose init is not tensor by
  // tensor (cappa's goes module by module) leaves them unset and inits a whole model itself.
  std::function<at::Generator(uint64_t seed)> generator;
  std::function<void(const std::string& name, torch::Tensor& whole, at::Generator& g)> init_one;

  bool split() const { return tp && tp->size() > 1; }
  bool splits_experts() const { return ep && ep->size() > 1; }
  bool splits() const { return split() || splits_experts(); }
  parallel::TpLayout layout() const { return {split() ? tp : nullptr, tp_split, splits_experts() ? ep : nullptr}; }
};

// The module's seeded init as one process's: for each parameter in init order (the module's own,
// or the whole model's when staged; adapters excepted: apply_lora's), its whole tensor is drawn
// (Family::init_one) — in place where this rank holds it whole; else made, drawn, and this rank's
// part kept where it holds one. One whole tensor exists at a time, so a rank never holds the whole
// model, and tp and pp change no value.
void init_declared(torch::nn::Module& module, const Family& family, uint64_t seed);
// The same over an explicit order and layout (what init_declared runs).
void init_in_order(torch::nn::Module& module, const ParamOrder& order, const parallel::TpLayout& layout,
                   at::Generator g, const std::function<void(const std::string&, torch::Tensor&, at::Generator&)>& init_one);

// A file's whole tensors into the module by name (load_by_name, `options` the family's): staged,
// the tensors of the whole model this rank does not hold are skipped (another stage's; an unknown
// name is still unexpected); split, each rank takes its parts (Family::tp_split).
void load_declared(torch::nn::Module& module, const Family& family, const std::map<std::string, torch::Tensor>& tensors,
                   const std::string& source, LoadByNameOptions options);

// The layout as the model's state tells it to checkpoints, the optimizer, the EMA, the objective
// and the planner (ModelLayout: tp, splits_over_tp, vocab_split_logits, stages, tied); `how`,
// when it says where the values came from, that the count is a part.
void hold_declared(ModelState& state, const Family& family, std::string& how);

}  // namespace flowrun
