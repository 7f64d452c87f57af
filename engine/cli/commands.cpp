#include "cli/commands.hpp"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "comm.hpp"
#include "hash.hpp"
#include "comm/startup.hpp"
#include "common/device.hpp"
#include "common/torch_setup.hpp"
#include "dot.hpp"
#include "explain.hpp"
#include "executor.hpp"
#include "log.hpp"
#include "plugin.hpp"
#include "profile.hpp"
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
  struct Mine {
    uint64_t hash;
    int64_t ok;
  } mine{fnv1a(resolved), ok ? 1 : 0};
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
    const std::string count = fmt::format("{}: {} error{}", file, e.diagnostics().size(), e.diagnostics().size() == 1 ? "" : "s");
    if (log_is_json()) {  // for log collectors: each diagnostic one error line
      std::stringstream lines(e.diagnostics().str());
      for (std::string l; std::getline(lines, l);)
        if (!l.empty()) spdlog::error("{}", l);
      spdlog::error("{}", count);
    } else {
      std::fputs(e.diagnostics().str().c_str(), stderr);
      std::fprintf(stderr, "%s\n", count.c_str());
    }
    return false;
  }
  // The checker reports problems as diagnostics; anything else is a flowrun bug, but still an
  // error message and exit 2, never a crash.
  catch (const std::exception& e) {
    std::fprintf(stderr, "%s: could not check the file: %s (a flowrun bug: please report it with the file)\n",
                 file.c_str(), e.what());
    return false;
  }
}

// One run per out_dir: OUT_DIR/.flowrun.lock, held with flock(2) for the whole run. The kernel
// releases it when the process ends in any way (exit, crash, SIGKILL), so a lock left by a
// dead run is never in the way. The file says who holds it, for the error of the next run.
class OutDirLock {
 public:
  // Throws naming the holder when another process has it.
  explicit OutDirLock(const std::string& out_dir) : path_((fs::path(out_dir) / ".flowrun.lock").string()) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error("cannot create " + path_ + ": " + std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string holder(512, '\0');
      const ssize_t n = ::pread(fd_, holder.data(), holder.size(), 0);
      holder.resize(n > 0 ? static_cast<size_t>(n) : 0);
      while (!holder.empty() && holder.back() == '\n') holder.pop_back();
      ::close(fd_);
      if (err != EWOULDBLOCK)
        throw std::runtime_error("cannot lock " + path_ + ": " + std::strerror(err));
      throw std::runtime_error("another flowrun is running in " + out_dir + " (" +
                               (holder.empty() ? "its process is starting" : holder) +
                               "); two runs in one out_dir would overwrite each other's checkpoints and metrics: "
                               "wait for it, stop it, or give this run another run.out_dir");
    }
    char host[256] = "?";
    ::gethostname(host, sizeof host - 1);
    const std::string who = "pid " + std::to_string(::getpid()) + " on " + host + ", started " + now_text();
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) < 0)
      spdlog::warn("cannot write {}: {}", path_, std::strerror(errno));
  }
  ~OutDirLock() { ::close(fd_); }  // releases the lock; the file stays (harmless, unlocked)
  OutDirLock(const OutDirLock&) = delete;
  OutDirLock& operator=(const OutDirLock&) = delete;

 private:
  static std::string now_text() {
    const std::time_t t = std::time(nullptr);
    char buf[64];
    std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
    return buf;
  }
  std::string path_;
  int fd_ = -1;
};

// Stopping by signal. SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and systemd send before
// killing) and SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) stop admitting steps; the steps in
// flight finish, the `at: stop` nodes run (a final checkpoint), finish() joins the writers and
// the process exits 128 + the signal: 130, 143, 138. A second signal, or run.stop_grace_s
// seconds after the first, exits at once with that code; `latest` then still names the newest
// complete checkpoint (folders are renamed into place only when complete).
std::atomic<int> g_stop{0};     // the first stop signal; 0: none
std::atomic<int> g_signals{0};  // how many arrived
unsigned g_grace_s = 0;         // run.stop_grace_s

void say(const char* msg) {  // async-signal-safe
  ssize_t rc = write(2, msg, std::strlen(msg));
  (void)rc;
}

extern "C" void on_stop_signal(int sig) {
  if (g_signals.fetch_add(1) >= 1) {
    say("\nflowrun: second stop signal, exiting now\n");
    _exit(128 + g_stop.load());
  }
  g_stop.store(sig);
  say(sig == SIGINT    ? "\nflowrun: Ctrl-C: stopping after the steps in flight (again to exit now)\n"
      : sig == SIGTERM ? "\nflowrun: SIGTERM: stopping after the steps in flight, then the nodes that run at stop\n"
                       : "\nflowrun: SIGUSR1: stopping after the steps in flight, then the nodes that run at stop\n");
  if (g_grace_s > 0) alarm(g_grace_s);
}

extern "C" void on_grace_over(int) {
  say("\nflowrun: run.stop_grace_s passed before the stop finished; exiting now\n");
  _exit(128 + g_stop.load());
}

