// `flowrun dot FILE`: the graph as Graphviz. A box per node "name : type"; value edges solid
// and labelled with their ports; stream edges bold; state accesses dashed, labelled read or
// write (writes red); periodic nodes double-bordered with their schedule; plugin nodes filled.
//
// `flowrun dot --trace TRACE FILE` (a profile, engine/profile.hpp): each node also labelled with
// its mean and p95 time per run, its share of the wall time and how much of it overlapped other
// nodes, and filled by that share (white to red); each edge with the mean time its consumer
// waited on it per run; waits on dependencies the graph does not draw (state order, a previous
// step) as dotted grey edges; the critical path of a typical step bold.
#pragma once
#include <string>

namespace flowrun {
struct GraphSpec;
struct Profile;
class Registry;
std::string to_dot(const GraphSpec& g, const Registry& reg, const Profile* profile = nullptr);
}  // namespace flowrun
