// generate(): see generate.hpp.
#include "models/generate.hpp"

#include <chrono>
#include <limits>
#include <stdexcept>

#include "common/seed.hpp"

namespace flowrun {
namespace {

// The next ids from the last position's logits [B, V] (transformers' order of the warpers).
torch::Tensor pick(torch::Tensor logits, const GenerateOptions& o, at::Generator& gen) {
  logits = logits.to(torch::kFloat);
  if (o.temperature <= 0.0) return logits.argmax(-1);
  logits = logits / o.temperature;
  const double neg = -std::numeric_limits<float>::infinity();
  if (o.top_k > 0 && o.top_k < logits.size(-1)) {  // keep the k largest
    const torch::Tensor kth = std::get<0>(logits.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    logits = logits.masked_fill(logits < kth, neg);
  }
  if (o.top_p < 1.0) {  // keep the smallest set whose probability reaches top_p (at least one)
    auto [sorted, idx] = logits.sort(-1, /*descending=*/false);
    const torch::Tensor cum = sorted.softmax(-1).cumsum(-1);
    torch::Tensor remove = cum <= (1.0 - o.top_p);
    remove.narrow(-1, remove.size(-1) - 1, 1).fill_(false);
    logits = logits.masked_fill(remove.scatter(-1, idx, remove), neg);
  }
  return torch::multinomial(logits.softmax(-1), 1, /*replacement=*/false, gen).squeeze(-1);
}

}  // namespace

GenerateResult generate(ModelState& model, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& o,
                        const std::function<bool(size_t, const std::vector<int64_t>&)>& stop) {
  if (!model.causal_lm)
    throw std::runtime_error("generate: model '" + model.kind + "' does not decode token by token (the llama family does)");
  // Under tp every rank of the model's group runs this with the same prompts and seed, in a node's
  // TpChannel: the split layers' collectives, the logits gathered whole, the same draws.
  if (model.stages)
    throw std::runtime_error("generate: the model is cut into pipeline stages (run.parallel.pp); generation runs on whole "
                             "layers (tp and dp are fine; pp is not supported)");
  if (model.shards)
    throw std::runtime_error("generate: the model's parameters are sharded over the data-parallel ranks (ZeRO stage params); "
                             "not supported (zero.stage states or gradients keep them whole)");
  if (prompts.empty()) throw std::invalid_argument("generate: no prompts");
  if (o.max_new_tokens < 1) throw std::invalid_argument("generate: max_new_tokens must be >= 1");
  if (o.top_p <= 0.0 || o.top_p > 1.0) throw std::invalid_argument("generate: top_p must be in (0, 1]");
  const auto B = static_cast<int64_t>(prompts.size());
  int64_t P = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw std::invalid_argument("generate: an empty prompt (give at least one token, e.g. BOS)");
    P = std::max<int64_t>(P, static_cast<int64_t>(p.size()));
  }
  const int64_t total = P + o.max_new_tokens;
  if (total > model.causal_lm->context)
    throw std::invalid_argument("generate: " + std::to_string(P) + " prompt + " + std::to_string(o.max_new_tokens) +
                                " new tokens exceed the model's " + std::to_string(model.causal_lm->context) + " positions");
  const c10::Device device = model.module->parameters().empty() ? c10::Device(torch::kCPU) : model.module->parameters()[0].device();
  torch::NoGradGuard no_grad;
  const auto t0 = std::chrono::steady_clock::now();

  // Left-padded ids, which positions hold tokens, and each token's position (from its row's first).
  torch::Tensor ids = torch::zeros({B, total}, torch::kLong), valid = torch::zeros({B, total}, torch::kBool);
  for (int64_t b = 0; b < B; ++b) {
    const auto& p = prompts[static_cast<size_t>(b)];
    const int64_t pad = P - static_cast<int64_t>(p.size());
    ids[b].narrow(0, pad, static_cast<int64_t>(p.size())).copy_(torch::tensor(p, torch::kLong));
    valid[b].narrow(0, pad, P - pad).fill_(true);
  }
  ids = ids.to(device), valid = valid.to(device);
  // The additive mask of queries [q0, q0 + t) over keys [0, q0 + t): a key that is a token and not
  // after the query; a padding query sees itself (so its row is finite; no token sees it).
  auto mask_of = [&](int64_t q0, int64_t t) {
    const auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
    const torch::Tensor q = torch::arange(q0, q0 + t, opts).view({1, t, 1}), k = torch::arange(q0 + t, opts).view({1, 1, q0 + t});
    const torch::Tensor ok = ((valid.narrow(1, 0, q0 + t).unsqueeze(1) & (k <= q)) | (k == q));
    return torch::zeros({B, 1, t, q0 + t}, torch::TensorOptions().dtype(torch::kFloat).device(device))
        .masked_fill_(~ok.unsqueeze(1), -std::numeric_limits<float>::infinity());
  };
  auto positions_of = [&](int64_t q0, int64_t t) {  // transformers: cumsum(attention_mask) - 1, padding 1
    const torch::Tensor pos = valid.narrow(1, 0, q0 + t).to(torch::kLong).cumsum(1) - 1;
    return pos.narrow(1, q0, t).masked_fill(~valid.narrow(1, q0, t), 1);
  };

  at::Generator gen = make_cpu_generator(mix_seed({o.seed, 0x67656e6572617465ull /* "generate" */}));
  GenerateResult r;
  r.tokens.assign(static_cast<size_t>(B), {});
  std::vector<bool> done(static_cast<size_t>(B), false);
  KvCache cache;
  int64_t len = P;  // ids [:, :len] are known
  for (int64_t step = 0; step < o.max_new_tokens; ++step) {
    torch::Tensor logits;
    if (o.use_cache) {
      const int64_t q0 = cache.length(), t = len - q0;
      logits = model.causal_lm->decode(model, ids.narrow(1, q0, t), positions_of(q0, t), mask_of(q0, t), cache);
    } else {
      KvCache fresh;
      logits = model.causal_lm->decode(model, ids.narrow(1, 0, len), positions_of(0, len), mask_of(0, len), fresh);
    }
    const torch::Tensor next = pick(logits.select(1, logits.size(1) - 1), o, gen).to(torch::kCPU);
    ids.select(1, len).copy_(next.to(device));
    valid.select(1, len).fill_(true);
    ++len;
    bool all_done = true;
    for (int64_t b = 0; b < B; ++b) {
      if (done[static_cast<size_t>(b)]) continue;
      const int64_t id = next[b].item<int64_t>();
      auto& out = r.tokens[static_cast<size_t>(b)];
      out.push_back(id);
      ++r.new_tokens;
      if (std::find(o.stop_ids.begin(), o.stop_ids.end(), id) != o.stop_ids.end() || (stop && stop(static_cast<size_t>(b), out)))
        done[static_cast<size_t>(b)] = true;
      all_done = all_done && done[static_cast<size_t>(b)];
    }
    if (all_done) break;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace flowrun
