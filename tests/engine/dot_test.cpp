// `flowrun dot`: valid Graphviz with the documented styles, rendered by dot -Tsvg.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "dot.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"

using namespace flowrun;

TEST(Dot, StylesAndRendering) {
  test::register_test_nodes();
  const std::string dir = test::temp_dir("dot");
  const std::string file = dir + "/g.yaml";
  std::ofstream(file) << R"(flowrun: 1
name: dotted
plugins: [")" << FLOWRUN_BINARY_DIR << R"(/tests/plugins/libt_plugin_ok.so"]
nodes:
  src: { type: t_source }
  cell: { type: t_cell }
  fwd: { type: t_read, in: { s: cell.cell, in: [src.out] } }
  opt: { type: t_write, in: { s: cell.cell } }
  bwd: { type: t_stream }
  red: { type: t_sink, in: { items: bwd.items } }
  ckpt: { type: t_read, every: 500, at: [end], in: { s: cell.cell } }
  scale: { type: t_plugin_scale, in: { in: src.out } }
)";
  GraphSpec g = load_graph(file, {}, Registry::global());
  const std::string dot = to_dot(g, Registry::global());
  EXPECT_NE(dot.find("digraph \"dotted\""), std::string::npos);
  EXPECT_NE(dot.find("\"src\" [label=\"src : t_source\"]"), std::string::npos) << dot;
  EXPECT_NE(dot.find("\"src\" -> \"fwd\" [label=\"out → in\"]"), std::string::npos) << dot;
  EXPECT_NE(dot.find("\"cell\" -> \"fwd\" [style=dashed, label=\"cell → s (read)\""), std::string::npos) << dot;
  EXPECT_NE(dot.find("\"cell\" -> \"opt\" [style=dashed, label=\"cell → s (write)\", color=\"#c0392b\""), std::string::npos)
      << dot;
  EXPECT_NE(dot.find("\"bwd\" -> \"red\" [style=bold, label=\"items (stream)\"]"), std::string::npos) << dot;
  EXPECT_NE(dot.find("ckpt : t_read\\n(every 500, at end)\", peripheries=2"), std::string::npos) << dot;
  EXPECT_NE(dot.find("scale : t_plugin_scale\\nplugin\", style=\"rounded,filled\""), std::string::npos) << dot;

  // Graphviz must accept it.
  std::ofstream(dir + "/g.dot") << dot;
  const std::string cmd = "dot -Tsvg " + dir + "/g.dot -o " + dir + "/g.svg 2>" + dir + "/dot.err";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "graphviz failed (is the graphviz package installed?)";
  std::ifstream svg(dir + "/g.svg");
  std::stringstream s;
  s << svg.rdbuf();
  EXPECT_NE(s.str().find("<svg"), std::string::npos);
  EXPECT_NE(s.str().find("ckpt : t_read"), std::string::npos);
  std::ifstream err(dir + "/dot.err");
  std::stringstream es;
  es << err.rdbuf();
  EXPECT_EQ(es.str(), "") << "graphviz warnings";
}
