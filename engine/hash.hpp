// FNV-1a (64-bit) of a string: stable across runs, processes and platforms. Used where ranks
// compare what they hold (the resolved graph file, state descriptors) and, through
// nodes/common/seed.hpp's name_seed, where a node's name becomes a seed part.
#pragma once
#include <cstdint>
#include <string_view>

namespace flowrun {

// `h`: a hash to go on from (fnv1a(a + b) == fnv1a(b, fnv1a(a))).
inline uint64_t fnv1a(std::string_view s, uint64_t h = 0xcbf29ce484222325ull /* the offset basis */) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;  // the prime
  return h;
}

}  // namespace flowrun