void handle_stop_signals(bool on) {
  struct sigaction sa {};
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = on ? on_stop_signal : SIG_DFL;
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaction(sig, &sa, nullptr);
  sa.sa_handler = on ? on_grace_over : SIG_DFL;
  sigaction(SIGALRM, &sa, nullptr);
}

// Several ranks must stop before the same step, or the ones still running wait in a collective
// for the ones that stopped. Each step's admission adds this rank's stop signal (0 = none) to a
// max-all-reduce on a channel of its own; step s is admitted unless the all-reduce added at
// step s - kLag found a signal on some rank. So a signal on any rank stops every rank before
// the same step, kLag steps later, and the wait for the result is off the critical path (it
// arrived steps ago). All ranks exit with that signal's code.
class StopAgreement {
 public:
  static constexpr size_t kLag = 2;
  explicit StopAgreement(std::shared_ptr<comm::Channel> ch) : ch_(std::move(ch)) {}
  ~StopAgreement() {  // the all-reduces in flight complete on every rank (same count)
    for (auto& p : inflight_) try {
        p.request.wait();
      } catch (...) {
      }
  }
  bool stop_before(int64_t) {
    Pending p{std::make_unique<int64_t>(g_stop.load()), {}};
    p.request = ch_->allreduce(p.signal.get(), 1, comm::DType::i64, comm::Op::max, "agreeing whether to stop");
    inflight_.push_back(std::move(p));
    if (inflight_.size() <= kLag) return false;
    Pending& oldest = inflight_.front();
    oldest.request.wait();
    agreed_ = static_cast<int>(*oldest.signal);
    inflight_.pop_front();
    return agreed_ > 0;
  }
  int signal() const { return agreed_; }

 private:
  struct Pending {
    std::unique_ptr<int64_t> signal;  // the buffer stays put while the all-reduce runs
    comm::Request request;
  };
  std::shared_ptr<comm::Channel> ch_;
  std::deque<Pending> inflight_;
  int agreed_ = 0;
};

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

// run.profile: the profile of this rank's node spans, logged (rank 0) and written as
// OUT_DIR/profile.json (rank N > 0: profile.rankN.json), to a temporary name, then renamed.
bool write_profile(const GraphSpec& g, const Tracer& tracer, const RunInfo& info) {
  try {
    const Profile p = make_profile(g, tracer.node_spans());
    if (info.rank == 0) {
      std::stringstream lines(profile_table(p));
      for (std::string l; std::getline(lines, l);) spdlog::info("{}", l);
    }
    const fs::path dir = info.out_dir.empty() ? fs::path(".") : fs::path(info.out_dir);
    const fs::path path = dir / (info.rank == 0 ? "profile.json" : "profile.rank" + std::to_string(info.rank) + ".json");
    const std::string tmp = path.string() + ".tmp";
    {
      std::ofstream o(tmp);
      o << profile_json(p);
      if (!o) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    }
    fs::rename(tmp, path);
    spdlog::info("profile written to {}", path.string());
    return true;
  } catch (const std::exception& e) {
    spdlog::error("run.profile: {}", e.what());
    return false;
  }
}

}  // namespace

