// `flowrun dot FILE`: the graph as Graphviz. A box per node "name : type"; value edges solid
// and labelled with their ports; stream edges bold; state accesses dashed, labelled read or
// write (writes red); periodic nodes double-bordered with their schedule; plugin nodes filled.
#pragma once
#include <string>

namespace flowrun {
struct GraphSpec;
class Registry;
std::string to_dot(const GraphSpec& g, const Registry& reg);
}  // namespace flowrun
