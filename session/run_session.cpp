#include "run_session.hpp"

#include <c10/core/Device.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm.hpp"
#include "comm/startup.hpp"
#include "common/cpu_blas.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/torch_setup.hpp"
#include "executor.hpp"
#include "hash.hpp"
#include "parallel/layout.hpp"
#include "parallel/mesh.hpp"
#include "log.hpp"
#include "profile.hpp"
#include "progress.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "state/resume.hpp"
#include "trace.hpp"

namespace flowrun {

namespace fs = std::filesystem;

namespace {

// Every rank must run the same graph: compare a hash of the resolved file (overrides applied)
// across ranks. A rank whose file did not load takes part too (g null), so the others learn of
// it at once instead of waiting for it in their first collective. One process resolves nothing.
bool same_graph_everywhere(comm::Channel& ch, const GraphSpec* g) {
  const bool ok = g != nullptr;
  if (!comm::distributed()) return ok;
  struct Mine {
    uint64_t hash;
    int64_t ok;
  } mine{ok ? fnv1a(to_yaml(resolved_config(*g))) : 0, ok ? 1 : 0};
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
// killing), SIGUSR1 (Slurm's `--signal=USR1@SECONDS`) and SIGHUP (the terminal or ssh session
// closed; it ended the run without its stop checkpoint) stop admitting steps; the steps in
// flight finish, the `at: stop` nodes run (a final checkpoint), finish() joins the writers and
// the process exits 128 + the signal: 130, 143, 138, 129. A second signal, or run.stop_grace_s
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
      : sig == SIGHUP  ? "\nflowrun: SIGHUP (the terminal went away): stopping after the steps in flight, then the nodes that run at stop\n"
                       : "\nflowrun: SIGUSR1: stopping after the steps in flight, then the nodes that run at stop\n");
  if (g_grace_s > 0) alarm(g_grace_s);
}

extern "C" void on_grace_over(int) {
  say("\nflowrun: run.stop_grace_s passed before the stop finished; exiting now\n");
  _exit(128 + g_stop.load());
}

// A run whose steps are worth nothing once stopped (RunSession::exit_on_signal): exit at once.
extern "C" void on_exit_signal(int sig) {
  say(sig == SIGINT ? "\nflowrun: Ctrl-C: exiting now\n" : "\nflowrun: stop signal: exiting now\n");
  _exit(128 + sig);
}

void handle_stop_signals(bool on, bool exit_at_once = false) {
  struct sigaction sa {};
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = !on ? SIG_DFL : exit_at_once ? on_exit_signal : on_stop_signal;
  for (int sig : {SIGINT, SIGTERM, SIGUSR1, SIGHUP}) sigaction(sig, &sa, nullptr);
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

// A field of /proc/self/status in bytes (VmHWM: the peak resident memory, VmRSS: now); -1 where
// there is no such file.
double process_status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(field + ":", 0) == 0) return std::strtod(line.c_str() + field.size() + 1, nullptr) * 1024;
  return -1;
}

// The process's peak resident memory, as "1.23 GB (0.45 GB above the start)": the second, what
// the run added to the process torch and MPI started (on a CPU, the closest figure to a device's
// peak of allocated memory: flowrun plan's validation reads it); "unknown" without /proc.
std::string peak_resident_text(double at_start) {
  const double peak = process_status_bytes("VmHWM");
  if (peak < 0) return "unknown";
  return fmt::format("{:.3g} GB{}", peak / 1e9, at_start < 0 ? std::string() : fmt::format(" ({:.3g} GB above the start)", (peak - at_start) / 1e9));
}

// run.threads 0: $OMP_NUM_THREADS where it is set (as torch reads it, and as torchrun sets it
// for several processes per machine), else the cores shared by the ranks on this machine
// (mpirun -np 2 on 2 cores: one each, the same total as one process).
int intra_op_threads(int setting) {
  if (setting > 0) return setting;
  const char* env = std::getenv("OMP_NUM_THREADS");
  if (const int n = env ? std::atoi(env) : 0; n > 0) return n;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, comm::local_size()));
}

}  // namespace

