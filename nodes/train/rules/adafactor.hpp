// Adafactor's shape rule (rules/adafactor.cpp), for what else needs it (tests).
#pragma once
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <utility>

namespace flowrun {

// Adafactor's factored dims of a shape: {a, b} = the largest and the second-largest dim (the
// later one first among equals, as numpy's argsort), or {-1, -1} when p is not factored (fewer
// than 2 dims, or the second-largest below min_dim_size_to_factor).
std::pair<int64_t, int64_t> adafactor_factored_dims(c10::IntArrayRef shape, int64_t min_dim_size_to_factor);

}  // namespace flowrun
