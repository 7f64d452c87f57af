// Plugins: loading, the ABI check, and one-line errors that name the file.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "plugin.hpp"
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
                   ": built for flowrun ABI 999, this engine has ABI 1; rebuild the plugin against this engine");
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
  GraphSpec g = load_graph(f, {}, Registry::global());
  unsetenv("FLOWRUN_PLUGIN_PATH");
  EXPECT_EQ(g.nodes[1].origin, dir + "/libcopy.so");
}
