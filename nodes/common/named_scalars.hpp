// A named set of numbers on one port (port type `scalars`): what a node outputs when the count of
// its figures is known only at run time, e.g. one score per prompt (shapes_fidelity). The metrics
// node logs each entry as PORT/NAME; every rank must output the same names in the same order
// (metrics averages entry i over the ranks).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace flowrun {

using NamedScalars = std::vector<std::pair<std::string, double>>;

}  // namespace flowrun
