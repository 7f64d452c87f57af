// Plugin node `lion`: the Lion optimizer (Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms"), a drop-in for the built-in `optimizer` node: same ports, so a graph
// swaps it in by changing one `type:` and listing this library under `plugins:`.
//
//   update = sign(beta1 * m + (1 - beta1) * g)
//   p     -= lr * (update + weight_decay * p)
//   m      = beta2 * m + (1 - beta2) * g
#include <torch/torch.h>

#include "common/grads.hpp"
#include "models/model_state.hpp"
#include "plugin_api.hpp"

namespace {

const char* kSchema = R"yaml(type: lion
doc: "Lion optimizer (sign of an interpolated momentum); a plugin drop-in for the optimizer node."
compute: true
inputs:
  grads: { kind: value, type: grads, doc: "gradients aligned with the model's trainable parameters" }
  model: { kind: state, access: write, type: params, doc: "the model whose trainable parameters are updated" }
outputs:
  lr: { kind: value, type: scalar, doc: "double: the learning rate used this step" }
  state: { kind: state, access: write, type: lion_state, doc: "LionState: one momentum tensor per parameter" }
params:
  lr: { type: float, default: 1.0e-4, min: 0, doc: "learning rate (Lion wants 3-10x smaller than AdamW)" }
  beta1: { type: float, default: 0.9, min: 0, max: 1, doc: "interpolation for the update direction" }
  beta2: { type: float, default: 0.99, min: 0, max: 1, doc: "decay of the momentum" }
  weight_decay: { type: float, default: 0.0, min: 0, doc: "decoupled weight decay on parameters with 2+ dims" }
)yaml";

struct LionState {
  std::vector<torch::Tensor> momentum;  // per trainable parameter, created on first use
  std::map<std::string, torch::Tensor> tensors() const {
    std::map<std::string, torch::Tensor> out;
    for (size_t i = 0; i < momentum.size(); ++i) out["momentum." + std::to_string(i)] = momentum[i];
    return out;
  }
};

class Lion : public flowrun::Node {
  double lr_ = 0, b1_ = 0, b2_ = 0, wd_ = 0;

 public:
  void setup(flowrun::SetupContext& c) override {
    lr_ = c.params().get<double>("lr");
    b1_ = c.params().get<double>("beta1");
    b2_ = c.params().get<double>("beta2");
    wd_ = c.params().get<double>("weight_decay");
    c.own_state("state", std::make_shared<LionState>());
  }

  void run(flowrun::StepContext& c) override {
    auto& model = c.state_as<flowrun::ModelState>("model");
    auto& st = c.state_as<LionState>("state");
    const auto& grads = c.in<flowrun::Grads>("grads");
    std::vector<torch::Tensor> params = model.trainable_parameters();
    if (grads.size() != params.size())
      throw std::runtime_error("lion: " + std::to_string(grads.size()) + " grads for " + std::to_string(params.size()) +
                               " trainable parameters");
    torch::NoGradGuard no_grad;
    if (st.momentum.empty())
      for (const auto& p : params) st.momentum.push_back(torch::zeros_like(p));
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& g = grads[i];
      if (!g.defined()) continue;
      torch::Tensor& p = params[i];
      torch::Tensor& m = st.momentum[i];
      torch::Tensor update = (m * b1_ + g * (1 - b1_)).sign_();
      if (wd_ > 0 && p.dim() >= 2) update.add_(p, wd_);
      p.sub_(update, lr_);
      m.mul_(b2_).add_(g, 1 - b2_);
    }
    c.out("lr", lr_);
  }
};

}  // namespace

FLOWRUN_PLUGIN(reg) {
  reg.add(kSchema, [] { return std::make_unique<Lion>(); }, FLOWRUN_PLUGIN_FILE);
}
