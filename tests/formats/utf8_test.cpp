// UTF-8 checked and repaired as Python's bytes.decode("utf-8", "replace") does (the expected
// strings below are Python's output for the same bytes).
#include <gtest/gtest.h>

#include "formats/utf8.hpp"

namespace flowrun {
namespace {

TEST(Utf8, WellFormedTextIsValidAndUnchanged) {
  for (const std::string s : {"", "plain ascii", "caf\xC3\xA9", "\xE4\xB8\xAD\xE6\x96\x87", "\xF0\x9F\x8E\xA8 emoji",
                              "\xF4\x8F\xBF\xBF"}) {
    EXPECT_TRUE(valid_utf8(s)) << s;
    int64_t n = -1;
    EXPECT_EQ(repair_utf8(s, &n), s);
    EXPECT_EQ(n, 0);
  }
}

// Latin-1 bytes (the caption), overlongs, surrogates, past U+10FFFF, cut short: one
// U+FFFD per maximal ill-formed subpart, as Python's "replace".
TEST(Utf8, EachMaximalIllFormedSubpartBecomesOneReplacementCharacter) {
  const std::string R = "\xEF\xBF\xBD";
  const std::vector<std::tuple<std::string, std::string, int64_t>> cases = {
      {"caf\xE9", "caf" + R, 1},                          // Latin-1 é
      {"\xE9t\xE9", R + "t" + R, 2},
      {"\xC0\xAF", R + R, 2},                             // overlong '/': C0 never starts a sequence
      {"\xED\xA0\x80", R + R + R, 3},                     // a surrogate: ED's second byte stops at 9F
      {"\xF4\x90\x80\x80", R + R + R + R, 4},             // past U+10FFFF
      {"\xE4\xB8", R, 1},                                 // cut short: one for the subpart
      {"a\xF0\x9F\x8E", "a" + R, 1},
      {"\xE4\xB8x\xE4\xB8\xAD", R + "x\xE4\xB8\xAD", 1},  // a good sequence after a bad one is kept
      {"\xFF\xFE", R + R, 2},
  };
  for (const auto& [in, want, count] : cases) {
    EXPECT_FALSE(valid_utf8(in)) << testing::PrintToString(in);
    int64_t n = -1;
    EXPECT_EQ(repair_utf8(in, &n), want) << testing::PrintToString(in);
    EXPECT_EQ(n, count) << testing::PrintToString(in);
    EXPECT_TRUE(valid_utf8(repair_utf8(in)));
  }
}

}  // namespace
}  // namespace flowrun
