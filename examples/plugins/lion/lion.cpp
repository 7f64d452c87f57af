// Plugin update rule `lion`: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms") for the built-in `optimizer` node: a graph uses it with
// `kind: lion` and its settings in `lion: {...}`, listing this library under `plugins:`
// (examples/plugins/regression_lion.yaml); flowrun is not relinked. Per parameter p, gradient g:
//
//   update = sign(beta1 * m + (1 - beta1) * g)
//   p      = p (1 - lr wd) - lr * update        (the optimizer applies the decay, on matrices)
//   m      = beta2 * m + (1 - beta2) * g
//
// Everything else is the optimizer's, for every rule alike: clipping, the lr schedule, weight
// decay, non-finite steps, checkpoints (m is saved as NAME.exp_avg) and ZeRO (Lion is
// element-wise, so a zero plan's `stage: states | gradients` cuts its moment with the parameters).
#include <torch/torch.h>

#include "plugin_api.hpp"
#include "train/update_rule.hpp"

namespace {

const char* kGroup = R"yaml(group: lion
doc: "Lion (sign of an interpolated momentum); wants a 3-10x smaller lr than AdamW and a larger weight_decay."
params:
  beta1: { type: float, default: 0.9, min: 0, max: 1, doc: "Interpolation between momentum and gradient for the update's sign." }
  beta2: { type: float, default: 0.99, min: 0, max: 1, doc: "Decay of the momentum." }
)yaml";

class Lion : public flowrun::UpdateRule {
 public:
  explicit Lion(const flowrun::Params& p) : b1_(p.get<double>("beta1")), b2_(p.get<double>("beta2")) {}

  std::vector<std::string> moments() const override { return {"exp_avg"}; }

  void update(torch::Tensor& p, const torch::Tensor& g, std::vector<torch::Tensor>& m, const Step& s) const override {
    p.add_((m[0] * b1_ + g * (1 - b1_)).sign_(), -s.lr);
    m[0].mul_(b2_).add_(g, 1 - b2_);
  }

 private:
  double b1_, b2_;
};

}  // namespace

FLOWRUN_PLUGIN(reg) { flowrun::add_update_rule(reg, kGroup, flowrun::rule_factory<Lion>(), FLOWRUN_PLUGIN_FILE); }
