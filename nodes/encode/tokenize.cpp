// tokenize node (see tokenize.hpp and schemas/tokenize.yaml).
#include "encode/tokenize.hpp"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "encode/sentencepiece.hpp"
#include "encode/wordpiece.hpp"
#include "node.hpp"
#include "registry.hpp"

namespace flowrun {

std::shared_ptr<TextTokenizer> make_text_tokenizer(const std::string& kind, const std::string& vocab,
                                                   int64_t max_length, bool lowercase) {
  if (kind == "wordpiece") return WordPieceTokenizer::load(vocab, max_length, lowercase);
  if (kind == "sentencepiece") return SentencePieceTokenizer::load(vocab, max_length, lowercase);
  throw std::invalid_argument("tokenize: unknown kind '" + kind + "' (wordpiece or sentencepiece)");
}

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

namespace {

class TokenizeNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const std::string kind = p.get<std::string>("kind");
    const bool lowercase = p.has("lowercase") ? p.get<bool>("lowercase") : kind == "wordpiece";
    try {
      tok_ = make_text_tokenizer(kind, p.get<std::string>("vocab"), p.get<int64_t>("max_length"), lowercase);
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
    if (ctx.run().rank == 0)
      spdlog::info("{}: {} tokenizer, vocab {} ({}), max_length {}{}", ctx.who(), kind, tok_->vocab_size(),
                   p.get<std::string>("vocab"), tok_->max_length(), lowercase ? ", lowercase" : "");
    ctx.own_state("tokenizer", tok_);
  }

  void run(StepContext& ctx) override { ctx.out("tokens", encode_texts(*tok_, ctx.in<TextBatch>("text"))); }

 private:
  std::shared_ptr<TextTokenizer> tok_;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(tokenize, flowrun::TokenizeNode)
