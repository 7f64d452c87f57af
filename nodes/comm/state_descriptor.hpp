// What a state object looks like, as text every rank can compare: the start-up check of a
// multi-process run (comm/startup.cpp) allgathers a hash of it before broadcasting rank 0's
// tensors, because a broadcast into tensors of another shape would be garbage, not an error.
#pragma once
#include <cstdint>
#include <string>

#include "common/state_io.hpp"

namespace flowrun {

// One line per tensor, in name order: "NAME DTYPE [D0, D1, ...]\n" ("NAME undefined\n" for an
// undefined tensor). Values and devices are left out: they may differ (that is what the
// broadcast fixes, and rank r may hold its copy on GPU r).
std::string describe_tensors(const NamedTensors& tensors);

// The first line where two descriptors differ: "rank 0 has 'w Float [8, 4]' where this rank
// has 'w Float [16, 4]'" ("nothing more" past the end of one); "" when they are equal.
std::string first_difference(const std::string& rank0, const std::string& mine);

// 64-bit FNV-1a of a descriptor (the same on every machine: no std::hash).
uint64_t descriptor_hash(const std::string& descriptor);

}  // namespace flowrun
