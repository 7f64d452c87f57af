// sentencepiece_tokenize: captions -> token ids with a SentencePiece model (T5, mT5;
// encode/sentencepiece.hpp). Schema: schemas/sentencepiece_tokenize.yaml.
// Test: tests/nodes/tokenize_test.cpp.
#include "encode/sentencepiece.hpp"
#include "encode/tokenize.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class SentencePieceTokenizeNode : public TokenizeNode {
  TokenizerFolder folder() const override { return {"spiece.model", "tokenizer_2"}; }
  std::shared_ptr<TextTokenizer> load(const std::string& vocab, int64_t max_length, bool lowercase) override {
    return SentencePieceTokenizer::load(vocab, max_length, lowercase);
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(sentencepiece_tokenize, flowrun::SentencePieceTokenizeNode)
