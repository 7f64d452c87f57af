// `flowrun explain FILE`: the step a graph runs, written out as the sequential program it is
// (file order), each node with where it runs and what it waits for, so a reader sees the whole
// step in one place as in a single-file trainer. The waits are the executor's own rule
// (step_order.hpp), derived for a step in which every node is due.
#pragma once
#include <string>

namespace flowrun {
struct GraphSpec;
class Registry;
std::string explain(const GraphSpec& g, const Registry& reg);
}  // namespace flowrun
