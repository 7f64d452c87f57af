// lm_loss: next-token cross-entropy of a language model.
// Schema: schemas/lm_loss.yaml. Test: tests/nodes/objectives_test.cpp.
//
// The model maps batch["tokens"] [B, T+1] to logits [B, T, vocab] for tokens[:, :-1]
// (models/gpt/gpt.hpp); the targets are tokens[:, 1:]. Mean over the B*T targets. The softmax over
// the vocabulary runs in fp32 whatever precision the model computed its logits in, fused
// (train/cross_entropy.hpp: with a 50k vocabulary the loss is a large part of a small model's
// step), its gradient written over the logits, which are the loss's alone; over the vocabulary
// columns each rank holds when the model says its logits are split.
#include <cmath>

#include "parallel/tensor_parallel.hpp"
#include "train/cross_entropy.hpp"
#include "train/losses.hpp"

namespace flowrun {

torch::Tensor LmLoss::loss(ModelState& model, const TensorMap& batch) const {
  const torch::Tensor& tokens = batch.at("tokens");
  if (tokens.dim() != 2 || tokens.size(1) < 2)
    throw std::runtime_error("objective " + type + ": batch 'tokens' must be [batch, T+1] with T >= 1, got " +
                             shape_str(tokens));
  const int64_t B = tokens.size(0), T = tokens.size(1) - 1;
  torch::Tensor logits = model.forward(batch);
  if (logits.dim() != 3 || logits.size(0) != B || logits.size(1) != T)
    throw std::runtime_error("objective " + type + ": the model returned " + shape_str(logits) +
                             " for tokens " + shape_str(tokens) + "; expected [" +
                             std::to_string(B) + ", " + std::to_string(T) + ", vocab]");
  const int64_t V = logits.size(2);
  torch::Tensor targets = tokens.narrow(1, 1, T).reshape({B * T}).to(torch::kLong);
  // A model whose logits are this rank's vocabulary columns (it says so: ModelLayout) is scored by
  // all-reducing each row's max, sum of exponentials and target logit over its tp group, never the
  // whole logits; whole logits (any other model, split over tp or not) are scored whole.
  if (model.vocab_split_logits)
    return parallel::vocab_parallel_cross_entropy(logits.reshape({B * T, V}), targets, model.tp->group);
  return cross_entropy_mean(logits.reshape({B * T, V}), targets, CrossEntropyKernel::automatic, /*logits_spent=*/true);
}

int64_t LmLoss::targets(const TensorMap& batch) const {
  const torch::Tensor& tokens = batch.at("tokens");
  return tokens.dim() == 2 && tokens.size(1) >= 2 ? tokens.size(0) * (tokens.size(1) - 1) : 0;
}

std::vector<Objective::Report> LmLoss::reports() const {
  return {{"ppl", "perplexity, exp(mean loss)", [](double loss) { return std::exp(loss); }}};
}

}  // namespace flowrun

FLOWRUN_OBJECTIVE(lm_loss, flowrun::LmLoss)
