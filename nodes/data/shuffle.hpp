// A seeded shuffle that gives the same order on every platform (std::shuffle and the std
// distributions do not: their algorithms are implementation-defined).
#pragma once
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "common/seed.hpp"

namespace flowrun {

// Fisher-Yates over 0..n-1 driven by a SplitMix64 stream from `seed`.
template <class Int = int64_t>
std::vector<Int> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<Int> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), Int(0));
  uint64_t state = seed;
  for (int64_t i = n - 1; i > 0; --i) {
    const uint64_t r = splitmix64(state);
    state += 0x9E3779B97F4A7C15ull;
    // r * (i + 1) / 2^64: uniform in [0, i] up to a bias of (i + 1) / 2^64 (Lemire).
    const auto j = static_cast<int64_t>((static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

}  // namespace flowrun