// The process's peak resident memory (VmHWM in /proc/self/status), as "1.23 GB"; "unknown"
// where there is no such file.
static std::string peak_resident_text() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) {
      const double kb = std::strtod(line.c_str() + 6, nullptr);
      return fmt::format("{:.3g} GB", kb * 1024 / 1e9);
    }
  return "unknown";
}

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
  std::unique_ptr<StopAgreement> agree;  // several ranks: where to stop
  try {
    startup = comm::Channel::create("startup");
    if (comm::distributed()) agree = std::make_unique<StopAgreement>(comm::Channel::create("stop"));
    if (loaded) comm::set_timeout(g.run["comm_timeout_s"].as<double>());
    if (!same_graph_everywhere(*startup, loaded, loaded ? to_yaml(resolved_config(g)) : "")) return 2;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  const YAML::Node& run = g.run;
  RunInfo info = run_info(g);
  // Several ranks training without an all-reduce train a replica each, on its own slice of the
  // data, and only rank 0's is saved: allowed (independent replicas), never by surprise.
  if (info.world > 1 && info.rank == 0) {
    bool trains = false, reduces = false;
    for (const auto& n : g.nodes) {
      trains = trains || n.type == "forward_backward";
      reduces = reduces || n.type == "allreduce";
    }
    if (trains && !reduces)
      spdlog::warn("{}: {} ranks but no allreduce node: each rank trains a replica of its own on its slice of the data, "
                   "and only rank 0's state is checkpointed; for data parallel add sync: {{ type: allreduce, in: {{ "
                   "ready: fb.ready }} }} and read sync.grads in the optimizer",
                   g.file, info.world);
  }
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
  // Rank 0 holds the lock for the job: its ranks share out_dir, another job must not.
  std::unique_ptr<OutDirLock> lock;
  if (info.rank == 0) {
    try {
      lock = std::make_unique<OutDirLock>(info.out_dir);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      return 2;
    }
  }
  Tracer tracer(info.rank);
  std::string trace_file = run["trace"].as<std::string>();
  if (!trace_file.empty() && info.rank > 0) {  // one trace per rank: run.json, run.rank1.json, ...
    const fs::path p(trace_file);
    trace_file = (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(info.rank) + p.extension().string())).string();
  }
  const bool profile = run["profile"].as<bool>();
  tracer.enable(!trace_file.empty() || profile);
  // The trace is written at the end; a path that cannot be written is an error now, not then.
  if (!trace_file.empty() && fs::is_directory(trace_file)) {
    spdlog::error("run.trace: {} is a folder; give the path of a file to write (e.g. {}/trace.json)", trace_file,
                  trace_file);
    return 2;
  }
  if (profile && info.rank == 0 && fs::is_directory(fs::path(info.out_dir) / "profile.json")) {
    spdlog::error("run.profile: {}/profile.json is a folder, so the profile could not be written at the end; move it",
                  info.out_dir);
    return 2;
  }
  if (!trace_file.empty()) {  // as Tracer::write will: create the folder, write TRACE.tmp
    const fs::path parent = fs::path(trace_file).parent_path();
    if (!parent.empty()) fs::create_directories(parent, ec);
    const std::string probe = trace_file + ".tmp";
    std::FILE* f = ec ? nullptr : std::fopen(probe.c_str(), "w");
    if (!f) {
      spdlog::error("run.trace: cannot write {}: {}; give a path where a file can be created", trace_file,
                    ec ? ec.message() : std::strerror(errno));
      return 2;
    }
    std::fclose(f);
    fs::remove(probe, ec);
  }

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
      spdlog::info("{} is at step {}, run.steps is {}: nothing to do (raise run.steps to train on)", resume->folder,
                   resume->step, info.last_step);
      return 0;
    }
  }
  if (info.rank == 0) {
    try {
      const std::string moved = prepare_run_logs(info.out_dir, info.first_step);
      if (!moved.empty()) spdlog::info("{}", moved);
    } catch (const std::exception& e) {
      spdlog::error("preparing the logs in {}: {}", info.out_dir, e.what());
      return 1;
    }
  }
  spdlog::info("{}: {} nodes, steps {}..{}, prefetch {}, device {}, out_dir {}", g.file, g.nodes.size(),
               info.first_step, info.last_step, run["prefetch"].as<int>(), info.device, info.out_dir);
  g_grace_s = static_cast<unsigned>(run["stop_grace_s"].as<int>());
  handle_stop_signals(true);
  int code = 0;
  try {
    Executor ex(g, Registry::global(), info);
    if (resume) restore(ex, g, *resume);
    sync_start_state(ex, g, *startup);
    Progress progress(info.first_step, info.last_step, info.log_every,
                      info.rank == 0 ? run["progress"].as<std::string>() : "off", &tracer);
    RunOptions opt = run_options(g);
    opt.tracer = &tracer;
    if (agree)
      opt.stop_before = [&](int64_t s) { return agree->stop_before(s); };
    else
      opt.stop = &g_stop;
    opt.streams = streams.get();
    opt.on_step_done = [&](int64_t s) { progress.step_done(s); };
    opt.on_worker_thread = worker_thread_setup;  // with run.compute_thread: the math is here
    // With other ranks waiting on this one, a failure ends the job now, naming rank and node.
    if (comm::distributed())
      opt.on_error = [](const NodeError& e) { comm::abort_job(comm::where() + ": " + e.what()); };
    RunStats st = ex.run(opt);
    progress.close();
    const int64_t n = st.last_step_done - st.first_step + 1;
    spdlog::info("{} {} steps in {:.2f} s ({:.2f} steps/s); peak resident memory {}", st.stopped ? "stopped after" : "done:",
                 n, st.seconds, st.seconds > 0 ? n / st.seconds : 0.0, peak_resident_text());
    if (st.stopped) code = 128 + (agree ? agree->signal() : g_stop.load());
  } catch (const NodeError& e) {
    spdlog::error("{}", e.what());
    code = 1;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    code = 1;
  }
  handle_stop_signals(false);
  if (profile && !write_profile(g, tracer, info) && code == 0) code = 1;
  if (!trace_file.empty()) {
    try {
      tracer.write(trace_file);
      spdlog::info("trace written to {} (open it in https://ui.perfetto.dev)", trace_file);
    } catch (const std::exception& e) {
      spdlog::error("run.trace: {}", e.what());
      if (code == 0) code = 1;
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
      "usage: flowrun explain FILE [KEY=VALUE...]\n"
      "  the step FILE runs, as the sequential program it is: each node in file order with its inputs,\n"
      "  where it runs (device stream, compute thread, schedule) and what it waits for (@s: this step,\n"
      "  @s-1: the one before), by the executor's own rule\n";
  if (wants_help(args)) return std::fputs(usage, stdout), 0;
  FileArgs f = split_args(args);
  if (!f.error.empty()) return usage_error("explain", f.error, usage);
  GraphSpec g;
  if (!load(f.file, f.overrides, g)) return 2;
  std::cout << explain(g, Registry::global());
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
