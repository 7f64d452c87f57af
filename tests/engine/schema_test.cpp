// Schemas: every built-in schema parses; schema mistakes are reported with their place.
#include <gtest/gtest.h>

#include <algorithm>

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

// The registry knows every built-in type from its schema without the node library (what `flowrun
// validate`, `dot`, `explain` and `nodes` use; the engine tests link no node library): checking
// a graph works, and making a node says what is missing.
TEST(Schema, TheRegistryKnowsEveryBuiltinWithoutTheNodeLibrary) {
  Registry& reg = Registry::global();
  for (const auto& t : builtin_types()) {
    const NodeType* type = reg.find(t);
    ASSERT_NE(type, nullptr) << t;
    EXPECT_EQ(type->schema.type, t);
    EXPECT_EQ(type->schema.origin, "built-in");
    EXPECT_FALSE(builtin_type_loaded(t)) << t << ": the engine tests link no node library";
  }
  const auto listed = reg.types();
  for (const auto& t : builtin_types()) EXPECT_NE(std::find(listed.begin(), listed.end(), t), listed.end()) << t;
  EXPECT_TRUE(std::is_sorted(listed.begin(), listed.end()));
  try {
    reg.find("optimizer")->factory();
    FAIL() << "made a built-in node without the node library";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("built-in node type 'optimizer': the node library (libflowrun_nodes.so) is not "
                                         "loaded in this process"),
              std::string::npos)
        << e.what();
  }
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

// `when: { SIBLING: VALUE }`: a parameter (an optimizer rule's settings) that belongs to one
// choice of a sibling enum. Given with another choice: an error naming both; not given: left out
// of the checked parameters; given with its choice: checked and filled as usual. The sibling must
// exist.
TEST(Schema, AParameterOfOneChoiceIsRefusedWithAnother) {
  const NodeSchema s = parse_node_schema(R"(type: demo
doc: "a demo node"
params:
  kind: { type: enum, values: [a, b], default: a, doc: "the choice" }
  a: { type: map, when: { kind: a }, doc: "a's settings", fields: { x: { type: int, default: 1, doc: "x" } } }
  b: { type: map, when: { kind: [b] }, doc: "b's settings", fields: { y: { type: int, default: 2, doc: "y" } } }
)",
                                         "built-in");
  ASSERT_EQ(s.param("a")->when_param, "kind");
  EXPECT_EQ(s.param("b")->when_values, std::vector<std::string>{"b"});
  EXPECT_NE(describe(s).find("a: map, only with kind: a"), std::string::npos) << describe(s);
  auto check = [&](const std::string& with, Diagnostics& d) {
    return check_params(s.params, YAML::Load(with), Mark{"g.yaml", 1, 1}, "g.yaml", "with", d);
  };
  Diagnostics d;
  YAML::Node out = check("{ b: { y: 5 } }", d);  // kind a (the default) with b's settings
  ASSERT_FALSE(d.empty());
  EXPECT_NE(d.str().find("with.b: 'b' applies with kind: b only, and kind is a: drop 'b' (or set it to null), or set kind: b"),
            std::string::npos)
      << d.str();
  Diagnostics dropped;  // null: as if not given (an override can set null, not remove a key)
  out = check("{ b: null }", dropped);
  EXPECT_TRUE(dropped.empty()) << dropped.str();
  EXPECT_FALSE(out["b"]);
  Diagnostics ok;
  out = check("{ kind: b, b: { y: 5 } }", ok);
  EXPECT_TRUE(ok.empty()) << ok.str();
  EXPECT_EQ(out["b"]["y"].as<int>(), 5);
  EXPECT_FALSE(out["a"]);  // the other choice's settings: not filled in
  out = check("{}", ok);
  EXPECT_TRUE(ok.empty()) << ok.str();
  EXPECT_EQ(out["a"]["x"].as<int>(), 1);
  EXPECT_FALSE(out["b"]);
  // A field written one level too high is pointed at its map.
  Diagnostics high;
  check("{ kind: b, y: 5 }", high);
  EXPECT_NE(high.str().find("unknown parameter 'y'; it is a field of a map: did you mean 'b.y'?"), std::string::npos) << high.str();
  try {
    parse_node_schema("type: x\nparams:\n  a: { type: int, when: { mode: on } }\n", "x.yaml");
    FAIL() << "when: naming no sibling must be refused";
  } catch (const GraphError& e) {
    EXPECT_NE(std::string(e.what()).find("'mode' is not a parameter of x: when: names a sibling parameter"), std::string::npos)
        << e.what();
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

// A state input read each step that the node writes once in its setup says so (`setup: write`,
// issue 69: the EMA wrote its memory note on the model through a port declared read only);
// describe, explain and dot show it. Anywhere else it is a schema error.
TEST(Schema, ASetupWriteIsDeclaredOnAReadStateInput) {
  const NodeSchema s = parse_node_schema(R"(type: demo
inputs: { m: { kind: state, access: read, setup: write, type: params } })",
                                         "built-in");
  ASSERT_EQ(s.inputs.size(), 1u);
  EXPECT_TRUE(s.inputs[0].setup_write);
  EXPECT_EQ(s.inputs[0].access, Access::Read);
  EXPECT_NE(describe(s).find("  m: state (read; write at setup) params"), std::string::npos) << describe(s);
  for (const char* bad : {"inputs: { m: { kind: state, access: write, setup: write } }",
                          "inputs: { m: { kind: value, setup: write } }",
                          "outputs: { m: { kind: state, access: write, setup: write } }",
                          "inputs: { m: { kind: state, access: read, setup: read } }"})
    try {
      parse_node_schema(std::string("type: x\n") + bad + "\n", "x.yaml");
      FAIL() << bad;
    } catch (const GraphError& e) {
      EXPECT_NE(e.diagnostics().str().find("setup: write belongs to a state input read each step"), std::string::npos)
          << e.diagnostics().str();
    }
  // The EMA declares its note on the model it averages.
  const NodeSchema ema = parse_node_schema(builtin_schema("ema"), "schemas/ema.yaml");
  EXPECT_TRUE(ema.input("model")->setup_write);
}

