// MD5 as RFC 1321 specifies it (md5.hpp): 64-byte blocks, four rounds of 16 operations each.
#include "formats/md5.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flowrun {

namespace {
constexpr uint32_t kShift[64] = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
                                 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20,
                                 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                                 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};

uint32_t rotl(uint32_t x, uint32_t c) { return (x << c) | (x >> (32 - c)); }

struct Table {  // K[i] = floor(2^32 * |sin(i + 1)|)
  uint32_t k[64];
  Table() {
    for (int i = 0; i < 64; ++i) k[i] = static_cast<uint32_t>(std::floor(4294967296.0 * std::fabs(std::sin(i + 1.0))));
  }
};

void block(uint32_t h[4], const unsigned char* p, const uint32_t* K) {
  uint32_t m[16];
  for (int i = 0; i < 16; ++i)
    m[i] = uint32_t(p[i * 4]) | uint32_t(p[i * 4 + 1]) << 8 | uint32_t(p[i * 4 + 2]) << 16 | uint32_t(p[i * 4 + 3]) << 24;
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
  for (uint32_t i = 0; i < 64; ++i) {
    uint32_t f, g;
    if (i < 16) f = (b & c) | (~b & d), g = i;
    else if (i < 32) f = (d & b) | (~d & c), g = (5 * i + 1) % 16;
    else if (i < 48) f = b ^ c ^ d, g = (3 * i + 5) % 16;
    else f = c ^ (b | ~d), g = (7 * i) % 16;
    const uint32_t t = d;
    d = c, c = b;
    b = b + rotl(a + f + K[i] + m[g], kShift[i]);
    a = t;
  }
  h[0] += a, h[1] += b, h[2] += c, h[3] += d;
}
}  // namespace

std::string md5_hex(std::string_view bytes) {
  static const Table table;
  uint32_t h[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  for (; i + 64 <= n; i += 64) block(h, p + i, table.k);
  // The tail, a 1 bit, zeros, and the length in bits (little-endian), to whole blocks.
  unsigned char last[128] = {};
  const size_t rest = n - i;
  std::memcpy(last, p + i, rest);
  last[rest] = 0x80;
  const size_t total = rest + 9 <= 64 ? 64 : 128;
  const uint64_t bits = static_cast<uint64_t>(n) * 8;
  for (int k = 0; k < 8; ++k) last[total - 8 + static_cast<size_t>(k)] = static_cast<unsigned char>(bits >> (8 * k));
  for (size_t k = 0; k < total; k += 64) block(h, last + k, table.k);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (uint32_t v : h)
    for (int k = 0; k < 4; ++k) {
      const unsigned char byte = static_cast<unsigned char>(v >> (8 * k));
      out += hex[byte >> 4], out += hex[byte & 15];
    }
  return out;
}

}  // namespace flowrun
