// The commands that read a graph file and run nothing: validate, dot, explain, nodes. Linked
// into the flowrun binary itself, which links no libtorch (commands.hpp), so they answer at once.
#include "commands.hpp"

#include "args.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "comm.hpp"
#include "dot.hpp"
#include "explain.hpp"
#include "log.hpp"
#include "parallel/layout.hpp"
#include "plugin.hpp"
#include "profile.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "torch_side.hpp"
#include "trace.hpp"

namespace flowrun::cli {

namespace {

const char* kRunUsage =
    "usage: flowrun [run] FILE [KEY=VALUE...] [--print-config]\n"
    "  KEY=VALUE   run.KEY=V sets a run setting (run.steps=50); NODE.PARAM=V a node parameter\n"
    "              (opt.lr=1e-3, model.lora.rank=8); NODE.every=N a node's schedule\n"
    "  --print-config  print the resolved file (overrides, substitutions and defaults applied) and exit\n"
    "where the time goes:\n"
    "  run.profile=true     at the end, a table per node (runs, mean, p50, p95, max, total, share of wall\n"
    "                       time, overlapped, waited on inputs), the critical path and the workers' idle\n"
    "                       fraction; also OUT_DIR/profile.json\n"
    "  run.trace=FILE       a Chrome trace (ui.perfetto.dev); flowrun dot --trace FILE GRAPH draws it\n"
    "  NODE.tensorboard=true  metrics nodes (and the sampler) also write OUT_DIR/tb (TensorBoard)\n";

}  // namespace

// parse -> load -> run: the file is read and checked here; the run session
// (session/run_session.hpp, in the torch side: torch_side.hpp) does everything after.
int cmd_run(const std::vector<std::string>& args) {
  if (wants_help(args)) return std::fputs(kRunUsage, stdout), 0;
  FileArgs f = split_args(args);
  if (!f.error.empty()) return usage_error("run", f.error, kRunUsage);
  for (const auto& fl : f.flags)
    if (fl != "--print-config") return usage_error("run", "unknown option " + fl, kRunUsage);
  GraphSpec g;
  const bool loaded = load(f.file, f.overrides, g);
  if (loaded && has_flag(f, "--print-config")) {
    std::cout << to_yaml(resolved_config(g));
    return 0;
  }
  return run_graph(loaded ? &g : nullptr);  // a rank whose file failed still joins the job
}

int cmd_validate(const std::vector<std::string>& args) {
  const char* usage = "usage: flowrun validate FILE... [KEY=VALUE...]\n  check each file (with the overrides), report every error, run nothing; exit 2 if any is invalid\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  std::vector<std::string> files, overrides;
  for (const auto& a : args) (a.find('=') != std::string::npos ? overrides : files).push_back(a);
  if (files.empty()) return usage_error("validate", "no graph file given", usage);
  int bad = 0;
  for (const auto& file : files) {
    GraphSpec g;
    if (load(file, overrides, g))
      std::printf("%s: ok (%zu nodes)\n", file.c_str(), g.nodes.size());
    else
      ++bad;
  }
  return bad ? 2 : 0;
}

int cmd_dot(const std::vector<std::string>& args) {
  const char* usage =
      "usage: flowrun dot [--trace TRACE] FILE [KEY=VALUE...]   e.g. flowrun dot graphs/gpt.yaml | dot -Tsvg > gpt.svg\n"
      "  --trace TRACE  label the graph with the times measured in TRACE (a run's run.trace=TRACE; under mpirun,\n"
      "                 one rank's file): per node mean and p95 per run, share of the wall time, overlap; per\n"
      "                 edge the consumer's wait; the critical path of a typical step bold\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  std::vector<std::string> rest;
  std::string trace;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--trace") {
      if (i + 1 >= args.size()) return usage_error("dot", "--trace needs a file", usage);
      trace = args[++i];
    } else {
      rest.push_back(args[i]);
    }
  }
  FileArgs f = split_args(rest);
  if (!f.error.empty()) return usage_error("dot", f.error, usage);
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  if (trace.empty()) {
    std::cout << to_dot(g, Registry::global());
    return 0;
  }
  try {
    const Profile p = make_profile(g, read_trace_file(trace));
    std::cout << to_dot(g, Registry::global(), &p);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowrun dot: %s\n", e.what());
    return 2;
  }
  return 0;
}

