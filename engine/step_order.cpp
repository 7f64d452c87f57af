// The run's states, numbered (step_order.hpp).
#include "step_order.hpp"

#include "spec.hpp"

namespace flowrun {

StateTable number_states(const GraphSpec& g, const std::vector<const NodeSchema*>& schemas) {
  StateTable t;
  t.owned.resize(g.nodes.size());
  t.accesses.resize(g.nodes.size());
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (const auto& in : g.nodes[i].inputs)
      if (in.schema->kind == PortKind::State)
        for (const auto& r : in.refs)
          t.accesses[i].push_back({t.owned[static_cast<size_t>(r.node_index)].at(r.port), in.schema->access});
    for (const auto& o : schemas[i]->outputs)
      if (o.kind == PortKind::State) {
        const int id = static_cast<int>(t.names.size());
        t.owned[i][o.name] = id;
        t.names.push_back(g.nodes[i].name + "." + o.name);
        if (o.access == Access::Write) t.accesses[i].push_back({id, Access::Write});
      }
  }
  return t;
}

}  // namespace flowrun
