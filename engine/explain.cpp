// flowrun explain (explain.hpp): the waits of one step, from the spec alone (no node is built).
#include "explain.hpp"

#include <algorithm>
#include <sstream>

#include "registry.hpp"
#include "spec.hpp"
#include "step_order.hpp"

namespace flowrun {

namespace {

struct Ref {
  int node = -1;
  int64_t step = -1;
};

std::string at(int64_t step, int64_t s) { return step == s ? "@s" : "@s-" + std::to_string(s - step); }

}  // namespace

std::string explain(const GraphSpec& g, const Registry& reg) {
  const size_t n = g.nodes.size();
  // The states and who accesses them, numbered as the executor numbers them.
  std::vector<const NodeSchema*> schema(n);
  for (size_t i = 0; i < n; ++i) {
    const NodeType* t = reg.find(g.nodes[i].type);
    if (!t) throw std::logic_error("explain: node type '" + g.nodes[i].type + "' is not registered");
    schema[i] = &t->schema;
  }
  const StateTable table = number_states(g, schema);
  const std::vector<std::string>& state_name = table.names;
  const std::vector<std::vector<std::pair<int, Access>>>& accesses = table.accesses;

  // Three steps with every node due; the third is the one shown (its waits reach back as far as
  // a previous step can).
  const int64_t s = 3;
  StepOrder<Ref> order(state_name.size(), n);
  std::vector<std::vector<std::string>> waits(n);
  for (int64_t step = 1; step <= s; ++step)
    for (size_t i = 0; i < n; ++i) {
      // (instance, why) in the order found; one entry per instance, its reasons joined.
      std::vector<std::pair<std::string, std::vector<std::string>>> w;
      auto wait = [&](const std::string& target, const std::string& why) {
        auto it = std::find_if(w.begin(), w.end(), [&](const auto& e) { return e.first == target; });
        if (it == w.end()) it = w.insert(w.end(), {target, {}});
        if (std::find(it->second.begin(), it->second.end(), why) == it->second.end()) it->second.push_back(why);
      };
      for (const auto& in : g.nodes[i].inputs) {
        if (in.schema->kind == PortKind::State) continue;
        for (const auto& r : in.refs)
          wait(r.node + "@s", in.schema->kind == PortKind::Stream ? "stream " + r.port + ": each item as it comes, then its end"
                                                                  : r.port);
      }
      const bool stateless = schema[i]->stateless;
      order.admit(static_cast<int>(i), step, stateless, accesses[i], Ref{static_cast<int>(i), step},
                  [&](const Ref& d, Why why, int state) {
                    const NodeSpec& other = g.nodes[static_cast<size_t>(d.node)];
                    // A periodic node's last run may be any earlier step.
                    const std::string target =
                        other.name + (other.schedule.periodic() && d.step < step ? " in its last run" : at(d.step, step));
                    const std::string st = state >= 0 ? state_name[static_cast<size_t>(state)] : "";
                    switch (why) {
                      case Why::previous_step:
                        return wait(target, other.schedule.periodic() ? "its previous run" : "its previous step");
                      case Why::read_after_write: return wait(target, "wrote " + st);
                      case Why::write_after_write: return wait(target, "wrote " + st + " before");
                      case Why::write_after_read: return wait(target, "reads " + st);
                    }
                  });
      if (step != s) continue;
      for (const auto& [target, why] : w) {
        std::string text = target + " (";
        for (size_t k = 0; k < why.size(); ++k) text += (k ? "; " : "") + why[k];
        waits[i].push_back(text + ")");
      }
    }

  const bool compute_thread = g.settings.compute_thread;
  const int prefetch = g.settings.prefetch;
  std::ostringstream o;
  o << g.name << " (" << g.file << "): one step, as the program it runs\n\n"
    << "File order is program order. A node starts when everything it waits for is done; nodes\n"
    << "with no path between them run at the same time, and up to run.prefetch + 1 = " << prefetch + 1
    << " steps are in\nflight (docs/executor.md). @s is this step, @s-1 the one before.\n\n"
    << "for each step s:\n";
  size_t width = 0;
  for (const auto& ns : g.nodes) width = std::max(width, ns.name.size());
  for (size_t i = 0; i < n; ++i) {
    const NodeSpec& ns = g.nodes[i];
    std::string args;
    for (const auto& in : ns.inputs) {
      std::string refs;
      for (const auto& r : in.refs) refs += (refs.empty() ? "" : ", ") + r.str();
      if (in.refs.size() > 1) refs = "[" + refs + "]";
      const char* how = in.schema->kind == PortKind::State
                            ? (in.schema->access == Access::Write ? " writes "
                               : in.schema->setup_write           ? " reads (writes at setup) "
                                                                  : " reads ")
                            : (in.schema->kind == PortKind::Stream ? " streams " : " = ");
      args += (args.empty() ? "" : ", ") + in.port + how + refs;
    }
    std::vector<std::string> where;
    if (ns.schedule.periodic()) where.push_back(ns.schedule.str());
    if (!ns.stream.empty()) where.push_back("device stream " + ns.stream);
    if (schema[i]->compute && compute_thread) where.push_back("compute thread");
    if (schema[i]->stateless) where.push_back("stateless: steps may overlap");
    std::string where_text;
    for (const auto& w : where) where_text += (where_text.empty() ? "" : ", ") + w;
    o << "  " << (i + 1 < 10 ? " " : "") << i + 1 << ". " << ns.name << std::string(width - ns.name.size(), ' ') << " = "
      << ns.type << "(" << args << ")";
    if (!where_text.empty()) o << "   [" << where_text << "]";
    o << "\n";
    std::string made;
    for (const auto& out : schema[i]->outputs)
      if (out.kind == PortKind::State)
        made += (made.empty() ? "" : ", ") + ns.name + "." + out.name +
                (out.access == Access::Write ? " (state, written each step)" : " (state, made at setup)");
    if (!made.empty()) o << "      " << std::string(width, ' ') << "  owns " << made << "\n";
    for (const auto& c : schema[i]->collectives)
      o << "      " << std::string(width, ' ') << "  collectives over the " << c.group << " group"
        << (c.doc.empty() ? "" : ": " + c.doc) << "\n";
    o << "      " << std::string(width, ' ') << "  waits for ";
    if (waits[i].empty()) o << "nothing";
    for (size_t k = 0; k < waits[i].size(); ++k) o << (k ? ", " : "") << waits[i][k];
    o << "\n";
  }
  o << "\nNodes marked [every N] or [at ...] run only in those steps (shown as if due in every step);\n"
    << "a wait for one's last run holds only after it ran. The waits are the executor's own rule\n"
    << "(engine/step_order.hpp): a node waits for its inputs' producers and its previous step (unless\n"
    << "stateless); a read of a state for the last write before it, a write for that write and every\n"
    << "read since.\n";
  return o.str();
}

}  // namespace flowrun
