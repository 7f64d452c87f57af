// BERT WordPiece (see wordpiece.hpp). Unicode classes, case mapping and NFD come from ICU.
#include "formats/wordpiece.hpp"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/locid.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>

namespace flowrun {
namespace {

using CodePoints = std::vector<UChar32>;

CodePoints to_code_points(const std::string& utf8) {
  icu::UnicodeString s = icu::UnicodeString::fromUTF8(utf8);  // invalid bytes -> U+FFFD
  CodePoints out;
  out.reserve(static_cast<size_t>(s.length()));
  for (int32_t i = 0; i < s.length(); i = s.moveIndex32(i, 1)) out.push_back(s.char32At(i));
  return out;
}

std::string to_utf8(const CodePoints& cps) {
  icu::UnicodeString s;
  for (UChar32 c : cps) s.append(c);
  std::string out;
  s.toUTF8String(out);
  return out;
}

bool is_whitespace(UChar32 c) {  // HF _is_whitespace
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r') return true;
  return u_charType(c) == U_SPACE_SEPARATOR;
}

bool is_control(UChar32 c) {  // HF _is_control: category C*, but \t \n \r count as whitespace
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (u_charType(c)) {
    case U_CONTROL_CHAR:   // Cc
    case U_FORMAT_CHAR:    // Cf
    case U_UNASSIGNED:     // Cn
    case U_PRIVATE_USE_CHAR:  // Co
    case U_SURROGATE:      // Cs
      return true;
    default:
      return false;
  }
}

bool is_punctuation(UChar32 c) {  // HF _is_punctuation: ASCII non-alphanumeric printables, or P*
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126)) return true;
  switch (u_charType(c)) {
    case U_CONNECTOR_PUNCTUATION:
    case U_DASH_PUNCTUATION:
    case U_START_PUNCTUATION:
    case U_END_PUNCTUATION:
    case U_INITIAL_PUNCTUATION:
    case U_FINAL_PUNCTUATION:
    case U_OTHER_PUNCTUATION:
      return true;
    default:
      return false;
  }
}

bool is_cjk(UChar32 c) {  // HF _is_chinese_char
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

bool is_split_space(UChar32 c) {  // what Python's str.split() splits on, after cleaning
  return c == ' ' || c == 0x2028 || c == 0x2029 || u_charType(c) == U_SPACE_SEPARATOR;
}

// Python's str.lower(), then NFD, then without combining marks (Mn): HF's lowercase +
// _run_strip_accents.
CodePoints lower_strip_accents(const CodePoints& word) {
  icu::UnicodeString s;
  for (UChar32 c : word) s.append(c);
  s.toLower(icu::Locale::getRoot());
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* nfd = icu::Normalizer2::getNFDInstance(err);
  if (U_FAILURE(err)) throw std::runtime_error(std::string("wordpiece: ICU NFD: ") + u_errorName(err));
  icu::UnicodeString d = nfd->normalize(s, err);
  if (U_FAILURE(err)) throw std::runtime_error(std::string("wordpiece: ICU NFD: ") + u_errorName(err));
  CodePoints out;
  for (int32_t i = 0; i < d.length(); i = d.moveIndex32(i, 1)) {
    UChar32 c = d.char32At(i);
    if (u_charType(c) != U_NON_SPACING_MARK) out.push_back(c);
  }
  return out;
}

}  // namespace

std::shared_ptr<WordPieceTokenizer> WordPieceTokenizer::load(const std::string& vocab_txt, int64_t max_length,
                                                             bool lowercase) {
  std::ifstream in(vocab_txt, std::ios::binary);
  if (!in) throw std::runtime_error("wordpiece: cannot read the vocab file " + vocab_txt);
  std::vector<std::string> vocab;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    vocab.push_back(line);
  }
  return std::make_shared<WordPieceTokenizer>(std::move(vocab), max_length, lowercase, vocab_txt);
}

WordPieceTokenizer::WordPieceTokenizer(std::vector<std::string> vocab, int64_t max_length, bool lowercase,
                                       const std::string& source)
    : TextTokenizer(max_length), vocab_(std::move(vocab)), lowercase_(lowercase) {
  if (vocab_.empty()) throw std::runtime_error("wordpiece: " + source + " is empty");
  for (size_t i = 0; i < vocab_.size(); ++i) ids_.emplace(vocab_[i], static_cast<int64_t>(i));  // first wins
  std::string missing;
  auto need = [&](const char* t, int64_t& id) {
    id = token_id(t);
    if (id < 0) missing += std::string(missing.empty() ? "" : ", ") + t;
  };
  need("[UNK]", unk_);
  need("[CLS]", cls_);
  need("[SEP]", sep_);
  need("[PAD]", pad_);
  if (!missing.empty()) throw std::runtime_error("wordpiece: " + source + " lacks the special token(s) " + missing);
  if (max_length < 2)
    throw std::runtime_error("wordpiece: max_length must be at least 2 ([CLS] and [SEP]), got " +
                             std::to_string(max_length));
}

