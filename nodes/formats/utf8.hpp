// UTF-8 checked and repaired, as Python's bytes.decode("utf-8", "replace") and ICU do: each
// maximal ill-formed subpart (a byte that cannot start a sequence, or a sequence cut short) becomes
// one U+FFFD. Captions and names are checked with it before they reach JSON (nlohmann refuses
// invalid UTF-8 with type_error.316) or an Arrow string column (whose readers refuse the file).
//
//   int64_t bad = 0;
//   std::string text = repair_utf8("caf\xe9", &bad);  // "caf\uFFFD", bad = 1
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace flowrun {

// True when s is well-formed UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s);

// s with each maximal ill-formed subpart replaced by U+FFFD; *replaced (if given) gets how many.
std::string repair_utf8(std::string_view s, int64_t* replaced = nullptr);

}  // namespace flowrun
