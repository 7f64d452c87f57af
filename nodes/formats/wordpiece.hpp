// BERT's WordPiece tokenizer, as Hugging Face transformers' BertTokenizer (slow, Python) does it:
//
//   1. basic tokenizer: drop U+0000, U+FFFD and control characters (Unicode category C*, except
//      \t \n \r), map whitespace (space, \t, \n, \r, category Zs) to a space; put spaces around
//      CJK ideographs; split on whitespace; for each word (unless it is a special token such as
//      [CLS]): if lowercase, lowercase it (ICU full case mapping, like Python's str.lower()),
//      NFD-normalize and drop combining marks (category Mn); split on punctuation (ASCII
//      !-/ :-@ [-` {-~ and Unicode category P*), each punctuation character a token of its own;
//   2. WordPiece: each token, greedy longest-match-first against the vocab, later pieces
//      prefixed with "##"; a token of more than 100 characters, or one that cannot be covered,
//      becomes [UNK] as a whole;
//   3. [CLS] + pieces + [SEP], truncated to max_length keeping [CLS] and [SEP], padded with [PAD].
//
// Difference from BertTokenizer: special tokens are recognized only as whole whitespace-
// separated words ("a [SEP] b"), not glued to other text ("a[SEP]b" is split as text).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "formats/text_tokenizer.hpp"

namespace flowrun {

class WordPieceTokenizer : public TextTokenizer {
 public:
  // vocab_txt: BERT's vocab.txt, one token per line, id = line number (0-based). It must hold
  // [UNK], [CLS], [SEP] and [PAD]. Errors name the file.
  static std::shared_ptr<WordPieceTokenizer> load(const std::string& vocab_txt, int64_t max_length = 77,
                                                  bool lowercase = true);
  // The same from a list of tokens (id = index); `source` names it in errors.
  WordPieceTokenizer(std::vector<std::string> vocab, int64_t max_length, bool lowercase,
                     const std::string& source = "vocab");

  std::string name() const override { return "wordpiece"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(vocab_.size()); }
  int64_t pad_id() const override { return pad_; }
  std::vector<int64_t> ids(const std::string& text, int64_t max_length) const override;
  int64_t eos_id() const override { return sep_; }
  // Tokens joined by spaces, "##" pieces glued to the one before; [CLS], [SEP], [PAD] and ids
  // outside the vocabulary dropped.
  std::string decode(const std::vector<int64_t>& ids) const override;

  // Step 1 alone: the basic tokenizer's tokens (UTF-8).
  std::vector<std::string> basic_tokenize(const std::string& text) const;
  // Steps 1 and 2: the WordPiece tokens ("un", "##aff", "##able", "[UNK]", ...), no specials.
  std::vector<std::string> tokenize(const std::string& text) const;
  // The id of a vocab entry, or -1.
  int64_t token_id(const std::string& token) const;
  const std::string& token(int64_t id) const { return vocab_.at(static_cast<size_t>(id)); }

  int64_t cls_id() const { return cls_; }
  int64_t sep_id() const { return sep_; }
  int64_t unk_id() const { return unk_; }

  static constexpr size_t kMaxInputCharsPerWord = 100;

 private:
  void wordpiece(const std::string& word, std::vector<std::string>& out) const;

  std::vector<std::string> vocab_;
  std::unordered_map<std::string, int64_t> ids_;
  bool lowercase_;
  int64_t unk_ = -1, cls_ = -1, sep_ = -1, pad_ = -1;
};

}  // namespace flowrun