int64_t WordPieceTokenizer::token_id(const std::string& token) const {
  auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

std::vector<std::string> WordPieceTokenizer::basic_tokenize(const std::string& text) const {
  // Clean and isolate CJK characters.
  CodePoints cleaned;
  for (UChar32 c : to_code_points(text)) {
    if (c == 0 || c == 0xFFFD || is_control(c)) continue;
    if (is_whitespace(c)) {
      cleaned.push_back(' ');
    } else if (is_cjk(c)) {
      cleaned.push_back(' ');
      cleaned.push_back(c);
      cleaned.push_back(' ');
    } else {
      cleaned.push_back(c);
    }
  }
  static const char* const kNeverSplit[] = {"[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]"};
  std::vector<std::string> out;
  size_t i = 0;
  while (i < cleaned.size()) {
    while (i < cleaned.size() && is_split_space(cleaned[i])) ++i;
    size_t j = i;
    while (j < cleaned.size() && !is_split_space(cleaned[j])) ++j;
    if (j == i) break;
    CodePoints word(cleaned.begin() + static_cast<std::ptrdiff_t>(i), cleaned.begin() + static_cast<std::ptrdiff_t>(j));
    i = j;
    const std::string as_is = to_utf8(word);
    bool special = false;
    for (const char* s : kNeverSplit)
      if (as_is == s && ids_.count(as_is)) special = true;
    if (special) {
      out.push_back(as_is);
      continue;
    }
    if (lowercase_) word = lower_strip_accents(word);
    // Split on punctuation: each punctuation character is a token of its own.
    CodePoints cur;
    for (UChar32 c : word) {
      if (is_punctuation(c)) {
        if (!cur.empty()) out.push_back(to_utf8(cur));
        cur.clear();
        out.push_back(to_utf8(CodePoints{c}));
      } else {
        cur.push_back(c);
      }
    }
    if (!cur.empty()) out.push_back(to_utf8(cur));
  }
  return out;
}

void WordPieceTokenizer::wordpiece(const std::string& word, std::vector<std::string>& out) const {
  if (ids_.count(word) && (word == "[UNK]" || word == "[SEP]" || word == "[PAD]" || word == "[CLS]" || word == "[MASK]")) {
    out.push_back(word);
    return;
  }
  // Byte offsets of the code points, so that substrings are whole characters.
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(word);
  std::vector<size_t> cut{0};
  for (int32_t i = 0; i < u.length(); i = u.moveIndex32(i, 1)) {
    std::string ch;
    icu::UnicodeString(u.char32At(i)).toUTF8String(ch);
    cut.push_back(cut.back() + ch.size());
  }
  const size_t n = cut.size() - 1;
  if (n > kMaxInputCharsPerWord) {
    out.push_back("[UNK]");
    return;
  }
  std::vector<std::string> pieces;
  size_t start = 0;
  while (start < n) {
    size_t end = n;
    std::string found;
    while (start < end) {
      std::string sub = word.substr(cut[start], cut[end] - cut[start]);
      if (start > 0) sub = "##" + sub;
      if (ids_.count(sub)) {
        found = std::move(sub);
        break;
      }
      --end;
    }
    if (found.empty()) {
      out.push_back("[UNK]");
      return;
    }
    pieces.push_back(std::move(found));
    start = end;
  }
  out.insert(out.end(), pieces.begin(), pieces.end());
}

std::vector<std::string> WordPieceTokenizer::tokenize(const std::string& text) const {
  std::vector<std::string> out;
  for (const std::string& w : basic_tokenize(text)) wordpiece(w, out);
  return out;
}

std::vector<int64_t> WordPieceTokenizer::ids(const std::string& text, int64_t max_length) const {
  if (max_length < 2) throw std::runtime_error("wordpiece: max_length must be at least 2");
  const std::vector<std::string> toks = tokenize(text);
  const size_t keep = std::min(toks.size(), static_cast<size_t>(max_length - 2));
  std::vector<int64_t> out;
  out.reserve(keep + 2);
  out.push_back(cls_);
  for (size_t i = 0; i < keep; ++i) out.push_back(token_id(toks[i]));  // every piece is in the vocab
  out.push_back(sep_);
  return out;
}

std::string WordPieceTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size() || id == cls_ || id == sep_ || id == pad_) continue;
    const std::string& t = vocab_[static_cast<size_t>(id)];
    if (t.rfind("##", 0) == 0 && !out.empty())
      out += t.substr(2);
    else
      out += (out.empty() ? "" : " ") + t;
  }
  return out;
}

}  // namespace flowrun
