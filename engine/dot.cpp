#include "dot.hpp"

#include <algorithm>
#include <sstream>

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

std::string to_dot(const GraphSpec& g, const Registry& reg) {
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
    const auto plugins = reg.plugins();
    if (std::find(plugins.begin(), plugins.end(), n.origin) != plugins.end()) {
      label += "\\nplugin";
      attrs += ", style=\"rounded,filled\", fillcolor=\"#ffe9c7\", tooltip=" + q(n.origin);
    }
    // label built with "\n" escapes: quote without doubling the backslashes
    o << "  " << q(n.name) << " [label=\"" << label << "\"" << attrs << "];\n";
  }
  for (const auto& n : g.nodes) {
    for (const auto& in : n.inputs) {
      for (const auto& r : in.refs) {
        std::string label = r.port == in.port ? in.port : r.port + " → " + in.port;
        o << "  " << q(r.node) << " -> " << q(n.name) << " [";
        if (in.schema->kind == PortKind::State) {
          const bool w = in.schema->access == Access::Write;
          o << "style=dashed, label=" << q(label + (w ? " (write)" : " (read)"));
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
  o << "}\n";
  return o.str();
}

}  // namespace flowrun
