// wordpiece_tokenize: captions -> token ids with BERT's WordPiece (formats/wordpiece.hpp).
// Schema: schemas/wordpiece_tokenize.yaml. Test: tests/nodes/tokenize_test.cpp.
#include "encode/tokenize.hpp"
#include "formats/wordpiece.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

class WordPieceTokenizeNode : public TokenizeNode {
  TokenizerFolder folder() const override { return {"vocab.txt", "tokenizer"}; }
  std::shared_ptr<TextTokenizer> load(const std::string& vocab, int64_t max_length, bool lowercase) override {
    return WordPieceTokenizer::load(vocab, max_length, lowercase);
  }
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(wordpiece_tokenize, flowrun::WordPieceTokenizeNode)
