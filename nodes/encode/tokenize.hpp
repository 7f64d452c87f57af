// The tokenizer nodes: captions (port type `text`, std::vector<std::string>, one per batch row)
// -> token ids (port type `batch`: {"input_ids", "attention_mask"}, int64 [B, max_length]).
// One node type per algorithm, each with its own defaults: wordpiece_tokenize (BERT's
// WordPiece, formats/wordpiece.hpp) and sentencepiece_tokenize (T5/mT5, encode/sentencepiece.hpp).
// Their `tokenizer` state port (type `tokenizer`) holds the std::shared_ptr<TextTokenizer>, for
// samplers and evaluators that tokenize prompts.
#pragma once
#include <memory>
#include <string>

#include "common/tensor_map.hpp"
#include "formats/text_tokenizer.hpp"
#include "node.hpp"

namespace flowrun {

// Port type `text`.
using TextBatch = std::vector<std::string>;

// One row per text: {"input_ids", "attention_mask"}, both int64 [texts.size(), max_length()]
// (1 = token, 0 = padding; padded with pad_id()).
TensorMap encode_texts(const TextTokenizer& tok, const std::vector<std::string>& texts);

// Where a tokenizer's file is in folders that transformers and diffusers save: the file's name
// in a tokenizer folder ("vocab.txt") and the component a pipeline keeps it in ("tokenizer").
struct TokenizerFolder {
  std::string file, component;
};

// `vocab` as a tokenizer node takes it: the file itself, a tokenizer folder holding `where.file`,
// or a pipeline's folder (model_index.json) whose `where.component` holds it. Returns the
// file's path; `folder` gets the folder it was found in ("" for a file). Errors name the path.
std::string tokenizer_file(const std::string& vocab, const TokenizerFolder& where, std::string* folder);

// The tokenizer nodes' shared part: the parameters of the `tokenizer` group (vocab, max_length;
// schemas/groups/tokenizer.yaml) and the type's own `lowercase` (from the folder's
// tokenizer_config.json do_lower_case where it has one: a value written in the graph must
// agree), the `tokenizer` state, the log line, and run(): texts -> tokens. A node type adds how
// its algorithm loads and where its file sits in a folder.
class TokenizeNode : public Node {
 public:
  void setup(SetupContext& ctx) final;
  void run(StepContext& ctx) final;

 protected:
  virtual std::shared_ptr<TextTokenizer> load(const std::string& vocab, int64_t max_length, bool lowercase) = 0;
  virtual TokenizerFolder folder() const = 0;

 private:
  std::shared_ptr<TextTokenizer> tok_;
};

}  // namespace flowrun
