// Byte tokenizer and GPT-2 byte-level BPE. See tokenizer.hpp; the pre-tokenization regex is in
// gpt2_pretokenize.cpp.
//
// BPE works on token ids, not strings: every byte has an id, and every merge (A, B) of
// merges.txt maps the id pair to the id of A+B, checked against vocab.json at load. Applying
// the lowest-ranked merge present until none applies is then the same procedure as GPT-2's
// encoder.py, without building strings.
#include "formats/tokenizer.hpp"

#include <nlohmann/json.hpp>

#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

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

// ---- GPT-2 loading -----------------------------------------------------------------------------

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::load(const std::string& vocab_json, const std::string& merges_txt) {
  std::unique_ptr<Gpt2Tokenizer> t(new Gpt2Tokenizer());

  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_file(vocab_json, "vocab"));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error("vocab " + vocab_json + ": not valid JSON: " + e.what());
  }
  if (!vocab.is_object() || vocab.empty())
    throw std::runtime_error("vocab " + vocab_json + ": expected a JSON object {token: id}");
  t->id_to_bytes_.assign(vocab.size(), std::string());
  std::vector<bool> seen(vocab.size(), false);
  std::string bytes;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer())
      throw std::runtime_error("vocab " + vocab_json + ": token '" + it.key() + "': id is not an integer");
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= static_cast<int64_t>(vocab.size()) || seen[id])
      throw std::runtime_error("vocab " + vocab_json + ": token '" + it.key() + "': id " + std::to_string(id) +
                               (id >= 0 && id < static_cast<int64_t>(vocab.size()) ? " is used twice" : " is out of range") +
                               " (ids must be 0.." + std::to_string(vocab.size() - 1) + ", each once)");
    if (!unmap_token(it.key(), bytes))
      throw std::runtime_error("vocab " + vocab_json + ": token '" + it.key() +
                               "' has characters outside GPT-2's byte-to-unicode mapping");
    seen[id] = true;
    t->id_to_bytes_[id] = bytes;
    t->bytes_to_id_.emplace(bytes, static_cast<int32_t>(id));
  }
  for (int b = 0; b < 256; ++b) {
    auto it = t->bytes_to_id_.find(std::string(1, static_cast<char>(b)));
    if (it == t->bytes_to_id_.end())
      throw std::runtime_error("vocab " + vocab_json + ": no token for byte " + std::to_string(b) +
                               " (a byte-level BPE vocab has all 256)");
    t->byte_id_[b] = it->second;
  }
  if (auto it = t->bytes_to_id_.find("<|endoftext|>"); it != t->bytes_to_id_.end()) t->eot_ = it->second;

  // merges.txt: "#version: 0.2" then "A B" per line. encoder.py drops the first line and the
  // (empty) last one; we skip a "#version" line and blank lines, which reads the same files.
  std::istringstream merges(read_file(merges_txt, "merges"));
  std::string line, a, b, extra, abytes, bbytes;
  int32_t rank = 0;
  for (int64_t line_no = 1; std::getline(merges, line); ++line_no) {
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    std::istringstream fields(line);
    if (!(fields >> a)) continue;  // blank
    if (!(fields >> b) || (fields >> extra))
      throw std::runtime_error("merges " + merges_txt + ":" + std::to_string(line_no) + ": expected two tokens 'A B', got '" + line + "'");
    if (!unmap_token(a, abytes) || !unmap_token(b, bbytes))
      throw std::runtime_error("merges " + merges_txt + ":" + std::to_string(line_no) + ": '" + line +
                               "' has characters outside GPT-2's byte-to-unicode mapping");
    auto ia = t->bytes_to_id_.find(abytes), ib = t->bytes_to_id_.find(bbytes), iab = t->bytes_to_id_.find(abytes + bbytes);
    if (ia == t->bytes_to_id_.end() || ib == t->bytes_to_id_.end() || iab == t->bytes_to_id_.end())
      throw std::runtime_error("merges " + merges_txt + ":" + std::to_string(line_no) + ": '" + line +
                               "': a token or the merged token is not in " + vocab_json + " (vocab and merges from different models?)");
    // A repeated pair keeps its last rank, like encoder.py's dict(zip(merges, range(...))).
    t->merges_[pair_key(ia->second, ib->second)] = Merge{rank++, iab->second};
  }
  if (rank == 0) throw std::runtime_error("merges " + merges_txt + ": no merges in the file");
  return t;
}

std::optional<int32_t> Gpt2Tokenizer::token_id(std::string_view bytes) const {
  auto it = bytes_to_id_.find(std::string(bytes));
  if (it == bytes_to_id_.end()) return std::nullopt;
  return it->second;
}

// ---- GPT-2 encoding ----------------------------------------------------------------------------

void Gpt2Tokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {  // nothing to merge; the common case for punctuation
    out.push_back(byte_id_[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const std::string key(piece);
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

void Gpt2Tokenizer::encode(std::string_view text, std::vector<int32_t>& out) const {
  for (std::string_view piece : gpt2_pretokenize(text)) bpe(piece, out);
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(id_to_bytes_.size()))
      throw std::out_of_range("gpt2 tokenizer: id " + std::to_string(id) + " is not in the vocab (size " +
                              std::to_string(id_to_bytes_.size()) + ")");
    s += id_to_bytes_[id];
  }
  return s;
}

// ---- factory -----------------------------------------------------------------------------------

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& vocab_json, const std::string& merges_txt) {
  if (name == "byte") return std::make_unique<ByteTokenizer>();
  if (name == "gpt2") {
    if (vocab_json.empty() || merges_txt.empty())
      throw std::invalid_argument("the gpt2 tokenizer needs vocab.json and merges.txt (run scripts/data.sh: data/gpt2/)");
    return Gpt2Tokenizer::load(vocab_json, merges_txt);
  }
  throw std::invalid_argument("unknown tokenizer '" + name + "' (known: byte, gpt2)");
}

}  // namespace flowrun
