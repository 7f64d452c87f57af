// The tokenizer nodes' shared part (tokenize.hpp) and encode_texts.
#include "encode/tokenize.hpp"

#include <spdlog/spdlog.h>

#include <stdexcept>

namespace flowrun {

TensorMap encode_texts(const TextTokenizer& tok, const std::vector<std::string>& texts) {
  const int64_t B = static_cast<int64_t>(texts.size()), L = tok.max_length();
  torch::Tensor input_ids = torch::full({B, L}, tok.pad_id(), torch::kInt64);
  torch::Tensor mask = torch::zeros({B, L}, torch::kInt64);
  auto ia = input_ids.accessor<int64_t, 2>();
  auto ma = mask.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t> row = tok.ids(texts[static_cast<size_t>(b)], L);
    for (size_t i = 0; i < row.size() && static_cast<int64_t>(i) < L; ++i) {
      ia[b][static_cast<int64_t>(i)] = row[i];
      ma[b][static_cast<int64_t>(i)] = 1;
    }
  }
  return {{"input_ids", input_ids}, {"attention_mask", mask}};
}

void TokenizeNode::setup(SetupContext& ctx) {
  const Params& p = ctx.params();
  const bool lowercase = p.get<bool>("lowercase");
  try {
    tok_ = load(p.get<std::string>("vocab"), p.get<int64_t>("max_length"), lowercase);
  } catch (const std::exception& e) {
    throw std::runtime_error(ctx.who() + ": " + e.what());
  }
  if (ctx.run().rank == 0)
    spdlog::info("{}: vocab {} ({}), max_length {}{}", ctx.who(), tok_->vocab_size(), p.get<std::string>("vocab"),
                 tok_->max_length(), lowercase ? ", lowercase" : "");
  ctx.own_state("tokenizer", tok_);
}

void TokenizeNode::run(StepContext& ctx) { ctx.out("tokens", encode_texts(*tok_, ctx.in<TextBatch>("text"))); }

}  // namespace flowrun
