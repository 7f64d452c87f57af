// Byte tokenizer and byte-level BPE (GPT-2's files here; tokenizer.json in tokenizer_json.cpp).
// See tokenizer.hpp; the pre-tokenization regexes are in gpt2_pretokenize.cpp.
//
// BPE works on token ids, not strings: every byte has an id, and every merge (A, B) of
// merges.txt maps the id pair to the id of A+B, checked against vocab.json at load. Applying
// the lowest-ranked merge present until none applies is then the same procedure as GPT-2's
// encoder.py, without building strings.
#include "formats/tokenizer.hpp"

#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "formats/utf8.hpp"

namespace flowrun {

// ---- byte ----------------------------------------------------------------------------------

void ByteTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  out.reserve(out.size() + text.size());
  for (char ch : text) out.push_back(static_cast<uint8_t>(ch));
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id > 255) throw std::out_of_range("byte tokenizer: id " + std::to_string(id) + " is not a byte");
    s.push_back(static_cast<char>(id));
  }
  return s;
}

// ---- GPT-2 byte <-> unicode mapping ----------------------------------------------------------

namespace {

// bytes_to_unicode() of GPT-2's encoder.py: printable Latin-1 bytes ('!'..'~', '¡'..'¬',
// '®'..'ÿ') stand for themselves; the other 68 bytes get U+0100.. in byte order.
struct ByteUnicodeTables {
  uint32_t to_unicode[256];
  int16_t from_unicode[256 + 68];  // code point -> byte, -1 if none
  ByteUnicodeTables() {
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    for (auto& v : from_unicode) v = -1;
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      to_unicode[b] = printable(b) ? static_cast<uint32_t>(b) : 256 + n++;
      from_unicode[to_unicode[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteUnicodeTables kBytes;

// A vocab/merges token (UTF-8 text of mapped characters) back to the raw bytes it stands for.
// Tokens made of other characters ("<|endoftext|>" is plain ASCII, which maps to itself) are
// fine; a character outside the mapping is not.
bool unmap_token(std::string_view s, std::string& out) {
  out.clear();
  for (size_t i = 0; i < s.size();) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    uint32_t cp, len;
    if (b0 < 0x80) {
      cp = b0, len = 1;
    } else if ((b0 & 0xE0) == 0xC0 && i + 1 < s.size()) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(s[i + 1]) & 0x3Fu), len = 2;
    } else {
      return false;  // the mapping only uses U+0000..U+0143: 1 or 2 UTF-8 bytes
    }
    if (cp >= sizeof(kBytes.from_unicode) / sizeof(kBytes.from_unicode[0]) || kBytes.from_unicode[cp] < 0) return false;
    out.push_back(static_cast<char>(kBytes.from_unicode[cp]));
    i += len;
  }
  return true;
}

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string(what) + " " + path + ": cannot open (run scripts/data.sh to fetch GPT-2's files)");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

uint32_t gpt2_byte_to_unicode(uint8_t b) { return kBytes.to_unicode[b]; }

// ---- loading: the parts both loaders share ----------------------------------------------------

void BpeTokenizer::add_vocab(const std::string& token, int64_t id, const std::string& where) {
  std::string bytes;
  if (!unmap_token(token, bytes))
    throw std::runtime_error(where + ": token '" + token + "' has characters outside GPT-2's byte-to-unicode mapping");
  if (id < 0 || id > std::numeric_limits<int32_t>::max())
    throw std::runtime_error(where + ": token '" + token + "': id " + std::to_string(id) + " is out of range");
  if (static_cast<size_t>(id) >= id_to_bytes_.size()) id_to_bytes_.resize(id + 1);
  auto [it, fresh] = bytes_to_id_.emplace(bytes, static_cast<int32_t>(id));
  if (!fresh || !id_to_bytes_[id].empty())
    throw std::runtime_error(where + ": token '" + token + "' (id " + std::to_string(id) +
                             "): the token or its id is given twice (each token once, each id once)");
  id_to_bytes_[id] = bytes;
}

void BpeTokenizer::finish_vocab(const std::string& where) {
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id_.end())
      throw std::runtime_error(where + ": no token for byte " + std::to_string(b) + " (a byte-level BPE vocab has all 256)");
    byte_id_[b] = it->second;
  }
}

