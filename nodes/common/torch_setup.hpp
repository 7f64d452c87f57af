// Process-wide tensor-library settings, callable without including torch (the CLI uses it).
#pragma once
#include <cstdint>

namespace flowrun {
// Intra-op threads for tensor math (0 = number of cores) and the global seed.
void configure_torch(int threads, uint64_t seed);
}  // namespace flowrun
