// Schemas: every built-in schema parses; schema mistakes are reported with their place.
#include <gtest/gtest.h>

#include "registry.hpp"
#include "schema.hpp"

using namespace flowrun;

TEST(Schema, EveryBuiltinTypeHasAParsedSchemaWithDocs) {
  // The schemas embedded from schemas/*.yaml (their node types register in flowrun_nodes;
  // tests/nodes/builtin_schemas_test.cpp checks that each has one).
  const auto types = builtin_types();
  ASSERT_GT(types.size(), 10u);
  for (const auto& t : types) {
    const NodeSchema s = parse_node_schema(builtin_schema(t), "schemas/" + t + ".yaml");
    EXPECT_FALSE(s.doc.empty()) << t << ": schema needs a doc line";
    for (const auto& p : s.params) EXPECT_FALSE(p.doc.empty()) << t << "." << p.name << ": parameter needs a doc";
    for (const auto& p : s.inputs) EXPECT_FALSE(p.doc.empty()) << t << " input " << p.name << ": port needs a doc";
    for (const auto& p : s.outputs) EXPECT_FALSE(p.doc.empty()) << t << " output " << p.name << ": port needs a doc";
  }
  EXPECT_NE(graph_schema().run(), nullptr);
}

TEST(Schema, MistakesAreReportedAllAtOnce) {
  try {
    parse_node_schema(R"(type: x
inputs:
  a: { kind: state }
  b: { kind: wire }
params:
  p: { type: enum }
  q: { type: int, default: abc }
  r: { type: float, mn: 0 }
)",
                      "x.yaml");
    FAIL();
  } catch (const GraphError& e) {
    const std::string s = e.diagnostics().str();
    EXPECT_NE(s.find("x.yaml:3:6: inputs.a.access: a state input needs access: read or write"), std::string::npos) << s;
    EXPECT_NE(s.find("inputs.b.kind: kind must be value, state or stream, not 'wire'"), std::string::npos) << s;
    EXPECT_NE(s.find("params.p: an enum parameter needs values"), std::string::npos) << s;
    EXPECT_NE(s.find("params.q.default: expected int, got 'abc'"), std::string::npos) << s;
    EXPECT_NE(s.find("params.r.mn: unknown schema key 'mn' (did you mean 'min'?)"), std::string::npos) << s;
  }
}

TEST(Schema, DescribeListsPortsAndParams) {
  NodeSchema s = parse_node_schema(R"(type: demo
doc: "a demo node"
inputs: { x: { kind: value, type: tensor, doc: "input x" } }
outputs: { s: { kind: state, access: write, type: cursor, doc: "the cursor" } }
params: { lr: { type: float, default: 0.1, min: 0, doc: "learning rate" } })",
                                   "built-in");
  std::string d = describe(s);
  EXPECT_NE(d.find("demo\n  a demo node"), std::string::npos) << d;
  EXPECT_NE(d.find("  x: value tensor\n      input x"), std::string::npos) << d;
  EXPECT_NE(d.find("  s: state (write) cursor"), std::string::npos) << d;
  EXPECT_NE(d.find("  lr: float >= 0, default 0.1\n      learning rate"), std::string::npos) << d;
}