void BpeTokenizer::add_merge(const std::string& a, const std::string& b, const std::string& where) {
  std::string abytes, bbytes;
  if (!unmap_token(a, abytes) || !unmap_token(b, bbytes))
    throw std::runtime_error(where + ": '" + a + " " + b + "' has characters outside GPT-2's byte-to-unicode mapping");
  auto ia = bytes_to_id_.find(abytes), ib = bytes_to_id_.find(bbytes), iab = bytes_to_id_.find(abytes + bbytes);
  if (ia == bytes_to_id_.end() || ib == bytes_to_id_.end() || iab == bytes_to_id_.end())
    throw std::runtime_error(where + ": '" + a + " " + b +
                             "': a token or the merged token is not in the vocab (vocab and merges from different models?)");
  // A repeated pair keeps its last rank, like encoder.py's dict(zip(merges, range(...))).
  merges_[pair_key(ia->second, ib->second)] = Merge{next_rank_++, iab->second};
}

// ---- GPT-2's own files -------------------------------------------------------------------------

std::unique_ptr<BpeTokenizer> BpeTokenizer::load_gpt2(const std::string& vocab_json, const std::string& merges_txt) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->name_ = "gpt2";

  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_file(vocab_json, "vocab"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("vocab " + vocab_json + ": not valid JSON: " + e.what());
  }
  if (!vocab.is_object() || vocab.empty())
    throw std::runtime_error("vocab " + vocab_json + ": expected a JSON object {token: id}");
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer())
      throw std::runtime_error("vocab " + vocab_json + ": token '" + it.key() + "': id is not an integer");
    t->add_vocab(it.key(), it.value().get<int64_t>(), "vocab " + vocab_json);
  }
  if (t->id_to_bytes_.size() != vocab.size())
    throw std::runtime_error("vocab " + vocab_json + ": id " + std::to_string(t->id_to_bytes_.size() - 1) +
                             " is out of range (ids must be 0.." + std::to_string(vocab.size() - 1) + ", each once)");
  t->finish_vocab("vocab " + vocab_json);
  if (auto id = t->token_id("<|endoftext|>")) t->eot_ = *id;

  // merges.txt: "#version: 0.2" then "A B" per line. encoder.py drops the first line and the
  // (empty) last one; we skip a "#version" line and blank lines, which reads the same files.
  std::istringstream merges(read_file(merges_txt, "merges"));
  std::string line, a, b, extra;
  for (int64_t line_no = 1; std::getline(merges, line); ++line_no) {
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    std::istringstream fields(line);
    if (!(fields >> a)) continue;  // blank
    const std::string where = "merges " + merges_txt + ":" + std::to_string(line_no);
    if (!(fields >> b) || (fields >> extra)) throw std::runtime_error(where + ": expected two tokens 'A B', got '" + line + "'");
    t->add_merge(a, b, where);
  }
  if (t->next_rank_ == 0) throw std::runtime_error("merges " + merges_txt + ": no merges in the file");
  return t;
}

std::optional<int32_t> BpeTokenizer::token_id(std::string_view bytes) const {
  auto it = bytes_to_id_.find(std::string(bytes));
  if (it == bytes_to_id_.end()) return std::nullopt;
  return it->second;
}

std::optional<int32_t> BpeTokenizer::added_token_id(std::string_view content) const {
  for (const auto* list : {&added_raw_, &added_normalized_})
    for (const AddedToken& t : *list)
      if (t.content == content) return t.id;
  return std::nullopt;
}

// ---- encoding -----------------------------------------------------------------------------------

void BpeTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {  // nothing to merge; the common case for punctuation
    out.push_back(byte_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const std::string key(piece);
  if (ignore_merges_) {  // tokenizers' BPE: a piece that is itself in the vocab is one token
    if (auto it = bytes_to_id_.find(key); it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = cache_.find(key); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word;
  word.reserve(piece.size());
  for (char ch : piece) word.push_back(byte_id_[static_cast<uint8_t>(ch)]);
  std::vector<int32_t> next;
  next.reserve(word.size());
  while (word.size() > 1) {
    // The adjacent pair with the lowest rank; none left: done.
    const Merge* best = nullptr;
    int32_t first = 0, second = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      auto it = merges_.find(pair_key(word[i], word[i + 1]));
      if (it != merges_.end() && (!best || it->second.rank < best->rank)) {
        best = &it->second;
        first = word[i], second = word[i + 1];
      }
    }
    if (!best) break;
    // Merge every occurrence, left to right, without overlaps (as encoder.py does).
    next.clear();
    for (size_t i = 0; i < word.size();) {
      if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
        next.push_back(best->merged);
        i += 2;
      } else {
        next.push_back(word[i++]);
      }
    }
    word.swap(next);
  }
  out.insert(out.end(), word.begin(), word.end());
  std::lock_guard<std::mutex> lock(cache_mu_);
  // Bounded: natural text has a few hundred thousand distinct words; a pathological input
  // (random bytes) must not grow the cache without limit.
  if (cache_.size() >= (1u << 20)) cache_.clear();
  cache_.emplace(key, std::move(word));
}

template <class Piece, class Token>
void BpeTokenizer::split_added(std::string_view text, const std::vector<AddedToken>& tokens, Piece piece, Token token) {
  // Few added tokens (Llama 3: 256, all starting with "<|"): at each position, the longest that
  // starts there. The first byte of every token prefilters the positions.
  if (tokens.empty()) {
    if (!text.empty()) piece(text);
    return;
  }
  bool first_byte[256] = {};
  for (const AddedToken& t : tokens) first_byte[static_cast<uint8_t>(t.content[0])] = true;
  size_t done = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!first_byte[static_cast<uint8_t>(text[i])]) continue;
    const AddedToken* longest = nullptr;
    for (const AddedToken& t : tokens)
      if (text.compare(i, t.content.size(), t.content) == 0 && (!longest || t.content.size() > longest->content.size()))
        longest = &t;
    if (!longest) continue;
    if (i > done) piece(text.substr(done, i - done));
    token(*longest);
    done = i + longest->content.size();
    i = done - 1;
  }
  if (done < text.size()) piece(text.substr(done));
}

// The normalizer's output for text between added tokens: NFC, or the text as is.
namespace {
std::string nfc(std::string_view text) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(err);
  const icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  if (U_SUCCESS(err) && n->isNormalized(u, err) && U_SUCCESS(err)) return std::string(text);
  err = U_ZERO_ERROR;
  const icu::UnicodeString normalized = n->normalize(u, err);
  if (U_FAILURE(err)) throw std::runtime_error(std::string("NFC normalization failed: ") + u_errorName(err));
  std::string out;
  normalized.toUTF8String(out);
  return out;
}
}  // namespace

template <class Text, class Token>
void BpeTokenizer::walk(std::string_view text, Text on_text, Token on_token) const {
  std::string repaired;
  if (repair_utf8_ && !valid_utf8(text)) text = repaired = repair_utf8(text);
  // tokenizers' order: the added tokens matched in the raw text first, then each stretch
  // between them normalized, then those matched in the normalized text.
  split_added(
      text, added_raw_,
      [&](std::string_view stretch) {
        std::string normalized;
        if (nfc_) stretch = normalized = nfc(stretch);
        split_added(stretch, added_normalized_, on_text, on_token);
      },
      on_token);
}

std::string BpeTokenizer::normalize(std::string_view text) const {
  std::string out;
  walk(text, [&](std::string_view piece) { out += piece; }, [&](const AddedToken& t) { out += t.content; });
  return out;
}

void BpeTokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  walk(text, [&](std::string_view piece) { encode_normalized(piece, out); }, [&](const AddedToken& t) { out.push_back(t.id); });
}

void BpeTokenizer::encode_normalized(std::string_view text, std::vector<int32_t>& out) const {
  if (pretokenizer_ == Pretokenizer::Gpt2) {
    for (std::string_view piece : gpt2_pretokenize(text)) bpe(piece, out);
  } else {
    for (std::string_view piece : llama3_pretokenize(text, max_digits_)) bpe(piece, out);
  }
}

const std::string& BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_bytes_.size()) || (id_to_bytes_[id].empty()))
    throw std::out_of_range(name_ + " tokenizer: id " + std::to_string(id) + " is not in the vocab (size " +
                            std::to_string(id_to_bytes_.size()) + ")");
  return id_to_bytes_[id];
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) s += token_bytes(id);
  return s;
}

// ---- factory -----------------------------------------------------------------------------------

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec, const std::string& vocab_json, const std::string& merges_txt) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  if (spec == "gpt2") {
    if (vocab_json.empty() || merges_txt.empty())
      throw std::invalid_argument("the gpt2 tokenizer needs vocab.json and merges.txt (run scripts/data.sh: data/gpt2/)");
    return BpeTokenizer::load_gpt2(vocab_json, merges_txt);
  }
  std::error_code ec;
  if (std::filesystem::is_directory(spec, ec) || std::filesystem::is_regular_file(spec, ec)) return BpeTokenizer::load_hf(spec);
  throw std::invalid_argument("unknown tokenizer '" + spec +
                              "' (known: byte, gpt2, or the path of a tokenizer.json or of a folder holding one)");
}

}  // namespace flowrun