int cmd_explain(const std::vector<std::string>& args) {
  const char* usage =
      "usage: flowrun explain FILE [KEY=VALUE...] [--world N]\n"
      "  the step FILE runs, as the sequential program it is: each node in file order with its inputs,\n"
      "  where it runs (device stream, compute thread, schedule) and what it waits for (@s: this step,\n"
      "  @s-1: the one before), by the executor's own rule; then how N processes (default: this job's,\n"
      "  1 without mpirun) are laid out by run.parallel: each rank's coordinates and groups\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  std::vector<std::string> rest;
  int world = comm::size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--world") {
      if (i + 1 >= args.size()) return usage_error("explain", "--world needs a number of processes", usage);
      char* end = nullptr;
      const long n = std::strtol(args[i + 1].c_str(), &end, 10);
      if (!end || *end || n < 1 || n > (1 << 20))
        return usage_error("explain", "--world " + args[i + 1] + ": expected a number of processes from 1 to " + std::to_string(1 << 20), usage);
      world = static_cast<int>(n);
      ++i;
    } else {
      rest.push_back(args[i]);
    }
  }
  FileArgs f = split_args(rest);
  if (!f.error.empty()) return usage_error("explain", f.error, usage);
  if (!f.flags.empty()) return usage_error("explain", "unknown option " + f.flags.front(), usage);
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  std::cout << explain(g, Registry::global()) << "\n" << parallel::describe_layout(g, world);
  return 0;
}

int cmd_nodes(const std::vector<std::string>& args) {
  const char* usage =
      "usage: flowrun nodes [TYPE] [--plugin LIB.so]...\n  without TYPE: every registered node type with its one-line doc;\n"
      "  with TYPE: its ports and parameters (from its schema). 'flowrun nodes graph' documents the graph file itself.\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  Registry& reg = Registry::global();
  std::string type;
  std::vector<std::string> plugins;
  if (const char* env = std::getenv("FLOWRUN_PLUGIN_PATH"); env && *env) plugins = plugin_path_entries(env);
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--plugin" && i + 1 < args.size())
      plugins.push_back(args[++i]);
    else if (args[i].rfind("--", 0) == 0)
      return usage_error("nodes", "unknown option " + args[i], usage);
    else
      type = args[i];
  }
  for (const auto& p : plugins) {
    try {
      load_plugin(p, reg);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 2;
    }
  }
  if (type.empty()) {
    for (const auto& t : reg.types()) {
      const NodeSchema& s = reg.find(t)->schema;
      std::printf("%-22s %s%s\n", t.c_str(), s.doc.c_str(), s.origin == "built-in" ? "" : ("  [plugin " + s.origin + "]").c_str());
    }
    return 0;
  }
  if (type == "graph") {
    NodeSchema s;
    s.type = "graph";
    s.doc = "the graph file itself: top-level keys (run: holds the run settings)";
    s.params = graph_schema().top;
    std::cout << describe(s);
    std::cout << "\nkeys of each node entry (nodes: NAME: {...}):\n";
    NodeSchema n;
    n.params = graph_schema().node_keys;
    std::string d = describe(n);
    std::cout << d.substr(d.find("parameters (with:):\n") + 20);
    return 0;
  }
  const NodeType* t = reg.find(type);
  if (!t) {
    std::fprintf(stderr, "flowrun nodes: unknown node type '%s'%s; registered: %s\n", type.c_str(),
                 did_you_mean(type, reg.types()).c_str(), join(reg.types()).c_str());
    return 2;
  }
  std::cout << describe(t->schema);
  return 0;
}

}  // namespace flowrun::cli