struct RunSession::Impl {
  std::shared_ptr<comm::Channel> startup;  // the first channel every rank makes
  std::unique_ptr<StopAgreement> agree;    // several ranks: where to stop
  std::unique_ptr<DeviceStreams> streams;  // null on the CPU
  std::unique_ptr<OutDirLock> lock;        // rank 0: its job's hold on OUT_DIR
  std::unique_ptr<Tracer> tracer;
  std::string trace_file;                  // run.trace, this rank's name for it
  std::optional<ResumePoint> resume;
  bool ready = false;  // start() returned nullopt
  bool ran = false;    // run() ran: close() has a profile and a trace to write
  double resident_at_start = -1;  // the process's resident bytes before the nodes were made
};

RunSession::RunSession(const GraphSpec* g) : g_(g), impl_(std::make_unique<Impl>()) {}
RunSession::~RunSession() = default;

std::optional<int> RunSession::start() {
  Impl& m = *impl_;
  // Before any node makes its own channel: every rank creates its channels in the same order.
  try {
    m.startup = comm::Channel::create("startup");
    if (comm::distributed()) m.agree = std::make_unique<StopAgreement>(comm::Channel::create("stop"));
    if (g_) comm::set_timeout(g_->settings.comm_timeout_s);
    if (g_) comm::set_heartbeat_timeout(g_->settings.heartbeat_timeout_s);
    if (!same_graph_everywhere(*m.startup, g_)) return 2;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  const GraphSpec& g = *g_;
  const RunSettings& run = g.settings;
  info_ = run_info(g);
  // run.parallel: the mesh of the job's processes; a layout the world does not divide, or one
  // with a strategy not built yet, stops every rank before any node is made.
  try {
    const parallel::Mesh mesh(info_.world, run.parallel.tp, run.parallel.pp, run.parallel.ep);
    parallel::pipeline_config(run.parallel);
    if (info_.world > 1 && info_.rank == 0) spdlog::info("processes: {}", mesh.describe());
  } catch (const std::exception& e) {
    spdlog::error("{}: {}", g.file, e.what());
    return 2;
  }
  // Several ranks training without an all-reduce train a replica each, on its own slice of the
  // data, and only rank 0's is saved: allowed (independent replicas), never by surprise.
  if (info_.world > 1 && info_.rank == 0) {
    bool trains = false, reduces = false;
    for (const auto& n : g.nodes) {
      trains = trains || n.type == "forward_backward";
      reduces = reduces || n.type == "allreduce";
    }
    if (trains && !reduces)
      spdlog::warn("{}: {} ranks but no allreduce node: each rank trains a replica of its own on its slice of the data, "
                   "and only rank 0's state is checkpointed; for data parallel add sync: {{ type: allreduce, in: {{ "
                   "ready: fb.ready }} }} and read sync.grads in the optimizer",
                   g.file, info_.world);
  }
  const int threads = intra_op_threads(run.threads);
  configure_torch(threads, info_.seed);
  m.resident_at_start = process_status_bytes("VmRSS");
  try {
    cpu_blas::select(cpu_blas::parse(run.cpu_gemm));
  } catch (const std::exception& e) {
    spdlog::error("{}: {}", g.file, e.what());
    return 2;
  }
  // run.device, resolved once here (nodes resolve it the same way): a request this build or
  // machine cannot honour stops the run before any node is made.
  try {
    info_.device = resolve_device(info_.device, comm::local_rank());
    m.streams = make_device_streams(info_.device);
  } catch (const std::exception& e) {
    spdlog::error("{}: {}", g.file, e.what());
    return 2;
  }
  std::error_code ec;
  fs::create_directories(info_.out_dir, ec);
  if (ec) {
    spdlog::error("cannot create out_dir {}: {}", info_.out_dir, ec.message());
    return 1;
  }
  // Rank 0 holds the lock for the job: its ranks share out_dir, another job must not.
  if (info_.rank == 0) {
    try {
      m.lock = std::make_unique<OutDirLock>(info_.out_dir);
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
      return 2;
    }
  }
  m.tracer = std::make_unique<Tracer>(info_.rank);
  m.trace_file = run.trace;
  if (!m.trace_file.empty() && info_.rank > 0) {  // one trace per rank: run.json, run.rank1.json, ...
    const fs::path p(m.trace_file);
    m.trace_file = (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(info_.rank) + p.extension().string())).string();
  }
  m.tracer->enable(!m.trace_file.empty() || run.profile);
  // The trace and the profile are written at the end; a path that cannot be written is an error
  // now, not then.
  if (!m.trace_file.empty() && fs::is_directory(m.trace_file)) {
    spdlog::error("run.trace: {} is a folder; give the path of a file to write (e.g. {}/trace.json)", m.trace_file,
                  m.trace_file);
    return 2;
  }
  if (run.profile && info_.rank == 0 && fs::is_directory(fs::path(info_.out_dir) / "profile.json")) {
    spdlog::error("run.profile: {}/profile.json is a folder, so the profile could not be written at the end; move it",
                  info_.out_dir);
    return 2;
  }
  if (!m.trace_file.empty()) {  // as Tracer::write will: create the folder, write TRACE.tmp
    const fs::path parent = fs::path(m.trace_file).parent_path();
    if (!parent.empty()) fs::create_directories(parent, ec);
    const std::string probe = m.trace_file + ".tmp";
    std::FILE* f = ec ? nullptr : std::fopen(probe.c_str(), "w");
    if (!f) {
      spdlog::error("run.trace: cannot write {}: {}; give a path where a file can be created", m.trace_file,
                    ec ? ec.message() : std::strerror(errno));
      return 2;
    }
    std::fclose(f);
    fs::remove(probe, ec);
  }

  // The chosen checkpoint's files verified against their checksums (the ranks share the reading);
  // run.resume=auto passes a damaged one over for the next older complete one, with a warning
  // naming the file; a damaged PATH is refused.
  try {
    std::map<std::string, std::string> damaged;
    std::shared_ptr<comm::Channel> verify;
    if (comm::distributed()) verify = comm::Channel::create("resume: verifying the checkpoint");
    for (;;) {
      m.resume = find_resume_point(g, info_.out_dir, damaged);
      if (verify) {  // every rank must find the same one (a host that does not see out_dir would not)
        const std::string mine = m.resume ? m.resume->folder : "no checkpoint";
        const auto all = comm::allgather_text(*verify, mine, "resume: the checkpoint each rank found");
        std::string differ;
        for (size_t r = 0; r < all.size(); ++r)
          if (all[r] != all[0])
            differ += "; rank " + std::to_string(r) + " on host " + comm::host_of(static_cast<int>(r)) + " finds " + all[r];
        if (!differ.empty())
          throw std::runtime_error("resume: the ranks do not see the same checkpoints in " + info_.out_dir + ": rank 0 on host " +
                                   comm::host_of(0) + " finds " + all[0] + differ +
                                   "; every host must see run.out_dir (a shared file system)");
      }
      if (!m.resume) break;
      const std::string bad = verify_checkpoint(m.resume->folder, verify.get());
      if (bad.empty()) break;
      if (g.settings.resume != "auto")
        throw std::runtime_error("run.resume=" + g.settings.resume + ": the checkpoint is damaged: " + bad +
                                 "; name another checkpoint folder, or use run.resume=auto (the newest complete one "
                                 "that verifies)");
      spdlog::warn("run.resume=auto: {} is damaged: {}; looking for an older complete checkpoint", m.resume->folder, bad);
      damaged[m.resume->folder] = bad;
    }
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  if (m.resume) {
    info_.first_step = m.resume->step + 1;
    if (info_.first_step > info_.last_step && !setup_only) {
      spdlog::info("{} is at step {}, run.steps is {}: nothing to do (raise run.steps to train on)", m.resume->folder,
                   m.resume->step, info_.last_step);
      return 0;
    }
  }
  if (info_.rank == 0) {
    try {
      const std::string moved = prepare_run_logs(info_.out_dir, info_.first_step);
      if (!moved.empty()) spdlog::info("{}", moved);
    } catch (const std::exception& e) {
      spdlog::error("preparing the logs in {}: {}", info_.out_dir, e.what());
      return 1;
    }
  }
  spdlog::info("{}: {} nodes, steps {}..{}, prefetch {}, device {}, {} intra-op thread{}, out_dir {}", g.file,
               g.nodes.size(), info_.first_step, info_.last_step, run.prefetch, info_.device, threads,
               threads == 1 ? "" : "s", info_.out_dir);
  if (c10::Device(info_.device).is_cpu() && info_.rank == 0)
    spdlog::info("float32 linear layers multiply through {} (run.cpu_gemm: {})", cpu_blas::describe(), run.cpu_gemm);
  m.ready = true;
  return std::nullopt;
}

int RunSession::run() {
  Impl& m = *impl_;
  if (!m.ready) throw std::logic_error("RunSession::run() without a start() that returned nullopt");
  m.ran = true;
  const GraphSpec& g = *g_;
  g_grace_s = static_cast<unsigned>(g.settings.stop_grace_s);
  handle_stop_signals(true, exit_on_signal);
  int code = 0;
  try {
    Executor ex(g, Registry::global(), info_);
    if (m.resume) restore(ex, g, *m.resume);
    sync_start_state(ex, g, *m.startup);
    if (on_setup) on_setup(ex);
    if (setup_only) {
      handle_stop_signals(false);
      return 0;
    }
    Progress progress(info_.first_step, info_.last_step, info_.log_every,
                      info_.rank == 0 ? g.settings.progress : "off", m.tracer.get());
    RunOptions opt = run_options(g);
    opt.tracer = m.tracer.get();
    if (m.agree)
      opt.stop_before = [&](int64_t s) { return m.agree->stop_before(s); };
    else
      opt.stop = &g_stop;
    opt.streams = m.streams.get();
    opt.on_step_done = [&](int64_t s) { progress.step_done(s); };
    opt.on_worker_thread = worker_thread_setup;  // with run.compute_thread: the math is here
    // With other ranks waiting on this one, a failure ends the job now, naming rank and node.
    if (comm::distributed())
      opt.on_error = [](const NodeError& e) { comm::abort_job(comm::where() + ": " + e.what()); };
    RunStats st = ex.run(opt);
    progress.close();
    const int64_t n = st.last_step_done - st.first_step + 1;
    const double device_peak = peak_device_memory(c10::Device(info_.device));
    spdlog::info("{} {} steps in {:.2f} s ({:.2f} steps/s); peak resident memory {}{}", st.stopped ? "stopped after" : "done:",
                 n, st.seconds, st.seconds > 0 ? n / st.seconds : 0.0, peak_resident_text(m.resident_at_start),
                 device_peak < 0 ? std::string() : fmt::format(", peak {} memory {}", info_.device, bytes_text(device_peak)));
    if (st.stopped) code = 128 + (m.agree ? m.agree->signal() : g_stop.load());
  } catch (const std::exception& e) {  // NodeError names the node and step
    spdlog::error("{}", e.what());
    code = 1;
  }
  handle_stop_signals(false);
  return code;
}

int RunSession::close(int code) {
  Impl& m = *impl_;
  if (!m.ran) return code;  // start() ended the run before its first step
  if (const std::string chosen = cpu_blas::choices_summary(); !chosen.empty() && info_.rank == 0)
    spdlog::info("run.cpu_gemm auto: {}", chosen);
  if (g_->settings.profile && !write_profile(*g_, *m.tracer, info_) && code == 0) code = 1;
  if (!m.trace_file.empty()) {
    try {
      m.tracer->write(m.trace_file);
      spdlog::info("trace written to {} (open it in https://ui.perfetto.dev)", m.trace_file);
    } catch (const std::exception& e) {
      spdlog::error("run.trace: {}", e.what());
      if (code == 0) code = 1;
    }
  }
  return code;
}

}  // namespace flowrun
