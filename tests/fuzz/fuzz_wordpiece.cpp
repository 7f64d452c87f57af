// BERT WordPiece: the input is a vocab (one token per line), a NUL byte, then a text (any
// bytes: invalid UTF-8, controls, combining marks, CJK). Without the NUL the whole input is the
// text, tokenized with a fixed vocab. Every id must be in the vocab, at most max_length of
// them, starting with [CLS] and ending with [SEP].
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "formats/wordpiece.hpp"
#include "fuzz_util.hpp"

using namespace flowrun;

namespace {
const std::vector<std::string> kVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "un", "##aff", "##able",
                                         "a", "##a", "cat", "##s", "caf", "##e", "中", ",", "!", "##ing"};
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  std::vector<std::string> vocab = kVocab;
  std::string text = in;
  if (nul != std::string::npos) {
    vocab.clear();
    std::istringstream lines(in.substr(0, nul));
    for (std::string l; std::getline(lines, l);) vocab.push_back(l);
    text = in.substr(nul + 1);
  }
  for (const bool lowercase : {true, false}) {
    std::unique_ptr<WordPieceTokenizer> wp;
    try {
      wp = std::make_unique<WordPieceTokenizer>(vocab, 32, lowercase, "fuzz vocab");
    } catch (const std::runtime_error&) {
      return 0;  // a vocab without the special tokens: refused, as it should be
    }
    const std::vector<int64_t> ids = wp->ids(text, 32);
    FUZZ_CHECK(ids.size() >= 2 && ids.size() <= 32);
    FUZZ_CHECK(ids.front() == wp->cls_id() && ids.back() == wp->sep_id());
    for (int64_t id : ids) FUZZ_CHECK(id >= 0 && id < wp->vocab_size());
    for (const std::string& t : wp->tokenize(text)) FUZZ_CHECK(wp->token_id(t) >= 0);
  }
  return 0;
}
