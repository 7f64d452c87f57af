// lm_loss: next-token cross-entropy of a language model.
// Schema: schemas/lm_loss.yaml. Test: tests/nodes/objectives_test.cpp.
//
// The model maps batch["tokens"] [B, T+1] to logits [B, T, vocab] for tokens[:, :-1]
// (models/gpt/gpt.hpp); the targets are tokens[:, 1:]. Mean over the B*T targets. The softmax over
// the vocabulary runs in fp32 whatever precision the model computed its logits in, fused
// (train/cross_entropy.hpp: with a 50k vocabulary the loss is a large part of a small model's
// step), its gradient written over the logits, which are the loss's alone; over the vocabulary
// columns each rank holds when the model says its logits are split.
//
// A batch with a loss mask (data/packed_shards.hpp: "loss_mask" [B, T], "loss_scale" [B]) counts
// only the masked-in targets: the loss is loss_scale x (the sum of their losses) / B, the rows'
// scale being world x batch / (the step's counted targets over all ranks), so that forward_backward's
// average over micro-batches and the ranks' average give sum / count over the global batch. Only
// the masked-in rows of the logits are scored (prompt tokens cost no softmax).
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
  // With a loss mask, the counted rows only (a model that reads "loss_rows" computes just their logits).
  torch::Tensor keep;
  double factor = 1.0;  // what the mean over the scored rows is multiplied by
  if (const auto m = batch.find("loss_mask"); m != batch.end()) {
    const auto s = batch.find("loss_scale");
    if (m->second.sizes() != torch::IntArrayRef{B, T} || s == batch.end() || s->second.dim() != 1 || s->second.size(0) != B)
      throw std::runtime_error("objective " + type + ": a batch's loss_mask must be [" + std::to_string(B) + ", " +
                               std::to_string(T) + "] with loss_scale [" + std::to_string(B) + "] (data/packed_shards.hpp), got " +
                               shape_str(m->second) + (s == batch.end() ? " and no loss_scale" : " and " + shape_str(s->second)));
    const torch::Tensor scale = s->second.to(torch::kCPU, torch::kDouble);
    const auto [lo, hi] = torch::aminmax(scale);
    if (lo.item<double>() != hi.item<double>())
      throw std::runtime_error("objective " + type + ": loss_scale differs between the rows of a batch; packed_shards gives one per step");
    keep = m->second.reshape({B * T}).nonzero().squeeze(1).to(torch::kLong);
    factor = hi.item<double>() * static_cast<double>(keep.numel()) / static_cast<double>(B);
  }
  TensorMap with_rows;
  if (keep.defined()) with_rows = batch, with_rows["loss_rows"] = keep;
  torch::Tensor logits = model.forward(keep.defined() ? with_rows : batch);
  torch::Tensor targets = tokens.narrow(1, 1, T).reshape({B * T}).to(torch::kLong);
  torch::Tensor rows;
  if (keep.defined() && logits.dim() == 2 && logits.size(0) == keep.numel()) {  // the model scored the kept rows only
    rows = logits;
  } else {
    if (logits.dim() != 3 || logits.size(0) != B || logits.size(1) != T)
      throw std::runtime_error("objective " + type + ": the model returned " + shape_str(logits) + " for tokens " + shape_str(tokens) +
                               "; expected [" + std::to_string(B) + ", " + std::to_string(T) + ", vocab]");
    rows = logits.reshape({B * T, logits.size(2)});
    if (keep.defined()) rows = rows.index_select(0, keep.to(rows.device()));
  }
  if (keep.defined()) {
    if (keep.numel() == 0) return rows.sum() * 0.0;  // nothing counted here: no loss, zero gradients
    targets = targets.index_select(0, keep.to(targets.device()));
  }
  torch::Tensor mean = model.vocab_split_logits
                           ? parallel::vocab_parallel_cross_entropy(rows, targets, model.tp->group)
                           : cross_entropy_mean(rows, targets, CrossEntropyKernel::automatic, /*logits_spent=*/true);
  return factor == 1.0 ? mean : mean * factor;
}

int64_t LmLoss::targets(const TensorMap& batch) const {
  if (const auto m = batch.find("loss_mask"); m != batch.end()) return m->second.count_nonzero().item<int64_t>();
  const torch::Tensor& tokens = batch.at("tokens");
  return tokens.dim() == 2 && tokens.size(1) >= 2 ? tokens.size(0) * (tokens.size(1) - 1) : 0;
}

std::vector<Objective::Report> LmLoss::reports() const {
  return {{"ppl", "perplexity, exp(mean loss)", [](double loss) { return std::exp(loss); }}};
}

}  // namespace flowrun

FLOWRUN_OBJECTIVE(lm_loss, flowrun::LmLoss)
