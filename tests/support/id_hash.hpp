// What the tokenizer fixtures keep of a long id sequence instead of the ids
// (tests/fixtures/tokenizers/make_*_fixture.py's fnv32): the low 32 bits of FNV-1a 64 over the ids
// as int32 little-endian, as 8 hex digits.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace flowrun::test {

inline std::string ids_fnv32(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids)
    for (int k = 0; k < 4; ++k) h = (h ^ ((static_cast<uint32_t>(id) >> (8 * k)) & 0xFF)) * 0x100000001b3ull;
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", static_cast<uint32_t>(h));
  return buf;
}

}  // namespace flowrun::test