// `collectives: { group, doc }` (or a list of them): a node that talks to other ranks says over
// which group of the mesh (world, dp, tp, pp) and what; `flowrun nodes` and `flowrun explain` print it. Another
// group, or a key of its own, is a schema error.
TEST(Schema, CollectivesNameTheirGroupOfTheMesh) {
  const NodeSchema s = parse_node_schema(R"(type: demo
collectives: { group: dp, doc: "gradients averaged" }
inputs: { x: { kind: value, type: tensor } })",
                                         "built-in");
  ASSERT_EQ(s.collectives.size(), 1u);
  EXPECT_EQ(s.collectives[0].group, "dp");
  EXPECT_NE(describe(s).find("collectives: over the dp group: gradients averaged"), std::string::npos) << describe(s);
  EXPECT_TRUE(parse_node_schema("type: quiet\n", "built-in").collectives.empty());
  // A node that talks over several groups lists them.
  const NodeSchema two = parse_node_schema("type: both\ncollectives: [ { group: dp, doc: a }, { group: tp, doc: b } ]\n", "built-in");
  ASSERT_EQ(two.collectives.size(), 2u);
  EXPECT_EQ(two.collectives[1].group, "tp");
  EXPECT_NE(describe(two).find("collectives: over the tp group: b"), std::string::npos) << describe(two);
  try {
    parse_node_schema("type: x\ncollectives: { group: sp, dco: y }\n", "x.yaml");
    FAIL() << "group sp was accepted";
  } catch (const GraphError& e) {
    const std::string d = e.diagnostics().str();
    EXPECT_NE(d.find("collectives is { group: world | dp | tp | pp | ep | edp"), std::string::npos) << d;
    EXPECT_NE(d.find("unknown schema key 'dco' (did you mean 'doc'?)"), std::string::npos) << d;
  }
  // The built-in nodes that exchange anything say so.
  for (const std::string t : {"allreduce", "optimizer", "checkpoint", "metrics", "evaluator"})
    EXPECT_FALSE(parse_node_schema(builtin_schema(t), "schemas/" + t + ".yaml").collectives.empty()) << t;
}

