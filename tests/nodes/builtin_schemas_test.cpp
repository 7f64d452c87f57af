// The built-in node types of nodes/: registered from their schemas/TYPE.yaml, constructible,
// and documented (every port and parameter has a doc line, `flowrun nodes TYPE` prints them).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "registry.hpp"
#include "schema.hpp"

namespace flowrun {
namespace {

// Every schemas/TYPE.yaml but graph.yaml is a built-in node type: read the list from the folder
// so a new node cannot be left out of this test.
std::vector<std::string> builtin_types() {
  std::vector<std::string> types;
  for (const auto& e : std::filesystem::directory_iterator(FLOWRUN_SOURCE_DIR "/schemas"))
    if (e.path().extension() == ".yaml" && e.path().stem() != "graph") types.push_back(e.path().stem().string());
  return types;
}

void expect_documented(const std::string& type, const std::vector<ParamSchema>& params, const std::string& path) {
  for (const auto& p : params) {
    EXPECT_FALSE(p.doc.empty()) << type << ": parameter " << path << p.name << " has no doc";
    expect_documented(type, p.fields, path + p.name + ".");
  }
}

TEST(BuiltinSchemas, EveryTypeIsRegisteredAndDocumented) {
  const auto types = builtin_types();
  EXPECT_GE(types.size(), 11u);
  for (const std::string& type : types) {
    const NodeType* t = Registry::global().find(type);
    ASSERT_NE(t, nullptr) << type << " is not registered";
    EXPECT_EQ(t->schema.type, type);
    EXPECT_EQ(t->schema.origin, "built-in");
    EXPECT_FALSE(t->schema.doc.empty()) << type;
    for (const auto* ports : {&t->schema.inputs, &t->schema.outputs})
      for (const auto& p : *ports) EXPECT_FALSE(p.doc.empty()) << type << ": port " << p.name << " has no doc";
    expect_documented(type, t->schema.params, "");
    // A map with fields and no default is filled from its fields' defaults (check_params), so
    // those fields must have defaults.
    for (const auto& p : t->schema.params) {
      const bool from_fields = p.type == ParamType::Map && !p.fields.empty() &&
                               std::all_of(p.fields.begin(), p.fields.end(), [](const ParamSchema& f) { return f.has_default; });
      EXPECT_TRUE(p.has_default || p.required || from_fields)
          << type << ": parameter " << p.name << " has neither default nor required";
    }
    ASSERT_TRUE(t->factory) << type;
    EXPECT_NE(t->factory(), nullptr) << type;
    EXPECT_NE(describe(t->schema).find(type), std::string::npos);
  }
}

TEST(BuiltinSchemas, StateAndValuePortsAsDocumented) {
  auto* fb = Registry::global().find("forward_backward");
  ASSERT_NE(fb, nullptr);
  const PortSchema* model = fb->schema.input("model");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->kind, PortKind::State);
  EXPECT_EQ(model->access, Access::Read);  // forward_backward never writes parameters
  auto* opt = Registry::global().find("optimizer");
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->schema.input("model")->access, Access::Write);
  EXPECT_EQ(opt->schema.output("state")->access, Access::Write);
  auto* ema = Registry::global().find("ema");
  ASSERT_NE(ema, nullptr);
  EXPECT_EQ(ema->schema.input("model")->access, Access::Read);
  auto* metrics = Registry::global().find("metrics");
  ASSERT_NE(metrics, nullptr);
  const PortSchema* any = metrics->schema.input("whatever_name");
  ASSERT_NE(any, nullptr);
  EXPECT_TRUE(any->optional);
  EXPECT_EQ(any->kind, PortKind::Value);
}

}  // namespace
}  // namespace flowrun
