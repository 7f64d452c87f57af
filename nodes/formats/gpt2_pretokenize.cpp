// GPT-2's pre-tokenization regex (and Llama 3's and Qwen 2's, below), written out by hand (no regex engine: std::regex has no
// \p{L}, and a hand-written scanner is exact and ~50x faster).
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// Every code point falls in exactly one class: whitespace (\s), letter (\p{L}), number
// (\p{N}) or other. At each position the alternatives are tried in order, like the regex:
//   1. an apostrophe followed by s, t, re, ve, m, ll or d (case-sensitive);
//   2-4. an optional single ' ' followed by a run of letters, numbers or others (one class);
//   5. a whitespace run not followed by a non-space: the whole run at the end of the text,
//      else the run minus its last character (which then starts the next piece, e.g. " the");
//   6. otherwise a single whitespace character.
// Classes come from ICU (General_Category L*/N*, and the White_Space property for \s, which
// is what Python's `regex` module - GPT-2's reference - uses).
#include <unicode/uchar.h>

#include <string_view>
#include <vector>

#include "formats/tokenizer.hpp"

namespace flowrun {
namespace {

enum class Cls : uint8_t { Space, Letter, Number, Other };

Cls classify_code_point(UChar32 c) {
  if (u_hasBinaryProperty(c, UCHAR_WHITE_SPACE)) return Cls::Space;
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return Cls::Letter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return Cls::Number;
    default:
      return Cls::Other;
  }
}

// ASCII is nearly all of the text we see: a table avoids the ICU calls for it.
struct AsciiTable {
  Cls cls[128];
  AsciiTable() {
    for (int c = 0; c < 128; ++c) cls[c] = classify_code_point(c);
  }
};
const AsciiTable kAscii;

struct Char {
  Cls cls;
  uint32_t len;  // bytes
};

// The class and UTF-8 length of the character at text[i]. An invalid or truncated sequence
// counts as one byte of class Other (it is still encoded, byte by byte, by the BPE).
Char char_at(std::string_view text, size_t i) {
  const auto b0 = static_cast<uint8_t>(text[i]);
  if (b0 < 0x80) return {kAscii.cls[b0], 1};
  uint32_t len;
  UChar32 cp;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07;
  } else {
    return {Cls::Other, 1};
  }
  if (i + len > text.size()) return {Cls::Other, 1};
  for (uint32_t k = 1; k < len; ++k) {
    const auto b = static_cast<uint8_t>(text[i + k]);
    if ((b & 0xC0) != 0x80) return {Cls::Other, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr UChar32 kMin[5] = {0, 0, 0x80, 0x800, 0x10000};  // reject overlong forms
  if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {Cls::Other, 1};
  return {classify_code_point(cp), len};
}

// Length of a contraction ('s 't 're 've 'm 'll 'd) at text[i] (== '\''), or 0.
size_t contraction_at(std::string_view text, size_t i) {
  const size_t left = text.size() - i - 1;
  if (left >= 1) {
    const char a = text[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (left >= 2) {
      const char b = text[i + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    }
  }
  return 0;
}

// Length of a contraction at text[i] (== '\'') in either case ((?i:'s|'t|'re|'ve|'m|'ll|'d),
// Llama 3's and Qwen 2's), or 0.
size_t contraction_any_case_at(std::string_view text, size_t i) {
  const size_t left = text.size() - i - 1;
  auto lower = [](char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c); };
  if (left >= 1) {
    const char a = lower(text[i + 1]);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (left >= 2) {
      const char b = lower(text[i + 2]);
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    }
  }
  return 0;
}

bool is_cr_or_lf(char c) { return c == '\r' || c == '\n'; }

}  // namespace

// Llama 3's and Qwen 2's pre-tokenization (the Split regex of their tokenizer.json):
//
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// (Qwen 2: \p{N} alone, `max_digits` 1). At each position, in order:
//   1. an apostrophe and s, t, re, ve, m, ll or d, in either case;
//   2. one character that is no letter, number, \r or \n (a space, a tab, punctuation), if a
//      letter follows it, then the run of letters (" word", "(word", "'x");
//   3. up to max_digits numbers;
//   4. an optional single ' ', a run of others (no whitespace, letter or number), and any \r\n
//      after them;
//   5. a whitespace run holding \r or \n: up to and including its last \r or \n;
//   6-7. otherwise as GPT-2's: the whitespace run less its last character when a non-space
//      follows (that character starts the next piece), or the one character.
std::vector<std::string_view> llama3_pretokenize(std::string_view text, int max_digits) {
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  size_t i = 0;
  auto run_of = [&](size_t j, Cls cls) {  // the end of the run of class `cls` starting at j
    while (j < n) {
      const Char d = char_at(text, j);
      if (d.cls != cls) break;
      j += d.len;
    }
    return j;
  };
  while (i < n) {
    const size_t start = i;
    if (text[i] == '\'') {
      if (const size_t len = contraction_any_case_at(text, i)) {
        pieces.push_back(text.substr(start, len));
        i += len;
        continue;
      }
    }
    const Char c = char_at(text, i);
    // 2: [^\r\n\p{L}\p{N}]?\p{L}+
    if (c.cls == Cls::Letter) {
      i = run_of(i, Cls::Letter);
      pieces.push_back(text.substr(start, i - start));
      continue;
    }
    if (c.cls != Cls::Number && !is_cr_or_lf(text[i]) && i + c.len < n && char_at(text, i + c.len).cls == Cls::Letter) {
      i = run_of(i + c.len, Cls::Letter);
      pieces.push_back(text.substr(start, i - start));
      continue;
    }
    // 3: \p{N}{1,max_digits}
    if (c.cls == Cls::Number) {
      i += c.len;
      for (int k = 1; k < max_digits && i < n; ++k) {
        const Char d = char_at(text, i);
        if (d.cls != Cls::Number) break;
        i += d.len;
      }
      pieces.push_back(text.substr(start, i - start));
      continue;
    }
    // 4: ' ?[^\s\p{L}\p{N}]+[\r\n]*'
    size_t j = i;
    if (text[i] == ' ' && i + 1 < n && char_at(text, i + 1).cls == Cls::Other) j = i + 1;
    if (char_at(text, j).cls == Cls::Other) {
      i = run_of(j, Cls::Other);
      while (i < n && is_cr_or_lf(text[i])) ++i;
      pieces.push_back(text.substr(start, i - start));
      continue;
    }
    // Whitespace: the run [start, end), where its last character and its last \r or \n start.
    size_t end = i, last = i, last_newline = n;
    while (end < n) {
      const Char d = char_at(text, end);
      if (d.cls != Cls::Space) break;
      if (is_cr_or_lf(text[end])) last_newline = end;
      last = end;
      end += d.len;
    }
    if (last_newline != n) {
      i = last_newline + 1;  // 5: \s*[\r\n]+
    } else if (end < n && last > start) {
      i = last;  // 6: \s+(?!\S), the last character left for the next piece
    } else {
      i = end == n ? end : start + c.len;  // 6 at the end of the text, else 7: one character
    }
    pieces.push_back(text.substr(start, i - start));
  }
  return pieces;
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const size_t start = i;
    if (text[i] == '\'') {
      if (size_t len = contraction_at(text, i)) {
        pieces.push_back(text.substr(start, len));
        i += len;
        continue;
      }
    }
    Char c = char_at(text, i);
    // 2-4: " ?" then a run of one class (letters, numbers or others).
    size_t run = i;
    if (text[i] == ' ' && i + 1 < n) {
      Char next = char_at(text, i + 1);
      if (next.cls != Cls::Space) run = i + 1, c = next;
    }
    if (c.cls != Cls::Space) {
      const Cls cls = c.cls;
      i = run + c.len;
      while (i < n) {
        Char d = char_at(text, i);
        if (d.cls != cls) break;
        i += d.len;
      }
      pieces.push_back(text.substr(start, i - start));
      continue;
    }
    // 5-6: whitespace. Find the run and where its last character starts.
    size_t last = i;
    i += c.len;
    while (i < n) {
      Char d = char_at(text, i);
      if (d.cls != Cls::Space) break;
      last = i;
      i += d.len;
    }
    // Followed by a non-space: leave the last whitespace character for the next piece
    // (so " word" keeps its space), unless the run is a single character.
    if (i < n && last > start) i = last;
    pieces.push_back(text.substr(start, i - start));
  }
  return pieces;
}

}  // namespace flowrun