// `family: { tp_divides, alike_blocks }`: a model family that splits over tp and cuts into
// stages says which of its int parameters tp must divide and which counts its blocks when they are
// alike (models/family.hpp has the rest); the planner and forward_backward read it from the
// registry. A name that is not an int parameter of the type, or a key of its own, is a schema error.
TEST(Schema, AFamilyNamesTheSizesTpMustDivideAmongItsIntParameters) {
  const NodeSchema s = parse_node_schema(R"(type: demo
family: { tp_divides: [heads, vocab], alike_blocks: layers }
params:
  heads: { type: int, default: 4 }
  vocab: { type: int, default: 256 }
  layers: { type: int, default: 2 }
)",
                                         "built-in");
  ASSERT_TRUE(s.family.has_value());
  EXPECT_EQ(s.family->tp_divides, (std::vector<std::string>{"heads", "vocab"}));
  EXPECT_EQ(s.family->alike_blocks, "layers");
  EXPECT_NE(describe(s).find("family: splits over tensor parallel (run.parallel.tp dividing heads, vocab)"),
            std::string::npos) << describe(s);
  EXPECT_FALSE(parse_node_schema("type: quiet\n", "built-in").family.has_value());
  try {
    parse_node_schema("type: x\nfamily: { tp_divides: [heads, width], alike: true }\nparams: { heads: { type: int, default: 2 }, "
                      "width: { type: float, default: 1.0 } }\n",
                      "x.yaml");
    FAIL() << "a family naming a float parameter was accepted";
  } catch (const GraphError& e) {
    const std::string d = e.diagnostics().str();
    EXPECT_NE(d.find("'width' is not an int parameter of x"), std::string::npos) << d;
    EXPECT_NE(d.find("unknown schema key 'alike'"), std::string::npos) << d;
  }
  // The built-in families declare themselves; the registry lists them.
  for (const std::string t : {"gpt", "llama", "dit", "cappa"})
    EXPECT_TRUE(parse_node_schema(builtin_schema(t), "schemas/" + t + ".yaml").family.has_value()) << t;
  EXPECT_FALSE(parse_node_schema(builtin_schema("mlp"), "schemas/mlp.yaml").family.has_value());
}

// Shared parameter groups (schemas/groups/NAME.yaml): `groups: [NAME]` adds a group's
// parameters before the type's own; a map parameter with `group: NAME` takes them as fields,
// before its own `fields`. Every built-in group parses, and the types that use one get the
// same parameters, defaults and docs from it.
TEST(Schema, SharedGroupsAreDeclaredOnceAndUsedByName) {
  for (const auto& g : param_group_names()) {
    const ParamGroup* pg = find_param_group(g);
    ASSERT_NE(pg, nullptr) << g;
    EXPECT_FALSE(pg->doc.empty()) << g;
    EXPECT_FALSE(pg->params.empty()) << g;
  }
  ASSERT_NE(find_param_group("autoencoder_kl"), nullptr);
  const NodeSchema s = parse_node_schema(R"(type: demo
doc: "a demo node"
groups: [autoencoder_kl]
params:
  extra: { type: int, default: 1, doc: "own" }
  decoder: { group: autoencoder_kl, nullable: true, default: null, doc: "a map", fields: { weights: { type: string, default: w, doc: "own field" } } }
)",
                                         "demo.yaml");
  // The group's parameters first, in its order (its first: pretrained), then the node's own.
  std::vector<std::string> names = s.param_names();
  EXPECT_EQ(names.front(), "pretrained");
  EXPECT_EQ(names.back(), "decoder");
  const ParamSchema* dec = s.param("decoder");
  ASSERT_NE(dec, nullptr);
  EXPECT_EQ(dec->type, ParamType::Map);
  EXPECT_EQ(dec->field_names().front(), "pretrained");
  EXPECT_EQ(dec->field_names().back(), "weights");
  EXPECT_EQ(s.param("scaling_factor")->default_value.as<double>(), 0.18215);

  // The built-in users agree: vae_encode's parameters are the group's (the sampler decodes
  // with a vae_encode node's state, an input, and has no VAE settings of its own).
  const NodeSchema vae = parse_node_schema(builtin_schema("vae_encode"), "vae_encode");
  for (const auto& p : find_param_group("autoencoder_kl")->params) {
    ASSERT_NE(vae.param(p.name), nullptr) << p.name;
    EXPECT_EQ(vae.param(p.name)->doc, p.doc);
  }

  try {
    parse_node_schema("type: x\ngroups: [autoencoder_k1]\nparams:\n  latent_channels: { type: int, default: 1 }\n", "x.yaml");
    FAIL();
  } catch (const GraphError& e) {
    const std::string m = e.diagnostics().str();
    EXPECT_NE(m.find("no shared parameter group 'autoencoder_k1' (did you mean 'autoencoder_kl'?)"), std::string::npos) << m;
  }
  try {
    parse_node_schema("type: x\ngroups: [autoencoder_kl]\nparams:\n  latent_channels: { type: int, default: 1 }\n", "x.yaml");
    FAIL();
  } catch (const GraphError& e) {
    const std::string m = e.diagnostics().str();
    EXPECT_NE(m.find("x.yaml:4:3: params.latent_channels: parameter 'latent_channels' is declared twice"), std::string::npos) << m;
  }
}
