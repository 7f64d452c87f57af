#include "support/run_graph.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>

#include <atomic>
#include <filesystem>
#include <fstream>

#include "registry.hpp"
#include "spec.hpp"
#include "support/test_nodes.hpp"

namespace flowrun::test {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& prefix) {
  static std::atomic<int> counter{0};
  fs::path base = fs::temp_directory_path() / "flowrun-tests";
  fs::path d = base / (prefix + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

CheckedGraph check_graph_text(const std::string& yaml, const std::vector<std::string>& overrides) {
  register_test_nodes();
  CheckedGraph g;
  g.file = temp_dir("check") + "/g.yaml";
  std::ofstream(g.file) << yaml;
  try {
    g.spec = load_graph(g.file, overrides, Registry::global());
    g.ok = true;
  } catch (const GraphError& e) {
    g.diags = e.diagnostics().list();
    g.all = e.diagnostics().str();
  }
  return g;
}

const Diagnostic& find_diagnostic(const CheckedGraph& g, const std::string& needle) {
  for (const auto& d : g.diags)
    if (d.message.find(needle) != std::string::npos) return d;
  ADD_FAILURE() << "no diagnostic containing '" << needle << "'; got:\n" << g.all;
  static Diagnostic none;
  return none;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

RunResult run_graph_text(const std::string& yaml, const std::vector<std::string>& overrides, const RunOptions& opt) {
  register_test_nodes();
  RunResult r;
  r.dir = temp_dir("graph");
  const std::string file = r.dir + "/graph.yaml";
  std::ofstream(file) << yaml;
  std::vector<std::string> ov = {"run.out_dir=" + r.dir + "/out", "run.progress=off"};
  ov.insert(ov.end(), overrides.begin(), overrides.end());
  GraphSpec g = load_graph(file, ov, Registry::global());
  RunInfo info = run_info(g);
  fs::create_directories(info.out_dir);
  r.out_dir = info.out_dir;
  Executor ex(g, Registry::global(), info);
  RunOptions o = opt;
  const RunOptions from_graph = run_options(g);  // set them in the graph (or overrides), not here
  o.prefetch = from_graph.prefetch;
  o.workers = from_graph.workers;
  o.compute_thread = from_graph.compute_thread;
  r.stats = ex.run(o);
  r.metrics = read_jsonl(info.out_dir + "/metrics.jsonl");
  return r;
}

int run_flowrun(const std::vector<std::string>& args, const std::string& log) {
  std::string cmd = std::string(FLOWRUN_BINARY_DIR) + "/engine/flowrun";
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace flowrun::test
