#include "dot.hpp"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "profile.hpp"
#include "registry.hpp"
#include "spec.hpp"

namespace flowrun {

static std::string q(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o + "\"";
}

namespace {

std::string duration_label(double us) { return us >= 1000 ? fmt::format("{:.1f} ms", us / 1000) : fmt::format("{:.0f} us", us); }

// White (no share) to red (half the wall time or more).
std::string heat(double share) {
  const int c = 255 - static_cast<int>(std::min(1.0, 2 * share) * 200);
  return fmt::format("#ff{:02x}{:02x}", c, c);
}

}  // namespace

std::string to_dot(const GraphSpec& g, const Registry& reg, const Profile* prof) {
  std::set<std::pair<std::string, std::string>> critical;  // consecutive nodes of the critical path
  std::set<std::string> on_path;
  if (prof) {
    for (size_t k = 0; k < prof->critical_path.size(); ++k) {
      on_path.insert(prof->critical_path[k]);
      if (k > 0) critical.insert({prof->critical_path[k - 1], prof->critical_path[k]});
    }
  }
  std::ostringstream o;
  o << "digraph " << q(g.name) << " {\n"
    << "  rankdir=TB;\n"
    << "  node [shape=box, style=rounded, fontname=\"Helvetica\", fontsize=11];\n"
    << "  edge [fontname=\"Helvetica\", fontsize=9];\n";
  for (const auto& n : g.nodes) {
    std::string label = n.name + " : " + n.type;
    std::string attrs;
    if (n.schedule.periodic()) {
      label += "\\n(" + n.schedule.str() + ")";
      attrs += ", peripheries=2";
    }
    if (!n.stream.empty() && n.stream != "default") label += "\\nstream " + n.stream;
    // The edges between ranks its schema declares (the groups it exchanges over; explain says what).
    if (const NodeType* t = reg.find(n.type); t && !t->schema.collectives.empty()) {
      std::string groups;
      for (const auto& c : t->schema.collectives) groups += (groups.empty() ? "" : ", ") + c.group;
      label += "\\ncollectives: " + groups;
    }
    if (const NodeProfile* np = prof ? prof->node(n.name) : nullptr) {
      label += "\\nmean " + duration_label(np->mean_us) + ", p95 " + duration_label(np->p95_us) +
               fmt::format("\\n{:.1f} % of wall", 100 * np->share);
      if (np->overlapped_us > 0.01 * np->total_us)
        label += fmt::format(", {:.0f} % overlapped", 100 * np->overlapped_us / np->total_us);
      attrs += ", style=\"rounded,filled\", fillcolor=\"" + heat(np->share) + "\"";
      if (on_path.count(n.name)) attrs += ", penwidth=3";
    } else if (prof) {
      label += "\\n(did not run)";
    }
    const auto plugins = reg.plugins();
    if (std::find(plugins.begin(), plugins.end(), n.origin) != plugins.end()) {
      label += "\\nplugin";
      attrs += ", style=\"rounded,filled\", fillcolor=\"#ffe9c7\", tooltip=" + q(n.origin);
    }
    // label built with "\n" escapes: quote without doubling the backslashes
    o << "  " << q(n.name) << " [label=\"" << label << "\"" << attrs << "];\n";
  }
  std::set<std::pair<std::string, std::string>> drawn;
  for (const auto& n : g.nodes) {
    for (const auto& in : n.inputs) {
      for (const auto& r : in.refs) {
        std::string label = r.port == in.port ? in.port : r.port + " → " + in.port;
        const bool first = drawn.insert({r.node, n.name}).second;  // times once per node pair
        if (prof && first) {
          const double w = prof->mean_wait_us(r.node, n.name);
          if (w > 0) label += ", waited " + duration_label(w) + "/run";
        }
        o << "  " << q(r.node) << " -> " << q(n.name) << " [";
        if (prof && first && critical.count({r.node, n.name})) o << "penwidth=3, ";
        if (in.schema->kind == PortKind::State) {
          const bool w = in.schema->access == Access::Write;
          o << "style=dashed, label=" << q(label + (w ? " (write)" : in.schema->setup_write ? " (read; write at setup)" : " (read)"));
          if (w) o << ", color=\"#c0392b\", fontcolor=\"#c0392b\"";
          else o << ", color=\"#2c6fbb\", fontcolor=\"#2c6fbb\"";
        } else if (in.schema->kind == PortKind::Stream) {
          o << "style=bold, label=" << q(label + " (stream)");
        } else {
          o << "label=" << q(label);
        }
        o << "];\n";
      }
    }
  }
  if (prof) {
    // Waits on dependencies the graph does not draw (state order, an earlier step), and
    // critical-path steps between nodes without an edge.
    std::set<std::pair<std::string, std::string>> extra;
    for (const auto& w : prof->waits)
      if (!drawn.count({w.from, w.to})) extra.insert({w.from, w.to});
    for (const auto& c : critical)
      if (!drawn.count(c)) extra.insert(c);
    for (const auto& [from, to] : extra) {
      std::string label = "order";
      const double w = prof->mean_wait_us(from, to);
      if (w > 0) label += ", waited " + duration_label(w) + "/run";
      o << "  " << q(from) << " -> " << q(to) << " [style=dotted, color=\"#888888\", fontcolor=\"#666666\", label="
        << q(label) << (critical.count({from, to}) ? ", penwidth=3" : "") << "];\n";
    }
    o << "  label=" << q(fmt::format("measured: {} steps, {:.2f} s; critical path ({} of {} steps, {}): bold",
                                     prof->steps, prof->wall_us / 1e6, prof->critical_path_steps, prof->steps,
                                     duration_label(prof->critical_path_us)))
      << ";\n";
  }
  o << "}\n";
  return o.str();
}

}  // namespace flowrun
