// The small WordPiece vocab the tokenizer tests share (tests/formats/wordpiece_test.cpp,
// tests/nodes/tokenize_test.cpp).
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include "formats/wordpiece.hpp"
#include "support/run_graph.hpp"

namespace flowrun::test {

using Strings = std::vector<std::string>;

inline const Strings kVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "un",   "##aff", "##able", "hello",
                                      "world", ",",     "!",     "a",     "##a",    "cat", "##s",  "sat",   "on",     "mat",
                                      "cafe",  "中",    "wait",  "—",     "what",   ".",   "runn", "##ing", "run"};

inline WordPieceTokenizer make_wp(int64_t max_length = 16, bool lowercase = true) {
  return WordPieceTokenizer(kVocab, max_length, lowercase, "test vocab");
}

inline std::string write_vocab(const Strings& v) {
  const std::string file = test::temp_dir("tokenize") + "/vocab.txt";
  std::ofstream out(file);
  for (const auto& t : v) out << t << "\n";
  return file;
}

}  // namespace flowrun::test
