// Plugins: loading, the ABI check, and one-line errors that name the file.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "plugin.hpp"
#include "plugin_api.hpp"  // FLOWRUN_ABI_VERSION
#include "registry.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"

using namespace flowrun;

namespace {

std::string plugin(const std::string& name) { return std::string(FLOWRUN_BINARY_DIR) + "/tests/plugins/lib" + name + ".so"; }

std::string load_error(const std::string& path) {
  try {
    load_plugin(path, Registry::global());
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Plugin, GraphLoadsPluginRelativeToTheFileAndRunsItsNode) {
  test::register_test_nodes();
  // The graph sits next to the plugin and names it by a relative path.
  const std::string dir = std::string(FLOWRUN_BINARY_DIR) + "/tests/plugins";
  const std::string file = dir + "/uses_plugin.yaml";
  std::ofstream(file) << R"(flowrun: 1
run: { steps: 3, progress: off }
plugins: [libt_plugin_ok.so]
nodes:
  src: { type: t_source, with: { k: 5 } }
  scale: { type: t_plugin_scale, in: { in: src.out }, with: { k: 3 } }
  op: { type: t_op, in: { in: [scale.out] } }
)";
  test::Recorder::get().clear();
  GraphSpec g = load_graph(file, {"run.out_dir=" + test::temp_dir("plugin")}, Registry::global());
  ASSERT_EQ(g.plugins.size(), 1u);
  EXPECT_EQ(g.nodes[1].origin, plugin("t_plugin_ok"));
  RunInfo info;
  info.last_step = 3;
  Executor ex(g, Registry::global(), info);
  ex.run(RunOptions{});
  for (const auto& e : test::Recorder::get().events())
    if (e.node == "op") EXPECT_EQ(e.value, e.step * 1000 + (3 * (e.step * 1000 + 5)) % 1000);
}

TEST(Plugin, MissingFileNamesTheGraphPosition) {
  test::register_test_nodes();
  std::string f = test::temp_dir("plugin") + "/g.yaml";
  std::ofstream(f) << "flowrun: 1\nplugins: [nope/libmissing.so]\nnodes:\n  s: { type: t_source }\n";
  try {
    load_graph(f, {}, Registry::global());
    FAIL();
  } catch (const GraphError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    const std::string msg = e.diagnostics().list()[0].str();
    EXPECT_NE(msg.find(f + ":2:11: plugins: plugin "), std::string::npos) << msg;
    EXPECT_NE(msg.find("nope/libmissing.so: no such file"), std::string::npos) << msg;
  }
}

TEST(Plugin, NotAPluginMissingEntryPoint) {
  std::string e = load_error(plugin("t_plugin_no_entry"));
  EXPECT_EQ(e, "plugin " + plugin("t_plugin_no_entry") +
                   ": no entry point flowrun_plugin_register; define one with FLOWRUN_PLUGIN(reg) { ... }");
}

TEST(Plugin, NotASharedLibrary) {
  std::string f = test::temp_dir("plugin") + "/fake.so";
  std::ofstream(f) << "not an ELF file";
  std::string e = load_error(f);
  EXPECT_EQ(e.rfind("plugin " + f + ": cannot load: ", 0), 0u) << e;
}

TEST(Plugin, WrongAbiVersionIsRefused) {
  std::string e = load_error(plugin("t_plugin_bad_abi"));
  EXPECT_EQ(e, "plugin " + plugin("t_plugin_bad_abi") +
                   ": built for flowrun ABI 999, this engine has ABI " + std::to_string(FLOWRUN_ABI_VERSION) +
                   "; rebuild the plugin against this engine");
  EXPECT_EQ(Registry::global().find("t_bad_abi"), nullptr);
}

TEST(Plugin, RegistrationErrorNamesTheFile) {
  std::string e = load_error(plugin("t_plugin_throws"));
  EXPECT_NE(e.find("plugin " + plugin("t_plugin_throws") + ": registration failed: "), std::string::npos) << e;
  EXPECT_NE(e.find("unknown parameter type 'floaty'"), std::string::npos) << e;
}

TEST(Plugin, PluginPathEnvironmentVariable) {
  test::register_test_nodes();
  // A folder on FLOWRUN_PLUGIN_PATH contributes every .so in it.
  std::string dir = test::temp_dir("pluginpath");
  std::filesystem::copy_file(plugin("t_plugin_ok"), dir + "/libcopy.so");
  auto entries = plugin_path_entries(dir + ":" + plugin("t_plugin_ok"));
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0], dir + "/libcopy.so");
  setenv("FLOWRUN_PLUGIN_PATH", dir.c_str(), 1);
  std::string f = test::temp_dir("plugin") + "/g.yaml";
  std::ofstream(f) << "flowrun: 1\nnodes:\n  s: { type: t_source }\n  x: { type: t_plugin_scale, in: { in: s.out } }\n";
  // A registry of its own: the copy registers the same types as libt_plugin_ok.so, which
  // another test of this process may have loaded into the global one (a collision, refused).
  Registry reg;
  const NodeType* source = Registry::global().find("t_source");
  reg.add(source->schema, source->factory);
  GraphSpec g = load_graph(f, {}, reg);
  unsetenv("FLOWRUN_PLUGIN_PATH");
  EXPECT_EQ(g.nodes[1].origin, dir + "/libcopy.so");
}

