// The tokenize node: captions (port type `text`, std::vector<std::string>, one per batch row)
// -> token ids (port type `batch`: {"input_ids", "attention_mask"}, int64 [B, max_length]),
// with BERT's WordPiece or a SentencePiece model. Its `tokenizer` state port (type
// `tokenizer`) holds the std::shared_ptr<TextTokenizer>, for samplers that tokenize prompts.
#pragma once
#include <memory>
#include <string>

#include "common/tensor_map.hpp"
#include "encode/text_tokenizer.hpp"

namespace flowrun {

// Port type `text`.
using TextBatch = std::vector<std::string>;

// kind: "wordpiece" (vocab = BERT vocab.txt) or "sentencepiece" (vocab = a .model file).
// Throws std::invalid_argument on another kind.
std::shared_ptr<TextTokenizer> make_text_tokenizer(const std::string& kind, const std::string& vocab,
                                                   int64_t max_length, bool lowercase);

// One row per text: {"input_ids", "attention_mask"}, both int64 [texts.size(), max_length()]
// (1 = token, 0 = padding; padded with pad_id()).
TensorMap encode_texts(const TextTokenizer& tok, const std::vector<std::string>& texts);

}  // namespace flowrun
