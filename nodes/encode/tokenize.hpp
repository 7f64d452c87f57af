// The tokenizer nodes: captions (port type `text`, std::vector<std::string>, one per batch row)
// -> token ids (port type `batch`: {"input_ids", "attention_mask"}, int64 [B, max_length]).
// One node type per algorithm, each with its own defaults: wordpiece_tokenize (BERT's
// WordPiece, encode/wordpiece.hpp) and sentencepiece_tokenize (T5/mT5, encode/sentencepiece.hpp).
// Their `tokenizer` state port (type `tokenizer`) holds the std::shared_ptr<TextTokenizer>, for
// samplers and evaluators that tokenize prompts.
#pragma once
#include <memory>
#include <string>

#include "common/tensor_map.hpp"
#include "encode/text_tokenizer.hpp"
#include "node.hpp"

namespace flowrun {

// Port type `text`.
using TextBatch = std::vector<std::string>;

// One row per text: {"input_ids", "attention_mask"}, both int64 [texts.size(), max_length()]
// (1 = token, 0 = padding; padded with pad_id()).
TensorMap encode_texts(const TextTokenizer& tok, const std::vector<std::string>& texts);

// The tokenizer nodes' shared part: the parameters of the `tokenizer` group (vocab, max_length;
// schemas/groups/tokenizer.yaml) and the type's own `lowercase`, the `tokenizer` state, the log
// line, and run(): texts -> tokens. A node type adds how its algorithm loads.
class TokenizeNode : public Node {
 public:
  void setup(SetupContext& ctx) final;
  void run(StepContext& ctx) final;

 protected:
  virtual std::shared_ptr<TextTokenizer> load(const std::string& vocab, int64_t max_length, bool lowercase) = 0;

 private:
  std::shared_ptr<TextTokenizer> tok_;
};

}  // namespace flowrun
