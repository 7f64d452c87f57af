// CRC32C: RFC 3720's check values (B.4), chaining across every split point, the hardware path
// against the tables and both against a bit-at-a-time reference, and the hex form the manifest stores.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "formats/crc32c.hpp"

namespace flowrun {
namespace {

uint32_t crc32c_bitwise(const unsigned char* p, size_t n, uint32_t crc = 0) {  // the definition, a bit at a time
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int b = 0; b < 8; ++b) crc = crc & 1 ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
  }
  return ~crc;
}

std::vector<unsigned char> crc32c_random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

using Crc32cFn = uint32_t (*)(const void*, size_t, uint32_t);

// The paths this CPU can run: crc32c() as chosen, the tables, and the instruction where it exists.
std::vector<std::pair<const char*, Crc32cFn>> crc32c_paths() {
  std::vector<std::pair<const char*, Crc32cFn>> paths = {{"crc32c", &crc32c}, {"software", &detail::crc32c_software}};
  if (detail::crc32c_hardware_available()) paths.emplace_back("hardware", &detail::crc32c_hardware);
  return paths;
}

TEST(Crc32c, CheckValues) {  // RFC 3720 B.4, and the catalogue's check value for "123456789"
  const std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xff);
  std::vector<unsigned char> up(32), down(32);
  for (int i = 0; i < 32; ++i) up[static_cast<size_t>(i)] = static_cast<unsigned char>(i);
  for (int i = 0; i < 32; ++i) down[static_cast<size_t>(i)] = static_cast<unsigned char>(31 - i);
  for (const auto& [name, f] : crc32c_paths()) {
    SCOPED_TRACE(name);
    EXPECT_EQ(f("123456789", 9, 0), 0xe3069283u);
    EXPECT_EQ(f(zeros.data(), 32, 0), 0x8a9136aau);
    EXPECT_EQ(f(ones.data(), 32, 0), 0x62a8ab43u);
    EXPECT_EQ(f(up.data(), 32, 0), 0x46dd794eu);
    EXPECT_EQ(f(down.data(), 32, 0), 0x113fdb5cu);
    EXPECT_EQ(f("", 0, 0), 0x00000000u);
    EXPECT_EQ(f(nullptr, 0, 0x12345678u), 0x12345678u);  // no bytes: the CRC given back
  }
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the default: from the start
}

TEST(Crc32c, ChainsAtEverySplitPoint) {
  const auto buf = crc32c_random_bytes(300 + 8, 1);
  for (const auto& [name, f] : crc32c_paths()) {
    SCOPED_TRACE(name);
    for (size_t start = 0; start < 8; ++start) {  // unaligned starts
      const unsigned char* p = buf.data() + start;
      for (size_t n = 0; n <= 300; ++n) {
        const uint32_t whole = f(p, n, 0);
        ASSERT_EQ(whole, crc32c_bitwise(p, n)) << "start " << start << " n " << n;
        for (size_t k = 0; k <= n; ++k) ASSERT_EQ(f(p + k, n - k, f(p, k, 0)), whole) << "n " << n << " k " << k;
      }
    }
  }
}

TEST(Crc32c, ChainsAcrossTheStreamBlocks) {  // splits around the three-stream blocks (3 x 8192, 3 x 256)
  const size_t n = 200000;
  const auto buf = crc32c_random_bytes(n, 2);
  const uint32_t whole = crc32c_bitwise(buf.data(), n);
  for (const auto& [name, f] : crc32c_paths()) {
    SCOPED_TRACE(name);
    EXPECT_EQ(f(buf.data(), n, 0), whole);
    for (size_t k : {size_t{1}, size_t{7}, size_t{767}, size_t{768}, size_t{769}, size_t{24575}, size_t{24576},
                     size_t{24577}, size_t{49153}, size_t{100003}, n - 1}) {
      ASSERT_EQ(f(buf.data() + k, n - k, f(buf.data(), k, 0)), whole) << "k " << k;
    }
    uint32_t c = 0;  // many pieces of odd sizes, as a writer feeds it
    for (size_t at = 0, piece = 1; at < n; at += piece, piece = piece * 3 % 10007 + 1)
      c = f(buf.data() + at, std::min(piece, n - at), c);
    EXPECT_EQ(c, whole);
  }
}

TEST(Crc32c, HardwareMatchesSoftware) {
  if (!detail::crc32c_hardware_available()) GTEST_SKIP() << "no SSE4.2 crc32 instruction on this CPU";
  const auto buf = crc32c_random_bytes(100000 + 8, 3);
  auto same = [&](size_t start, size_t n) {
    const unsigned char* p = buf.data() + start;
    const uint32_t sw = detail::crc32c_software(p, n), hw = detail::crc32c_hardware(p, n);
    EXPECT_EQ(hw, sw) << "start " << start << " n " << n;
    return hw == sw;
  };
  for (size_t n = 0; n <= 2000; ++n)  // every tail and the short blocks' edges
    if (!same(n % 8, n)) return;
  for (size_t edge : {size_t{24576}, size_t{49152}, size_t{73728}, size_t{98304}})
    for (size_t n = edge - 20; n <= edge + 20; ++n)
      if (!same(n % 8, n)) return;
  std::mt19937_64 rng(4);
  for (int i = 0; i < 200; ++i)
    if (!same(rng() % 8, rng() % 100001)) return;
  if (!same(0, 100000)) return;
  // A CRC to continue that is not the initial one.
  EXPECT_EQ(detail::crc32c_hardware(buf.data(), 99999, 0xdeadbeefu), detail::crc32c_software(buf.data(), 99999, 0xdeadbeefu));
}

TEST(Crc32c, EnvironmentForcesSoftware) {
  EXPECT_FALSE(detail::crc32c_use_hardware("software"));
  EXPECT_EQ(detail::crc32c_use_hardware(nullptr), detail::crc32c_hardware_available());
  EXPECT_EQ(detail::crc32c_use_hardware(""), detail::crc32c_hardware_available());
  EXPECT_EQ(detail::crc32c_use_hardware("hardware"), detail::crc32c_hardware_available());
}

TEST(Crc32c, HexRoundTrip) {
  EXPECT_EQ(crc32c_hex(0xe3069283u), "e3069283");
  EXPECT_EQ(crc32c_hex(0), "00000000");
  EXPECT_EQ(crc32c_hex(0xabu), "000000ab");
  EXPECT_EQ(crc32c_hex(0xffffffffu), "ffffffff");
  std::mt19937 rng(5);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t v = static_cast<uint32_t>(rng());
    uint32_t back = ~v;
    ASSERT_TRUE(parse_crc32c_hex(crc32c_hex(v), back));
    ASSERT_EQ(back, v);
  }
  uint32_t c = 0;
  EXPECT_TRUE(parse_crc32c_hex("E3069283", c));  // either case
  EXPECT_EQ(c, 0xe3069283u);
}

TEST(Crc32c, HexRejectsWhatIsNotEightHexDigits) {
  for (const std::string& bad : std::vector<std::string>{"", "e306928", "e30692833", "0xe30692", "e306928g", " e306928", "e306928 ",
                                "+e306928", "-e306928", "e306 928", "ffffffffff", std::string("e306\0928", 8)}) {
    uint32_t c = 0x12345678u;
    EXPECT_FALSE(parse_crc32c_hex(bad, c)) << "'" << bad << "'";
    EXPECT_EQ(c, 0x12345678u) << "untouched on failure";
  }
}

}  // namespace
}  // namespace flowrun
