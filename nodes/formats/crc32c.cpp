// CRC32C (crc32c.hpp): slicing-by-8 tables on any CPU; on x86-64 with SSE4.2 the crc32 instruction,
// in three streams whose CRCs are joined by shifting over the bytes that follow (the shift tables).
#include "formats/crc32c.hpp"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace flowrun {

namespace {
constexpr uint32_t kCrc32cPoly = 0x82f63b78;  // reflected: bit 31 is x^0

// t[k][b]: the CRC register after byte b and k zero bytes, starting from 0.
struct Crc32cSlices {
  uint32_t t[8][256] = {};
  constexpr Crc32cSlices() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int i = 0; i < 8; ++i) c = c & 1 ? (c >> 1) ^ kCrc32cPoly : c >> 1;
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  }
};
constexpr Crc32cSlices kCrc32cSlices;

// a(x) b(x) mod P(x), reflected. Multiplying by x is one zero bit through the register.
constexpr uint32_t crc32c_multmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = 1u << 31; m; m >>= 1) {
    if (a & m) p ^= b;
    b = b & 1 ? (b >> 1) ^ kCrc32cPoly : b >> 1;
  }
  return p;
}

constexpr uint32_t crc32c_x8n(size_t n) {  // x^(8n) mod P(x): n zero bytes
  uint32_t p = 1u << 31, sq = 1u << 23;     // x^0, x^8
  for (; n; n >>= 1) {
    if (n & 1) p = crc32c_multmodp(sq, p);
    sq = crc32c_multmodp(sq, sq);
  }
  return p;
}

// The register after n zero bytes, from the register before (a linear map: a table per byte of it).
struct Crc32cShift {
  uint32_t t[4][256] = {};
  constexpr explicit Crc32cShift(size_t n) {
    const uint32_t xn = crc32c_x8n(n);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = crc32c_multmodp(xn, b << (8 * k));
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};

inline uint64_t crc32c_load64(const unsigned char* p) {  // little endian, any alignment
  uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

#if defined(__x86_64__)
// Three streams of N bytes at a time: the instruction takes 3 cycles and a core starts one a cycle,
// so one stream alone runs at a third of the speed. N long enough that the two shifts a round
// cost little, short enough that the streams stay in L1.
constexpr size_t kCrc32cLong = 8192, kCrc32cShort = 256;
constexpr Crc32cShift kCrc32cShiftLong(kCrc32cLong), kCrc32cShiftShort(kCrc32cShort);

template <size_t N>
__attribute__((target("sse4.2"))) inline void crc32c_sse42_streams(const unsigned char*& p, size_t& bytes,
                                                                  uint64_t& c0, const Crc32cShift& shift) {
  for (; bytes >= 3 * N; p += 2 * N, bytes -= 3 * N) {
    uint64_t c1 = 0, c2 = 0;  // the registers of the second and third N bytes, from 0
    for (const unsigned char* end = p + N; p < end; p += 8) {
      c0 = _mm_crc32_u64(c0, crc32c_load64(p));
      c1 = _mm_crc32_u64(c1, crc32c_load64(p + N));
      c2 = _mm_crc32_u64(c2, crc32c_load64(p + 2 * N));
    }
    c0 = shift(static_cast<uint32_t>(c0)) ^ c1;
    c0 = shift(static_cast<uint32_t>(c0)) ^ c2;
  }
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const unsigned char* p, size_t bytes, uint32_t crc) {
  uint64_t c = static_cast<uint32_t>(~crc);
  for (; bytes && (reinterpret_cast<uintptr_t>(p) & 7); --bytes) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  crc32c_sse42_streams<kCrc32cLong>(p, bytes, c, kCrc32cShiftLong);
  crc32c_sse42_streams<kCrc32cShort>(p, bytes, c, kCrc32cShiftShort);
  for (; bytes >= 8; p += 8, bytes -= 8) c = _mm_crc32_u64(c, crc32c_load64(p));
  for (; bytes; --bytes) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}
#endif
}  // namespace

namespace detail {

uint32_t crc32c_software(const void* data, size_t bytes, uint32_t crc) {
  const auto& t = kCrc32cSlices.t;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (; bytes >= 8; p += 8, bytes -= 8) {  // 8 bytes, each through the table for its distance to the end
    const uint64_t w = crc32c_load64(p) ^ c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
  }
  for (; bytes; --bytes) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c_hardware(const void* data, size_t bytes, uint32_t crc) {
#if defined(__x86_64__)
  return crc32c_sse42(static_cast<const unsigned char*>(data), bytes, crc);
#else
  return crc32c_software(data, bytes, crc);
#endif
}

bool crc32c_hardware_available() {
#if defined(__x86_64__)
  __builtin_cpu_init();  // harmless when done already; needed if called before the constructors ran
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

bool crc32c_use_hardware(const char* env_value) {
  if (env_value && std::strcmp(env_value, "software") == 0) return false;
  return crc32c_hardware_available();
}

}  // namespace detail

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  static const bool hardware = detail::crc32c_use_hardware(std::getenv("FLOWRUN_CRC32C"));
  return hardware ? detail::crc32c_hardware(data, bytes, crc) : detail::crc32c_software(data, bytes, crc);
}

std::string crc32c_hex(uint32_t crc) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) s[static_cast<size_t>(i)] = kDigits[crc & 0xf];
  return s;
}

bool parse_crc32c_hex(const std::string& text, uint32_t& crc) {
  if (text.size() != 8) return false;
  uint32_t v = 0;
  for (const char ch : text) {
    uint32_t d;
    if (ch >= '0' && ch <= '9') d = static_cast<uint32_t>(ch - '0');
    else if (ch >= 'a' && ch <= 'f') d = static_cast<uint32_t>(ch - 'a' + 10);
    else if (ch >= 'A' && ch <= 'F') d = static_cast<uint32_t>(ch - 'A' + 10);
    else return false;
    v = v << 4 | d;
  }
  crc = v;
  return true;
}

}  // namespace flowrun
