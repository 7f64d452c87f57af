// Plugin objective `lm_zloss`: next-token cross-entropy with label smoothing and PaLM's z-loss
// (Chowdhery et al. 2022, "PaLM", section 5), a drop-in for the built-in lm_loss: a graph uses
// it by changing one `type:` and listing this library under `plugins:`
// (examples/plugins/gpt_zloss.yaml), flowrun not relinked.
//
// Per target token, with logits z over the vocabulary (V entries) and the true token y:
//   log p  = z - logsumexp(z)
//   ce     = -(1 - eps) log p[y] - eps * mean_k log p[k]      (label smoothing eps)
//   zloss  = z_loss * logsumexp(z)^2                          (keeps the softmax normaliser near 0)
//   loss   = mean over the B*T targets of (ce + zloss)
// With eps = 0 and z_loss = 0 it is lm_loss's cross-entropy.
#include <torch/torch.h>

#include "plugin_api.hpp"
#include "train/objective.hpp"

namespace {

const char* kSchema = R"yaml(type: lm_zloss
doc: >-
  Objective (a plugin): next-token cross-entropy with label smoothing and PaLM's z-loss, for
  language models (the batch's tokens [B, T+1], the model's logits [B, T, vocab]); targets =
  B x T tokens. With label_smoothing 0 and z_loss 0 it is lm_loss.
stateless: true
outputs:
  objective: { kind: state, type: objective, doc: "The objective, read by forward_backward and evaluator." }
params:
  label_smoothing: { type: float, default: 0.0, min: 0, max: 1, doc: "eps: the target distribution is (1 - eps) one-hot + eps uniform." }
  z_loss: { type: float, default: 1.0e-4, min: 0, doc: "Coefficient of logsumexp(logits)^2 per token (PaLM: 1e-4)." }
)yaml";

class LmZLoss : public flowrun::Objective {
 public:
  explicit LmZLoss(flowrun::SetupContext& ctx)
      : eps_(ctx.params().get<double>("label_smoothing")), z_(ctx.params().get<double>("z_loss")) {}

  std::vector<std::string> needs() const override { return {"tokens"}; }

  torch::Tensor loss(flowrun::ModelState& model, const flowrun::TensorMap& batch) const override {
    const torch::Tensor& tokens = batch.at("tokens");
    if (tokens.dim() != 2 || tokens.size(1) < 2)
      throw std::runtime_error("objective " + type + ": batch 'tokens' must be [batch, T+1] with T >= 1");
    const int64_t B = tokens.size(0), T = tokens.size(1) - 1;
    torch::Tensor logits = model.forward(batch);
    const int64_t V = logits.size(-1);
    torch::Tensor z = logits.reshape({B * T, V}).to(torch::kFloat);
    torch::Tensor y = tokens.narrow(1, 1, T).reshape({B * T, 1}).to(torch::kLong);
    torch::Tensor lse = z.logsumexp(1, /*keepdim=*/true);  // [N, 1]
    torch::Tensor logp = z - lse;
    torch::Tensor ce = -(1.0 - eps_) * logp.gather(1, y).squeeze(1) - eps_ * logp.mean(1);
    return (ce + z_ * lse.squeeze(1).square()).mean();
  }

  int64_t targets(const flowrun::TensorMap& batch) const override {
    const torch::Tensor& tokens = batch.at("tokens");
    return tokens.size(0) * (tokens.size(1) - 1);
  }

 private:
  double eps_, z_;
};

}  // namespace

FLOWRUN_PLUGIN(reg) { reg.add(kSchema, flowrun::objective_factory<LmZLoss>(), FLOWRUN_PLUGIN_FILE); }
