// caption_loss: CapPa's captioning objective, autoregressive and parallel prediction (the
// math in train/losses.hpp). Schema: schemas/caption_loss.yaml. Test: tests/nodes/cappa_test.cpp.
#include <cmath>

#include "common/seed.hpp"
#include "models/dropout.hpp"
#include "train/cross_entropy.hpp"
#include "train/losses.hpp"

namespace flowrun {

CaptionLoss::CaptionLoss(Options o) : o_(std::move(o)) { type = "caption_loss"; }

static CaptionLoss::Options caption_options(const Params& p) {
  CaptionLoss::Options o;
  o.masked_pred_prob = p.get<double>("masked_pred_prob");
  o.masking_ratio = p.get<double>("masking_ratio");
  o.label_smoothing = p.get<double>("label_smoothing");
  o.start_token = p.has("start_token") ? p.get<int64_t>("start_token") : -1;
  o.image_key = p.get<std::string>("image_key");
  return o;
}

CaptionLoss::CaptionLoss(SetupContext& ctx) : CaptionLoss(caption_options(ctx.params())) {}

std::pair<torch::Tensor, torch::Tensor> CaptionLoss::labels_of(const torch::Tensor& ids, const torch::Tensor& mask) const {
  if (ids.dim() != 2 || ids.size(1) < (o_.start_token < 0 ? 2 : 1))
    throw std::runtime_error("objective " + type + ": input_ids must be [batch, T] with T >= 2 (a start token and a "
                             "caption token), got " + shape_str(ids));
  const torch::Tensor m = mask.defined() ? mask : torch::ones_like(ids);
  if (o_.start_token < 0) return {ids.narrow(1, 1, ids.size(1) - 1), m.narrow(1, 1, m.size(1) - 1)};
  return {ids, m};
}

torch::Tensor CaptionLoss::start_tokens(const torch::Tensor& ids) const {
  return o_.start_token < 0 ? ids.select(1, 0).to(torch::kLong) : torch::full({ids.size(0)}, o_.start_token, ids.options().dtype(torch::kLong));
}

CaptionLoss::Prepared CaptionLoss::prepare(const TensorMap& batch, const std::function<uint64_t(int64_t)>& row_seed) const {
  auto mit = batch.find("attention_mask");
  const torch::Tensor ids = batch.at("input_ids").to(torch::kLong);
  auto [labels, mask] = labels_of(ids, mit == batch.end() ? torch::Tensor() : mit->second);
  const int64_t B = labels.size(0), L = labels.size(1);
  // Autoregressive inputs: the start token, then every target but the last.
  torch::Tensor input = torch::cat({start_tokens(ids).view({B, 1}), labels.narrow(1, 0, L - 1)}, 1);
  torch::Tensor parallel = torch::zeros({B}, ids.options().dtype(torch::kBool));
  torch::Tensor masked = torch::zeros({B, L}, ids.options().dtype(torch::kBool));
  if (row_seed && o_.masked_pred_prob > 0) {
    const auto n_masked = static_cast<int64_t>(std::floor(o_.masking_ratio * static_cast<double>(L)));
    std::vector<uint8_t> par(static_cast<size_t>(B));
    torch::Tensor positions = torch::zeros({B, L}, torch::kBool);
    for (int64_t r = 0; r < B; ++r) {
      at::Generator g = make_cpu_generator(row_seed(r));
      par[static_cast<size_t>(r)] = torch::rand({1}, g).item<double>() < o_.masked_pred_prob;
      if (!par[static_cast<size_t>(r)]) continue;
      if (n_masked >= L) {
        positions[r].fill_(true);
      } else if (n_masked > 0) {  // a random n_masked positions: the first n of a random order
        positions[r].index_fill_(0, torch::rand({L}, g).argsort().narrow(0, 0, n_masked), true);
      }
    }
    // Drawn on the host (per-row generators); copied without making the host wait.
    parallel = to_device(torch::tensor(std::vector<int64_t>(par.begin(), par.end())).to(torch::kBool), ids.device());
    masked = to_device(positions, ids.device()) & parallel.view({B, 1});
    input = torch::where(parallel.view({B, 1}), labels, input);  // parallel rows: the targets, unshifted
  }
  Prepared p;
  p.model = {{"image", batch.at(o_.image_key)}, {"decoder_input", input}, {"decoder_masked", masked}, {"parallel", parallel}};
  p.labels = labels;
  p.weights = mask.to(torch::kFloat);
  return p;
}

torch::Tensor CaptionLoss::loss(ModelState& model, const TensorMap& batch) const {
  std::function<uint64_t(int64_t)> row_seed;
  if (TrainingScope::current()) row_seed = [](int64_t r) { return TrainingScope::row_seed(r, kSeedTagCaption); };
  const Prepared p = prepare(batch, row_seed);
  const torch::Tensor logits = model.forward(p.model);
  if (logits.dim() != 3 || logits.size(0) != p.labels.size(0) || logits.size(1) != p.labels.size(1))
    throw std::runtime_error("objective " + type + ": the model returned " + shape_str(logits) + " for targets " +
                             shape_str(p.labels) + "; expected [batch, L, vocab]");
  // Per token (train/cross_entropy.hpp: on a GPU the fused kernel, which reads bf16 logits as
  // they are and keeps one fp32 logsumexp per token; on the CPU torch's log-softmax).
  const int64_t B = logits.size(0), L = logits.size(1);
  const torch::Tensor per_token =
      cross_entropy_rows(logits.reshape({B * L, logits.size(2)}), p.labels.to(logits.device()).reshape({B * L}),
                         o_.label_smoothing)
          .view({B, L});
  const torch::Tensor w = p.weights.to(logits.device());
  return ((per_token * w).sum(1) / w.sum(1).clamp_min(1.0)).mean();  // per caption, then over captions
}

int64_t CaptionLoss::targets(const TensorMap& batch) const { return batch.at("input_ids").size(0); }

std::vector<Objective::Report> CaptionLoss::reports() const {
  return {{"ppl", "perplexity per caption token, exp(mean loss)", [](double loss) { return std::exp(loss); }}};
}

}  // namespace flowrun

FLOWRUN_OBJECTIVE(caption_loss, flowrun::CaptionLoss)
