// UTF-8 checked and repaired: see utf8.hpp.
#include "formats/utf8.hpp"

namespace flowrun {

namespace {

// The length of the well-formed sequence at s[i], or 0 with *subpart = the bytes of its maximal
// ill-formed subpart (Unicode's table 3-7 of well-formed byte sequences).
size_t sequence(std::string_view s, size_t i, size_t* subpart) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  if (n == 0) {
    *subpart = 1;
    return 0;
  }
  size_t k = 1;
  for (; k < n && i + k < s.size(); ++k) {
    const unsigned char x = b(i + k);
    if (k == 1 ? (x < lo || x > hi) : (x < 0x80 || x > 0xBF)) break;
  }
  if (k == n) return n;
  *subpart = k;
  return 0;
}

}  // namespace

bool valid_utf8(std::string_view s) {
  for (size_t i = 0, bad = 0; i < s.size();) {
    const size_t n = sequence(s, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string repair_utf8(std::string_view s, int64_t* replaced) {
  std::string out;
  out.reserve(s.size());
  int64_t count = 0;
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    const size_t n = sequence(s, i, &bad);
    if (n) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      ++count;
      i += bad;
    }
  }
  if (replaced) *replaced = count;
  return out;
}

}  // namespace flowrun