// Issue 31, item 11: a plugin whose static initializer throws ended in std::terminate with
// nothing naming the plugin. glibc does not pass the exception to dlopen's caller, so the
// process still stops, but the message names the file and the exception first.
TEST(PluginDeathTest, StaticInitializerThatThrowsNamesThePlugin) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::string p = plugin("t_plugin_static_throws");
  EXPECT_DEATH(load_plugin(p, Registry::global()),
               "flowrun: plugin [^\n]*libt_plugin_static_throws.so: a static initializer \\(the constructor of a global "
               "object\\) threw an exception: deliberate failure in a static initializer");
}

// Issue 31, item 11: a plugin built with _GLIBCXX_USE_CXX11_ABI=0 failed with dlopen's
// "undefined symbol" alone. The error names the file, the symbol and the fix.
TEST(Plugin, OldStringAbiSaysHowToRebuild) {
  const std::string p = plugin("t_plugin_old_abi");
  std::string e = load_error(p);
  EXPECT_EQ(e.rfind("plugin " + p + ": cannot load: ", 0), 0u) << e;
  // The first symbol it misses is the old-ABI twin of one of the engine's (named, demangled).
  EXPECT_NE(e.find("undefined symbol: _ZN7flowrun"), std::string::npos) << e;
  EXPECT_NE(e.find(" (flowrun::"), std::string::npos) << e;
  EXPECT_NE(e.find("Rebuild it against this flowrun's headers"), std::string::npos) << e;
  EXPECT_NE(e.find("_GLIBCXX_USE_CXX11_ABI=1"), std::string::npos) << e;
  EXPECT_EQ(Registry::global().find("t_old_abi"), nullptr);
}

namespace {
// `t_replaceable`, standing in for a built-in (the torch-free build has none registered).
void register_replaceable() {
  Registry::global().add("type: t_replaceable\ndoc: the original\n", [] { return std::unique_ptr<Node>(); }, "built-in");
}
}  // namespace

// Issue 31, item 11: a plugin type with a built-in's name replaced it with only an info line.
// Refused now (as MediaPipe and DALI refuse a second registration), naming the type, the
// plugin file, the type's origin and the fix; the original stays.
TEST(Plugin, TypeNameTakenIsRefused) {
  register_replaceable();
  const std::string p = plugin("t_plugin_collides");
  std::string e = load_error(p);
  EXPECT_EQ(e, "plugin " + p + ": registration failed: node type 't_replaceable' is already registered (from built-in); "
               "a plugin does not replace a type by accident: rename the type in the plugin, or, to replace it on purpose, "
               "register it with reg.replace(...) instead of reg.add(...)");
  EXPECT_EQ(Registry::global().find("t_replaceable")->schema.origin, "built-in");
}

// reg.replace(...) replaces it, with a warning naming the type and both origins.
TEST(Plugin, ReplaceOnPurposeWarns) {
  register_replaceable();
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  auto logger = spdlog::default_logger();
  logger->sinks().push_back(sink);
  const std::string p = plugin("t_plugin_replaces");
  std::string e = load_error(p);
  logger->sinks().pop_back();
  EXPECT_EQ(e, "");
  EXPECT_EQ(Registry::global().find("t_replaceable")->schema.origin, p);
  EXPECT_NE(log.str().find("[warning] node type 't_replaceable' from " + p + " replaces the one from built-in"),
            std::string::npos)
      << log.str();
}
