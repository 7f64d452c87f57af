#include "cli/commands.hpp"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "comm.hpp"
#include "comm/startup.hpp"
#include "common/device.hpp"
#include "common/torch_setup.hpp"
#include "dot.hpp"
#include "executor.hpp"
#include "log.hpp"
#include "plugin.hpp"
#include "progress.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "state/resume.hpp"
#include "trace.hpp"

namespace flowrun::cli {

namespace fs = std::filesystem;

namespace {

bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

// FILE, then KEY=VALUE overrides and --flags.
struct FileArgs {
  std::string file;
  std::vector<std::string> overrides;
  std::vector<std::string> flags;
  std::string error;
};

FileArgs split_args(const std::vector<std::string>& args) {
  FileArgs f;
  for (const auto& a : args) {
    if (a.rfind("--", 0) == 0)
      f.flags.push_back(a);
    else if (f.file.empty() && a.find('=') == std::string::npos)
      f.file = a;
    else if (a.find('=') != std::string::npos)
      f.overrides.push_back(a);
    else
      f.error = "unexpected argument '" + a + "' (overrides are KEY=VALUE)";
  }
  if (f.file.empty() && f.error.empty()) f.error = "no graph file given";
  return f;
}

bool has_flag(const FileArgs& f, const std::string& flag) {
  for (const auto& x : f.flags)
    if (x == flag) return true;
  return false;
}

int usage_error(const std::string& cmd, const std::string& msg, const char* usage) {
  std::fprintf(stderr, "flowrun %s: %s\n%s", cmd.c_str(), msg.c_str(), usage);
  return 2;
}

// Every rank must run the same graph: compare a hash of the resolved file (overrides applied)
// across ranks. A rank whose file did not load takes part too (ok = false), so the others
// learn of it at once instead of waiting for it in their first collective.
bool same_graph_everywhere(comm::Channel& ch, bool ok, const std::string& resolved) {
  if (!comm::distributed()) return ok;
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : resolved) h = (h ^ c) * 1099511628211ull;
  struct Mine {
    uint64_t hash;
    int64_t ok;
  } mine{h, ok ? 1 : 0};
  std::vector<Mine> all(static_cast<size_t>(comm::size()));
  ch.allgather(&mine, all.data(), sizeof mine, "comparing graph files").wait();
  std::string bad, differ;
  for (int r = 0; r < comm::size(); ++r) {
    if (!all[r].ok) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
    else if (all[r].hash != all[0].hash) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!bad.empty()) {
    if (ok) spdlog::error("the graph file did not load on rank(s) {}; see their errors", bad);
    return false;
  }
  if (!differ.empty()) {
    spdlog::error("the resolved graph (file, substitutions and overrides) of rank(s) {} differs from rank 0's: "
                  "start every rank with the same file and the same KEY=VALUE overrides "
                  "(compare `flowrun run FILE ... --print-config` on each machine)",
                  differ);
    return false;
  }
  return true;
}

// Loads and checks; prints every diagnostic on failure.
bool load(const std::string& file, const std::vector<std::string>& overrides, GraphSpec& out) {
  try {
    out = load_graph(file, overrides, Registry::global());
    return true;
  } catch (const GraphError& e) {
    std::fputs(e.diagnostics().str().c_str(), stderr);
    std::fprintf(stderr, "%s: %zu error%s\n", file.c_str(), e.diagnostics().size(), e.diagnostics().size() == 1 ? "" : "s");
    return false;
  }
}

std::atomic<int> g_sigint{0};

extern "C" void on_sigint(int) {
  if (g_sigint.fetch_add(1) >= 1) {
    const char msg[] = "\nflowrun: second Ctrl-C, exiting now\n";
    ssize_t rc = write(2, msg, sizeof msg - 1);
    (void)rc;
    _exit(130);
  }
  const char msg[] = "\nflowrun: Ctrl-C: stopping after the steps in flight (again to exit now)\n";
  ssize_t rc = write(2, msg, sizeof msg - 1);
  (void)rc;
}

const char* kRunUsage =
    "usage: flowrun [run] FILE [KEY=VALUE...] [--print-config]\n"
    "  KEY=VALUE   run.KEY=V sets a run setting (run.steps=50); NODE.PARAM=V a node parameter\n"
    "              (opt.lr=1e-3, model.lora.rank=8); NODE.every=N a node's schedule\n"
    "  --print-config  print the resolved file (overrides, substitutions and defaults applied) and exit\n";

}  // namespace

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
  // Before any node makes its own channel: every rank creates its channels in the same order.
  std::shared_ptr<comm::Channel> startup;
  try {
    startup = comm::Channel::create("startup");
    if (loaded) comm::set_timeout(g.run["comm_timeout_s"].as<double>());
    if (!same_graph_everywhere(*startup, loaded, loaded ? to_yaml(resolved_config(g)) : "")) return 2;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  const YAML::Node& run = g.run;
  RunInfo info = run_info(g);
  // run.threads 0: the cores, shared by the ranks on this machine (mpirun -np 2 on 2 cores: one
  // each, the same total as one process).
  int threads = run["threads"].as<int>();
  if (threads == 0 && comm::local_size() > 1)
    threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / comm::local_size());
  configure_torch(threads, info.seed);
  // run.device, resolved once here (nodes resolve it the same way): a request this build or
  // machine cannot honour stops the run before any node is made.
  std::unique_ptr<DeviceStreams> streams;
  try {
    info.device = resolve_device(info.device, comm::local_rank());
    streams = make_device_streams(info.device);
  } catch (const std::exception& e) {
    spdlog::error("{}: {}", g.file, e.what());
    return 2;
  }
  std::error_code ec;
  fs::create_directories(info.out_dir, ec);
  if (ec) {
    spdlog::error("cannot create out_dir {}: {}", info.out_dir, ec.message());
    return 1;
  }
  Tracer tracer(info.rank);
  std::string trace_file = run["trace"].as<std::string>();
  if (!trace_file.empty() && info.rank > 0) {  // one trace per rank: run.json, run.rank1.json, ...
    const fs::path p(trace_file);
    trace_file = (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(info.rank) + p.extension().string())).string();
  }
  tracer.enable(!trace_file.empty());

  std::optional<ResumePoint> resume;
  try {
    resume = find_resume_point(g, info.out_dir);
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  if (resume) {
    info.first_step = resume->step + 1;
    if (info.first_step > info.last_step) {
      spdlog::info("{} is at step {}, run.steps is {}: nothing to do", resume->folder, resume->step, info.last_step);
      return 0;
    }
  }
  spdlog::info("{}: {} nodes, steps {}..{}, prefetch {}, device {}, out_dir {}", g.file, g.nodes.size(),
               info.first_step, info.last_step, run["prefetch"].as<int>(), info.device, info.out_dir);
  std::signal(SIGINT, on_sigint);
  int code = 0;
  try {
    Executor ex(g, Registry::global(), info);
    if (resume) restore(ex, g, *resume);
    sync_start_state(ex, g, *startup);
    Progress progress(info.first_step, info.last_step, info.log_every,
                      info.rank == 0 ? run["progress"].as<std::string>() : "off");
    RunOptions opt = run_options(g);
    opt.tracer = &tracer;
    opt.stop = &g_sigint;
    opt.streams = streams.get();
    opt.on_step_done = [&](int64_t s) { progress.step_done(s); };
    opt.on_worker_thread = worker_thread_setup;  // with run.compute_thread: the math is here
    // With other ranks waiting on this one, a failure ends the job now, naming rank and node.
    if (comm::distributed())
      opt.on_error = [](const NodeError& e) { comm::abort_job(comm::where() + ": " + e.what()); };
    RunStats st = ex.run(opt);
    progress.close();
    const int64_t n = st.last_step_done - st.first_step + 1;
    spdlog::info("{} {} steps in {:.2f} s ({:.2f} steps/s)", st.stopped ? "stopped after" : "done:", n, st.seconds,
                 st.seconds > 0 ? n / st.seconds : 0.0);
    if (st.stopped) code = 130;
  } catch (const NodeError& e) {
    spdlog::error("{}", e.what());
    code = 1;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    code = 1;
  }
  std::signal(SIGINT, SIG_DFL);
  if (tracer.enabled()) {
    try {
      tracer.write(trace_file);
      spdlog::info("trace written to {} (open it in https://ui.perfetto.dev)", trace_file);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
  }
  return code;
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
  const char* usage = "usage: flowrun dot FILE [KEY=VALUE...]   e.g. flowrun dot graphs/gpt.yaml | dot -Tsvg > gpt.svg\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  FileArgs f = split_args(args);
  if (!f.error.empty()) return usage_error("dot", f.error, usage);
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  std::cout << to_dot(g, Registry::global());
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
