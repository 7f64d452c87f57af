// Update rules: how the optimizer node moves each parameter, as registered components.
//
// The optimizer node (optimizer.cpp) does what every rule shares: the gradients' global norm
// and clipping, decoupled weight decay (p *= 1 - lr wd, on matrices only), the learning-rate
// schedule, non-finite steps, the moments' flat buffers, ZeRO sharding and checkpoints. A rule
// (the node's `kind`) says which moments it keeps per parameter and how it moves one parameter:
//
//   class Lion : public flowrun::UpdateRule {
//    public:
//     explicit Lion(const flowrun::Params& p) : b1_(p.get<double>("beta1")), b2_(p.get<double>("beta2")) {}
//     std::vector<std::string> moments() const override { return {"exp_avg"}; }
//     void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>& m,
//                 const Step& s) const override {
//       p.add_((m[0] * b1_ + g * (1 - b1_)).sign_(), -s.lr);
//       m[0].mul_(b2_).add_(g, 1 - b2_);
//     }
//    private:
//     double b1_, b2_;
//   };
//   FLOWRUN_UPDATE_RULE(lion, Lion)   // built-in: its settings are schemas/optimizer.yaml's `lion:`
//   flowrun::add_update_rule(reg, kGroupYaml, flowrun::rule_factory<Lion>(), FLOWRUN_PLUGIN_FILE);  // plugin
//
// A graph picks it by `kind: lion` and sets it in its own group, `with: { kind: lion, lion:
// { beta1: 0.95 } }`; the checker refuses another rule's group (the schema's `when:`). Built-in
// rules: rules/adamw.cpp, rules/sgd.cpp, rules/adafactor.cpp; a plugin one:
// examples/plugins/lion.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/grads.hpp"
#include "models/model_state.hpp"
#include "node.hpp"
#include "registry.hpp"

namespace flowrun {

struct OptimizerState;
namespace parallel {
class Group;
}

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;

  // The moments kept for every parameter, shaped like it, by name (the checkpoint's
  // "PARAM.NAME"): zeroed at the first update in flat buffers laid out like the parameters, so
  // that ZeRO slices them with the parameters. They come first in update()'s `m`.
  virtual std::vector<std::string> moments() const = 0;

  // Moments of other shapes for a parameter of `shape` (Adafactor's row and column statistics),
  // by name and shape, zeroed; after moments() in update()'s `m`. None by default.
  virtual std::vector<std::pair<std::string, std::vector<int64_t>>> own_moments(c10::IntArrayRef shape) const {
    (void)shape;
    return {};
  }

  // Whether an element's update reads only that element's gradient and moments: ZeRO then cuts
  // a parameter anywhere; otherwise (Adafactor: rows and columns) each rank gets whole ones.
  virtual bool elementwise() const { return true; }

  // Under tensor parallel a parameter may be this rank's part of a whole one, cut along `dim`
  // into the group's size of equal blocks (Step::part). A rule that is not element-wise shapes
  // its own moments by the whole parameter and cuts them with it: the dimension of own moment
  // `name` that follows the parameter's `dim` (its blocks of that dimension), or -1 when that
  // moment is whole on every part (its statistics summed over the group). By default: `dim`.
  virtual int64_t own_moment_dim(c10::IntArrayRef whole, int64_t dim, const std::string& name) const {
    (void)whole, (void)name;
    return dim;
  }
  struct Part {
    std::vector<int64_t> whole;  // the whole parameter's shape
    int64_t dim = -1;            // the split dimension
    parallel::Group* group = nullptr;  // the tp ranks (the optimizer's channel): sums over the whole
  };

  // One parameter's update, in place (under NoGradGuard): p already decayed, g already clipped,
  // m its moments as listed above. t counts this parameter's updates, 1-based (bias correction).
  // `part`: p is a tp part (above); every tp rank updates its part in the same order, so a rule
  // may sum over part->group; null: p is whole. Element-wise rules ignore it.
  struct Step {
    double lr;
    int64_t t;
    const Part* part = nullptr;
  };
  virtual void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>& m, const Step& s) const = 0;

  // Optional: many parameters in one pass, faster than update() one by one (a CPU kernel over
  // fp32 tensors, torch's fused GPU kernel). It takes the ones it can, counts their slot's step,
  // applies weight decay and clip itself, and marks them in `done`; update() gets the rest.
  struct Batch {
    OptimizerState& state;
    const ModelState::Named& params;
    const Grads& grads;
    double lr, weight_decay;
    torch::Tensor clip;       // the clip factor (0-d, on the grads' device), undefined: no clip
    float clip_cpu;           // the same as a number where it is on the CPU (1: none)
    torch::Tensor found_inf;  // on_device() rules: 1.0 where the step is to be skipped
    std::vector<char>& done;
    bool on_device = false;   // what on_device() said of this step (asked once, by the optimizer)
  };
  virtual void update_many(Batch& b) const { (void)b; }

  // Whether update_many() takes every parameter of this step on the device, skipping the update
  // there when Batch::found_inf says so (no host read of the norm; torch's fused AdamW).
  virtual bool on_device(const OptimizerState& st, const ModelState::Named& params, const Grads& grads) const {
    (void)st, (void)params, (void)grads;
    return false;
  }

  std::string kind;  // its name ("adamw"), for messages; set by make_update_rule
};

// Makes a rule from its settings (the optimizer's group of the rule's name, defaults filled).
using RuleFactory = std::function<std::shared_ptr<UpdateRule>(const Params& settings)>;
template <class RULE>
RuleFactory rule_factory() {
  return [](const Params& p) { return std::make_shared<RULE>(p); };
}

// Registers a built-in rule (its settings are a group of schemas/optimizer.yaml, and its name one
// of `kind`'s values: a test checks that each has both).
void register_update_rule(const std::string& name, RuleFactory factory);

// A plugin's rule: `group_yaml` is a parameter group (`group: NAME`, `doc:`, `params:`, as
// schemas/groups/*.yaml); NAME becomes a value of the optimizer's `kind` and the group its
// settings (`with: { kind: NAME, NAME: {...} }`). A name already registered is refused.
void add_update_rule(Registry& reg, const std::string& group_yaml, RuleFactory factory, const std::string& origin);

// The rule `kind` with `settings` (the optimizer's `with.KIND` map as the checker returns it,
// defaults filled). Throws naming the registered rules for an unknown kind.
std::shared_ptr<const UpdateRule> make_update_rule(const std::string& kind, const Params& settings);
// The same from YAML text of its settings, the schema's defaults filled in (tests, benches):
// make_update_rule("adamw", "{beta2: 0.95}").
std::shared_ptr<const UpdateRule> make_update_rule(const std::string& kind, const std::string& settings_yaml = "{}");
std::vector<std::string> update_rule_names();  // sorted

// Weight decay applies to matrices and higher (Linear/conv weights, embeddings), never to
// biases, norm gains or other 1-D / 0-D parameters (the GPT-2 / nanoGPT rule).
inline bool decays(const torch::Tensor& p) { return p.dim() >= 2; }

namespace detail {
struct RuleRegistrar {
  RuleRegistrar(const char* name, RuleFactory f) { register_update_rule(name, std::move(f)); }
};
}  // namespace detail

}  // namespace flowrun

#define FLOWRUN_UPDATE_RULE(NAME, CLASS) \
  static ::flowrun::detail::RuleRegistrar FLOWRUN_CONCAT(flowrun_rule_, NAME)(#NAME, ::flowrun::rule_factory<CLASS>());
