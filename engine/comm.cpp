// MPI world and the communication thread (comm.hpp says why it is built this way).
#include "comm.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

#ifdef FLOWRUN_MPI
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace flowrun::comm {

namespace {

// Environment variables an MPI launcher sets in every process it starts.
const char* launcher_variable() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return v;
  return nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

}  // namespace

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 1;
}

enum class Kind { allreduce, broadcast, allgather, allgather_blocks, reduce_scatter, all_to_all, send, recv, barrier, dup, split };

struct Pending {
  Kind kind = Kind::barrier;
  std::string what;  // "'sync': all-reduce of bucket 3 (step 5)"
  void* data = nullptr;
  const void* in = nullptr;
  size_t count = 0, bytes = 0;
  DType type = DType::f32;
  Op op = Op::sum;
  int root = 0;  // broadcast: the sender; send, recv: the other rank
  std::vector<int> counts, displs;  // reduce_scatter, allgather_blocks, all_to_all (sent): elements per rank, where
  std::vector<int> recv_counts, recv_displs;  // all_to_all: the blocks received
  size_t element_size = 0;          // allgather_blocks, all_to_all
  int me = 0;                       // reduce_scatter, allgather_blocks: this rank's place in the channel
  std::vector<char> scratch;        // reduce_scatter: the other ranks' blocks of this rank's part
#ifdef FLOWRUN_MPI
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm* out_comm = nullptr;  // dup, split
  int color = 0, key = 0;        // split
  std::vector<MPI_Request> reqs;
#endif
  std::mutex mu;
  std::condition_variable cv;
  bool complete = false;
  std::string error;
  Clock::time_point submitted = Clock::now(), started_at = submitted, finished_at = submitted;
};

// ---- the world ------------------------------------------------------------------------------

namespace {

struct World {
  int rank = 0, size = 1;
  bool mpi = false;
  std::atomic<double> timeout_s{60.0};
  // Threads blocked in Request::wait(): while there are any, the communication thread polls
  // without backing off (see the loop).
  std::atomic<int> waiters{0};
  // Communication thread.
  std::thread thread;
  std::thread::id thread_id;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Pending>> queue;
  bool stop = false;
  // Abort: the first abort_job() fills these; the thread sends and aborts.
  std::atomic<bool> aborting{false};  // abort_job() was called (first caller wins)
  bool abort_requested = false;        // under mu, once abort_message is set
  std::string abort_message;
  int abort_code = 1;
  // Heartbeats (the loop's heartbeat()): every rank's host name, and how long its left neighbour
  // may be silent.
  std::vector<std::string> hosts;
  std::atomic<double> silent_s{10.0};
#ifdef FLOWRUN_MPI
  MPI_Comm control = MPI_COMM_NULL;  // failure notices between ranks
  MPI_Request control_req = MPI_REQUEST_NULL;
  char control_buf[4096] = {};
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Comm beat = MPI_COMM_NULL;  // heartbeats around the ring of ranks
  MPI_Request beat_recv = MPI_REQUEST_NULL, beat_send = MPI_REQUEST_NULL;
  char beat_in = 0, beat_out = 'b';
  bool watching = false;  // the left neighbour has not said goodbye
  Clock::time_point heard, sent, last_turn;
#endif
};

World& world() {
  static World w;
  return w;
}

constexpr int kTagFailure = 7;
constexpr int kTagBeat = 10;  // on the heartbeat communicator
constexpr int kTagBlocks = 8;  // on a channel's communicator: reduce_scatter's and allgather_blocks' messages
constexpr int kTagPoint = 9;   // on a channel's communicator: send's and recv's

[[noreturn]] void sleep_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

void complete(Pending& p, std::string error = "") {
  std::lock_guard<std::mutex> l(p.mu);
  p.error = std::move(error);
  p.finished_at = Clock::now();
  p.complete = true;
  p.cv.notify_all();
}

#ifdef FLOWRUN_MPI

// bf16 sum for MPI: add in fp32, round to nearest even (what a bf16 all-reduce on NCCL does).
float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
void bf16_sum_fn(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::bf16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op mpi_op(Op op, DType t) {
  if (t == DType::bf16) return world().bf16_sum;  // checked at submit: sum only
  switch (op) {
    case Op::sum: return MPI_SUM;
    case Op::max: return MPI_MAX;
    case Op::min: return MPI_MIN;
  }
  return MPI_SUM;
}

std::string mpi_error(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, buf, &n);
  return std::string(buf, static_cast<size_t>(n));
}

// MPI counts are ints: large buffers go in pieces of at most this many elements.
constexpr size_t kMaxPiece = size_t{1} << 30;

// On the communication thread: post the non-blocking MPI calls of `p`.
void start(Pending& p) {
  p.started_at = Clock::now();
  int rc = MPI_SUCCESS;
  auto post = [&](int r, const MPI_Request& q) {  // q by reference: read after the call set it
    if (r != MPI_SUCCESS) rc = r;
    else p.reqs.push_back(q);
  };
  MPI_Request q = MPI_REQUEST_NULL;
  switch (p.kind) {
    case Kind::allreduce: {
      const size_t es = dtype_size(p.type);
      for (size_t off = 0; off < p.count; off += kMaxPiece) {
        const int n = static_cast<int>(std::min(kMaxPiece, p.count - off));
        post(MPI_Iallreduce(MPI_IN_PLACE, static_cast<char*>(p.data) + off * es, n, mpi_type(p.type),
                            mpi_op(p.op, p.type), p.comm, &q), q);
      }
      break;
    }
    case Kind::broadcast:
      for (size_t off = 0; off < p.bytes; off += kMaxPiece) {
        const int n = static_cast<int>(std::min(kMaxPiece, p.bytes - off));
        post(MPI_Ibcast(static_cast<char*>(p.data) + off, n, MPI_BYTE, p.root, p.comm, &q), q);
      }
      break;
    case Kind::allgather:
      post(MPI_Iallgather(p.in, static_cast<int>(p.bytes), MPI_BYTE, p.data, static_cast<int>(p.bytes), MPI_BYTE,
                          p.comm, &q), q);
      break;
    case Kind::allgather_blocks: {
      // Point to point: this rank's block to every other rank, theirs straight into their
      // places. (Open MPI's non-blocking MPI_Iallgatherv and MPI_Ireduce_scatter, libnbc, take
      // 2 to 3 times as long on 2 ranks: linear through one rank, reduce-then-scatter.)
      // Only moved, never added: any MPI type of the element's size will do.
      const MPI_Datatype t = p.element_size == 1 ? MPI_UINT8_T : p.element_size == 2 ? MPI_UINT16_T
                           : p.element_size == 4 ? MPI_UINT32_T : MPI_UINT64_T;
      const int me = p.me;
      char* data = static_cast<char*>(p.data);
      for (int r = 0; r < static_cast<int>(p.counts.size()); ++r) {
        if (r == me) continue;
        const size_t at = static_cast<size_t>(p.displs[static_cast<size_t>(r)]) * p.element_size;
        if (p.counts[static_cast<size_t>(r)] > 0)
          post(MPI_Irecv(data + at, p.counts[static_cast<size_t>(r)], t, r, kTagBlocks, p.comm, &q), q);
        if (p.counts[static_cast<size_t>(me)] > 0)
          post(MPI_Isend(data + static_cast<size_t>(p.displs[static_cast<size_t>(me)]) * p.element_size,
                         p.counts[static_cast<size_t>(me)], t, r, kTagBlocks, p.comm, &q), q);
      }
      break;
    }
    case Kind::reduce_scatter: {
      // Point to point: block r to rank r; the others' blocks of this rank's part into scratch,
      // reduced when all arrived (finish_reduce_scatter).
      const size_t es = dtype_size(p.type);
      const int me = p.me;
      const size_t mine = static_cast<size_t>(p.counts[static_cast<size_t>(me)]);
      p.scratch.resize(mine * es * p.counts.size());
      for (int r = 0; r < static_cast<int>(p.counts.size()); ++r) {
        if (r == me) continue;
        if (mine > 0)
          post(MPI_Irecv(p.scratch.data() + static_cast<size_t>(r) * mine * es, static_cast<int>(mine),
                         mpi_type(p.type), r, kTagBlocks, p.comm, &q), q);
        if (p.counts[static_cast<size_t>(r)] > 0)
          post(MPI_Isend(static_cast<const char*>(p.in) + static_cast<size_t>(p.displs[static_cast<size_t>(r)]) * es,
                         p.counts[static_cast<size_t>(r)], mpi_type(p.type), r, kTagBlocks, p.comm, &q), q);
      }
      break;
    }
    case Kind::all_to_all: {
      // Point to point, as allgather_blocks: block r of `in` to rank r, rank r's block for this
      // one into its place in `data` (this rank's own block was copied when submitted). A block
      // of no elements is no message on either end (the counts agree: each rank's receive count
      // from r is r's send count to it).
      const MPI_Datatype t = p.element_size == 1 ? MPI_UINT8_T : p.element_size == 2 ? MPI_UINT16_T
                           : p.element_size == 4 ? MPI_UINT32_T : MPI_UINT64_T;
      for (int r = 0; r < static_cast<int>(p.counts.size()); ++r) {
        if (r == p.me) continue;
        const size_t k = static_cast<size_t>(r);
        if (p.recv_counts[k] > 0)
          post(MPI_Irecv(static_cast<char*>(p.data) + static_cast<size_t>(p.recv_displs[k]) * p.element_size,
                         p.recv_counts[k], t, r, kTagBlocks, p.comm, &q), q);
        if (p.counts[k] > 0)
          post(MPI_Isend(static_cast<const char*>(p.in) + static_cast<size_t>(p.displs[k]) * p.element_size, p.counts[k],
                         t, r, kTagBlocks, p.comm, &q), q);
      }
      break;
    }
    case Kind::send:
    case Kind::recv:
      // In pieces of kMaxPiece bytes, all with one tag: MPI keeps the order of the messages
      // between two ranks with one tag, so the pieces (and whole messages) pair up in order.
      for (size_t off = 0; off < p.bytes; off += kMaxPiece) {
        const int n = static_cast<int>(std::min(kMaxPiece, p.bytes - off));
        if (p.kind == Kind::send)
          post(MPI_Isend(static_cast<const char*>(p.in) + off, n, MPI_BYTE, p.root, kTagPoint, p.comm, &q), q);
        else
          post(MPI_Irecv(static_cast<char*>(p.data) + off, n, MPI_BYTE, p.root, kTagPoint, p.comm, &q), q);
      }
      break;
    case Kind::barrier:
      post(MPI_Ibarrier(p.comm, &q), q);
      break;
    case Kind::dup:
      post(MPI_Comm_idup(MPI_COMM_WORLD, p.out_comm, &q), q);
      break;
    case Kind::split:
      // MPI has no non-blocking split: first a non-blocking barrier (on the heartbeats'
      // communicator, whose only collective this is), so the thread goes on beating while the
      // slowest rank gets here; the split itself, blocking but brief, when it completes (test()).
      post(MPI_Ibarrier(world().beat, &q), q);
      break;
  }
  if (rc != MPI_SUCCESS) {
    for (auto& r : p.reqs) MPI_Request_free(&r);
    p.reqs.clear();
    complete(p, p.what + ": " + mpi_error(rc));
  } else if (p.reqs.empty()) {
    complete(p);  // nothing to move (count 0)
  }
}

// A reduce-scatter whose messages all arrived: data = op of every rank's block of this rank's
// part, in rank order (this rank's own from `in`), whatever order they arrived in.
int finish_reduce_scatter(Pending& p) {
  const size_t es = dtype_size(p.type);
  const int me = p.me;
  const int mine = p.counts[static_cast<size_t>(me)];
  if (mine == 0) return MPI_SUCCESS;
  auto block = [&](int r) -> const void* {
    return r == me ? static_cast<const char*>(p.in) + static_cast<size_t>(p.displs[static_cast<size_t>(me)]) * es
                   : p.scratch.data() + static_cast<size_t>(r) * static_cast<size_t>(mine) * es;
  };
  std::memcpy(p.data, block(0), static_cast<size_t>(mine) * es);
  for (int r = 1; r < static_cast<int>(p.counts.size()); ++r) {
    const int rc = MPI_Reduce_local(block(r), p.data, mine, mpi_type(p.type), mpi_op(p.op, p.type));
    if (rc != MPI_SUCCESS) return rc;
  }
  std::vector<char>().swap(p.scratch);
  return MPI_SUCCESS;
}

// True once every piece of `p` finished.
bool test(Pending& p) {
  int flag = 0;
  int rc = MPI_Testall(static_cast<int>(p.reqs.size()), p.reqs.data(), &flag, MPI_STATUSES_IGNORE);
  if (rc == MPI_SUCCESS && flag && p.kind == Kind::reduce_scatter) rc = finish_reduce_scatter(p);
  if (rc == MPI_SUCCESS && flag && p.kind == Kind::split) {  // every rank is here: the split (start())
    rc = MPI_Comm_split(MPI_COMM_WORLD, p.color, p.key, p.out_comm);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(*p.out_comm, MPI_ERRORS_RETURN);
  }
  if (rc != MPI_SUCCESS) {
    complete(p, p.what + ": " + mpi_error(rc));
    return true;
  }
  if (flag) complete(p);
  return flag != 0;
}

[[noreturn]] void mpi_abort(int code) {
  spdlog::default_logger()->flush();
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

// On the communication thread: tell the others why, then end the job.
[[noreturn]] void do_abort() {
  World& w = world();
  // "CODE\nMESSAGE": the others end with this rank's exit code, so the job's is the same whichever
  // rank mpirun hears from first (a setting every rank refuses alike exits 2 everywhere).
  std::string text = (std::to_string(w.abort_code) + "\n" + w.abort_message).substr(0, sizeof w.control_buf - 1);
  std::vector<MPI_Request> sends;
  for (int r = 0; r < w.size; ++r) {
    if (r == w.rank) continue;
    MPI_Request q = MPI_REQUEST_NULL;
    if (MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kTagFailure, w.control, &q) == MPI_SUCCESS)
      sends.push_back(q);
  }
  // Give the notices up to 2 s to leave (a dead peer never takes its message).
  const auto until = Clock::now() + std::chrono::seconds(2);
  int flag = 0;
  while (!flag && Clock::now() < until) {
    MPI_Testall(static_cast<int>(sends.size()), sends.data(), &flag, MPI_STATUSES_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  mpi_abort(w.abort_code);
}

// On the communication thread: another rank failed and said why.
[[noreturn]] void peer_failed(int source, int length) {
  World& w = world();
  std::string text(w.control_buf, static_cast<size_t>(std::max(0, length)));
  int code = 1;
  if (const size_t nl = text.find('\n'); nl != std::string::npos && nl > 0 && nl < 4) {
    code = std::atoi(text.substr(0, nl).c_str());
    text.erase(0, nl + 1);
    if (code <= 0 || code > 255) code = 1;
  }
  spdlog::error("rank {} failed, so the job ends here too. Its error: {}", source, text);
  mpi_abort(code);
}

// Heartbeats, on the communication thread (which never blocks inside MPI, whatever the nodes are
// doing): each rank sends its right neighbour in the ring (rank + 1) a byte every second (five
// per timeout, if that is shorter) and watches its left one. A neighbour silent for silent_s
// (run.heartbeat_timeout_s) has lost its process, its host or its link: this rank ends the job
// naming it and its host, within seconds instead of waiting out a collective's
// run.comm_timeout_s (or TCP's minutes). A rank that ends normally says goodbye ('q') first, so
// its watcher stops watching. A turn of the loop that came late (the thread was inside a blocking
// MPI call) restarts the clock: the neighbour may have been in the same call.
void heartbeat(World& w, bool goodbye = false) {
  const auto now = Clock::now();
  const int right = (w.rank + 1) % w.size, left = (w.rank + w.size - 1) % w.size;
  if (now - w.last_turn > std::chrono::seconds(1)) w.heard = now;
  w.last_turn = now;
  // A beat every second, or five per timeout when that is shorter (a beat late by scheduling
  // never looks like silence).
  const double every = std::min(1.0, w.silent_s.load() / 5);
  if (goodbye || std::chrono::duration<double>(now - w.sent).count() >= every) {
    int done = 1;
    if (w.beat_send != MPI_REQUEST_NULL) MPI_Test(&w.beat_send, &done, MPI_STATUS_IGNORE);
    if (done) {
      w.beat_out = goodbye ? 'q' : 'b';
      MPI_Isend(&w.beat_out, 1, MPI_CHAR, right, kTagBeat, w.beat, &w.beat_send);
      w.sent = now;
    }
  }
  if (!w.watching) return;
  int flag = 0;
  const int rc = MPI_Test(&w.beat_recv, &flag, MPI_STATUS_IGNORE);
  std::string lost;
  if (rc != MPI_SUCCESS) {
    lost = "its connection failed (" + mpi_error(rc) + ")";
  } else if (flag) {
    w.heard = now;
    if (w.beat_in == 'q')
      w.watching = false;
    else
      MPI_Irecv(&w.beat_in, 1, MPI_CHAR, left, kTagBeat, w.beat, &w.beat_recv);
    return;
  } else if (std::chrono::duration<double>(now - w.heard).count() > w.silent_s.load()) {
    lost = fmt::format("no heartbeat for {:g} s (run.heartbeat_timeout_s)", w.silent_s.load());
  }
  if (lost.empty()) return;
  const std::string host = static_cast<size_t>(left) < w.hosts.size() ? w.hosts[static_cast<size_t>(left)] : "?";
  if (w.aborting.exchange(true)) sleep_forever();
  w.abort_message = "rank " + std::to_string(left) + " on host " + host + " went silent: " + lost +
                    "; its process died or hangs, or its host or the network link to it is down (rank " +
                    std::to_string(w.rank) + " on host " + w.hosts[static_cast<size_t>(w.rank)] + " noticed)";
  w.abort_code = 1;
  spdlog::error("{}; ending the job on all {} ranks", w.abort_message, w.size);
  do_abort();
}

void loop() {
  World& w = world();
  std::vector<std::shared_ptr<Pending>> active;
  int idle = 0;
  for (;;) {
    std::deque<std::shared_ptr<Pending>> fresh;
    bool stopping = false, abort = false;
    {
      std::unique_lock<std::mutex> l(w.mu);
      if (active.empty() && w.queue.empty() && !w.stop && !w.abort_requested)
        w.cv.wait_for(l, std::chrono::milliseconds(5));  // idle: still look at failure notices below
      fresh.swap(w.queue);
      stopping = w.stop;
      abort = w.abort_requested;
    }
    if (abort) do_abort();
    bool progress = !fresh.empty();
    for (auto& p : fresh) {
      start(*p);
      if (!p->complete) active.push_back(std::move(p));
    }
    for (size_t i = 0; i < active.size();) {
      if (test(*active[i])) {
        active.erase(active.begin() + static_cast<long>(i));
        progress = true;
      } else {
        ++i;
      }
    }
    int flag = 0;
    MPI_Status st;
    MPI_Test(&w.control_req, &flag, &st);
    if (flag) {
      int n = 0;
      MPI_Get_count(&st, MPI_CHAR, &n);
      peer_failed(st.MPI_SOURCE, n);
    }
    if (stopping && active.empty()) {
      heartbeat(w, /*goodbye=*/true);
      return;
    }
    heartbeat(w);
    // Non-blocking collectives progress only inside MPI calls, so poll while any is active;
    // back off when nothing completed, so the thread does not take a core from the compute,
    // unless a node is blocked waiting for one: then nothing computes in its place, and a large
    // message, which moves a few fragments per MPI call, would take a sleep per fragment (an
    // 85 MB all-gather on the 2-core CI machine: 0.45 s backing off, 0.1 s polling).
    if (!active.empty()) {
      if (progress || w.waiters.load(std::memory_order_relaxed) > 0) {
        idle = 0;
        std::this_thread::yield();
      } else {
        idle = std::min(idle + 1, 5);
        std::this_thread::sleep_for(std::chrono::microseconds(10 << idle));  // 20..320 us
      }
    }
  }
}

#endif  // FLOWRUN_MPI

std::shared_ptr<Pending> submit(std::shared_ptr<Pending> p) {
  World& w = world();
  std::lock_guard<std::mutex> l(w.mu);
  if (w.stop) throw CommError(p->what + ": the communication thread has stopped");
  w.queue.push_back(p);
  w.cv.notify_one();
  return p;
}

}  // namespace

// ---- init / finalize ------------------------------------------------------------------------

void init(int* argc, char*** argv) {
  World& w = world();
  const char* var = launcher_variable();
  const int slurm_tasks = env_int("SLURM_STEP_NUM_TASKS", 1);
#ifdef FLOWRUN_MPI
  if (!var && slurm_tasks <= 1) return;
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
    throw CommError("MPI_Init_thread failed");
  if (provided < MPI_THREAD_SERIALIZED)
    throw CommError("this MPI library offers thread level " + std::to_string(provided) +
                    "; flowrun needs MPI_THREAD_SERIALIZED (its communication thread makes the MPI calls)");
  MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.size);
  w.mpi = true;
  if (slurm_tasks > 1 && w.size == 1)
    throw CommError("srun started " + std::to_string(slurm_tasks) +
                    " tasks but MPI sees a world of one process: start them with `srun --mpi=pmix` (or pmi2) so MPI "
                    "can find the others");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_dup(MPI_COMM_WORLD, &w.control);
  MPI_Comm_set_errhandler(w.control, MPI_ERRORS_RETURN);
  MPI_Irecv(w.control_buf, sizeof w.control_buf, MPI_CHAR, MPI_ANY_SOURCE, kTagFailure, w.control, &w.control_req);
  MPI_Op_create(&bf16_sum_fn, /*commute=*/1, &w.bf16_sum);
  // Every rank's host name (for messages), and the heartbeats' ring.
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::vector<char> hosts(sizeof host * static_cast<size_t>(w.size));
  MPI_Allgather(host, sizeof host, MPI_CHAR, hosts.data(), sizeof host, MPI_CHAR, MPI_COMM_WORLD);
  for (int r = 0; r < w.size; ++r) w.hosts.emplace_back(hosts.data() + sizeof host * static_cast<size_t>(r));
  MPI_Comm_dup(MPI_COMM_WORLD, &w.beat);
  MPI_Comm_set_errhandler(w.beat, MPI_ERRORS_RETURN);
  w.heard = w.sent = w.last_turn = Clock::now();
  if (w.size > 1) {
    MPI_Irecv(&w.beat_in, 1, MPI_CHAR, (w.rank + w.size - 1) % w.size, kTagBeat, w.beat, &w.beat_recv);
    w.watching = true;
  }
  w.thread = std::thread(loop);
  w.thread_id = w.thread.get_id();
#else
  (void)argc;
  (void)argv;
  if (var || slurm_tasks > 1)
    throw CommError(std::string("started by an MPI launcher (") + (var ? var : "SLURM_STEP_NUM_TASKS") +
                    " is set) but this flowrun was built without MPI: install libopenmpi-dev and rebuild");
#endif
}

void finalize() {
  World& w = world();
  if (!w.mpi) return;
#ifdef FLOWRUN_MPI
  {
    std::lock_guard<std::mutex> l(w.mu);
    w.stop = true;
    w.cv.notify_one();
  }
  if (w.thread.joinable()) w.thread.join();
  MPI_Cancel(&w.control_req);
  MPI_Wait(&w.control_req, MPI_STATUS_IGNORE);
  if (w.watching) {
    MPI_Cancel(&w.beat_recv);
    MPI_Wait(&w.beat_recv, MPI_STATUS_IGNORE);
  }
  if (w.beat_send != MPI_REQUEST_NULL) MPI_Request_free(&w.beat_send);  // a byte; its neighbour may be gone
  MPI_Finalize();
  w.mpi = false;
#endif
}

int rank() { return world().rank; }
int size() { return world().size; }
int local_rank() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char* s = std::getenv(v); s && *s) return std::atoi(s);
  return 0;
}
int local_size() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"})
    if (const char* s = std::getenv(v); s && *s) return std::max(1, std::atoi(s));
  return 1;
}
std::string where() {
  return size() > 1 ? "rank " + std::to_string(rank()) + " of " + std::to_string(size()) : "single process";
}

void set_timeout(double seconds) { world().timeout_s.store(seconds > 0 ? seconds : 60.0); }
void set_heartbeat_timeout(double seconds) { world().silent_s.store(seconds > 0 ? seconds : 10.0); }
std::string host_of(int rank) {
  const World& w = world();
  return rank >= 0 && static_cast<size_t>(rank) < w.hosts.size() ? w.hosts[static_cast<size_t>(rank)] : host_name();
}
double timeout() { return world().timeout_s.load(); }

// ---- requests -------------------------------------------------------------------------------

void Request::wait() {
  if (!p_) return;
  std::unique_lock<std::mutex> l(p_->mu);
  const double t = timeout();
  struct Waiting {  // counted while blocked (the communication thread then polls hot)
    Waiting() { world().waiters.fetch_add(1); }
    ~Waiting() { world().waiters.fetch_sub(1); }
  } waiting;
  if (!p_->cv.wait_for(l, std::chrono::duration<double>(t), [&] { return p_->complete; }))
    throw CommError(p_->what + ": no answer from the other ranks in " + fmt::format("{:g}", t) +
                    " s (run.comm_timeout_s): a rank has died or is stuck");
  if (!p_->error.empty()) throw CommError(p_->error);
}

bool Request::done() const {
  if (!p_) return true;
  std::lock_guard<std::mutex> l(p_->mu);
  return p_->complete;
}

Clock::time_point Request::started() const {
  if (!p_) return Clock::now();
  std::lock_guard<std::mutex> l(p_->mu);
  return p_->started_at;
}

Clock::time_point Request::finished() const {
  if (!p_) return Clock::now();
  std::lock_guard<std::mutex> l(p_->mu);
  return p_->finished_at;
}

// ---- channels -------------------------------------------------------------------------------

struct Channel::Impl {
#ifdef FLOWRUN_MPI
  MPI_Comm comm = MPI_COMM_NULL;
#endif
};

Channel::Channel(std::string name, std::unique_ptr<Impl> impl, int rank, int size)
    : name_(std::move(name)), rank_(rank), size_(size), impl_(std::move(impl)) {}
Channel::~Channel() = default;  // communicators are freed by MPI_Finalize

namespace {
// The group of every channel created, in creation order (its size: how many were created).
std::mutex created_mu;
std::vector<std::string> created_groups;
void note_created(const std::string& group) {
  std::lock_guard<std::mutex> l(created_mu);
  created_groups.push_back(group);
}
}  // namespace

uint64_t Channel::created() {
  std::lock_guard<std::mutex> l(created_mu);
  return created_groups.size();
}

std::vector<std::string> Channel::groups_created_since(uint64_t count) {
  std::lock_guard<std::mutex> l(created_mu);
  if (count >= created_groups.size()) return {};
  return {created_groups.begin() + static_cast<std::ptrdiff_t>(count), created_groups.end()};
}

namespace {
// A channel's communicator (MPI_COMM_WORLD duplicated, or split by color and key) made on the
// communication thread; the channel's rank and size in it. Nothing in a single-process world.
std::unique_ptr<Channel::Impl> make_communicator(Kind kind, const std::string& what, int color, int key, int* rank,
                                                 int* size) {
  auto impl = std::make_unique<Channel::Impl>();
  *rank = comm::rank(), *size = comm::size();
#ifdef FLOWRUN_MPI
  if (world().mpi && world().size > 1) {
    auto p = std::make_shared<Pending>();
    p->kind = kind;
    p->what = what;
    p->out_comm = &impl->comm;
    p->color = color;
    p->key = key;
    Request(submit(p)).wait();
    // Rank and size of a communicator are local queries, safe off the communication thread.
    MPI_Comm_rank(impl->comm, rank);
    MPI_Comm_size(impl->comm, size);
  }
#else
  (void)kind, (void)what, (void)color, (void)key;
#endif
  return impl;
}
}  // namespace

std::shared_ptr<Channel> Channel::create(const std::string& name, const std::string& group) {
  int r = 0, n = 1;
  auto impl = make_communicator(Kind::dup, "'" + name + "': creating its communicator", 0, 0, &r, &n);
  note_created(group);
  return std::shared_ptr<Channel>(new Channel(name, std::move(impl), r, n));
}

std::shared_ptr<Channel> Channel::create_split(const std::string& name, int color, int key, const std::string& group) {
  if (color < 0) throw CommError("'" + name + "': split color " + std::to_string(color) + " (colors are 0-based)");
  int r = 0, n = 1;
  auto impl = make_communicator(Kind::split, "'" + name + "': splitting the world into its groups", color, key, &r, &n);
  note_created(group);
  return std::shared_ptr<Channel>(new Channel(name, std::move(impl), r, n));
}

namespace {
std::shared_ptr<Pending> make(Kind k, const std::string& channel, const std::string& what) {
  auto p = std::make_shared<Pending>();
  p->kind = k;
  p->what = "'" + channel + "': " + what;
  return p;
}

// Blocks per rank (allgather_blocks, reduce_scatter): one count per rank of the channel.
void check_counts(const std::vector<size_t>& counts, int ranks, const std::string& what) {
  if (counts.size() != static_cast<size_t>(ranks))
    throw CommError(what + ": " + std::to_string(counts.size()) + " counts for " + std::to_string(ranks) + " ranks");
}

// The blocks' MPI counts and displacements (elements; ints, as MPI's).
[[maybe_unused]] void set_blocks(Pending& p, const std::vector<size_t>& counts) {
  size_t at = 0;
  for (size_t c : counts) {
    if (at + c > static_cast<size_t>(INT_MAX)) throw CommError(p.what + ": more than 2^31 elements (MPI counts are ints)");
    p.counts.push_back(static_cast<int>(c));
    p.displs.push_back(static_cast<int>(at));
    at += c;
  }
}
}  // namespace

Request Channel::allreduce(void* data, size_t count, DType type, Op op, const std::string& what) {
  if (type == DType::bf16 && op != Op::sum) throw CommError("'" + name_ + "': " + what + ": bf16 all-reduce supports only sum");
  if (size_ == 1) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(Kind::allreduce, name_, what);
  p->data = data, p->count = count, p->type = type, p->op = op, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

Request Channel::broadcast(void* data, size_t bytes, int root, const std::string& what) {
  if (size_ == 1) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(Kind::broadcast, name_, what);
  p->data = data, p->bytes = bytes, p->root = root, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

Request Channel::allgather(const void* mine, void* all, size_t bytes_each, const std::string& what) {
  if (size_ == 1) {
    std::memcpy(all, mine, bytes_each);
    return Request();
  }
  if (bytes_each > static_cast<size_t>(INT_MAX)) throw CommError("'" + name_ + "': " + what + ": allgather of more than 2 GB");
#ifdef FLOWRUN_MPI
  auto p = make(Kind::allgather, name_, what);
  p->in = mine, p->data = all, p->bytes = bytes_each, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

Request Channel::allgather_blocks(void* data, const std::vector<size_t>& counts, size_t element_size,
                                 const std::string& what) {
  if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8)
    throw CommError("'" + name_ + "': " + what + ": elements of " + std::to_string(element_size) + " bytes");
  check_counts(counts, size_, "'" + name_ + "': " + what);
  if (size_ == 1) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(Kind::allgather_blocks, name_, what);
  set_blocks(*p, counts);
  p->me = rank_;
  p->data = data, p->element_size = element_size, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

Request Channel::reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType type, Op op,
                               const std::string& what) {
  if (type == DType::bf16 && op != Op::sum) throw CommError("'" + name_ + "': " + what + ": bf16 reduce-scatter supports only sum");
  check_counts(counts, size_, "'" + name_ + "': " + what);
  if (size_ == 1) {
    std::memcpy(recv, send, counts.front() * dtype_size(type));
    return Request();
  }
#ifdef FLOWRUN_MPI
  auto p = make(Kind::reduce_scatter, name_, what);
  set_blocks(*p, counts);
  p->me = rank_;
  p->in = send, p->data = recv, p->type = type, p->op = op, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

Request Channel::all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                            const std::vector<size_t>& recv_counts, size_t element_size, const std::string& what) {
  if (element_size != 1 && element_size != 2 && element_size != 4 && element_size != 8)
    throw CommError("'" + name_ + "': " + what + ": elements of " + std::to_string(element_size) + " bytes");
  check_counts(send_counts, size_, "'" + name_ + "': " + what + " (sent)");
  check_counts(recv_counts, size_, "'" + name_ + "': " + what + " (received)");
  auto at = [](const std::vector<size_t>& counts, int r) {
    size_t a = 0;
    for (int q = 0; q < r; ++q) a += counts[static_cast<size_t>(q)];
    return a;
  };
  const size_t mine = send_counts[static_cast<size_t>(rank_)];
  if (mine != recv_counts[static_cast<size_t>(rank_)])
    throw CommError("'" + name_ + "': " + what + ": this rank sends itself " + std::to_string(mine) + " elements and expects " +
                    std::to_string(recv_counts[static_cast<size_t>(rank_)]));
  if (mine > 0)
    std::memcpy(static_cast<char*>(recv) + at(recv_counts, rank_) * element_size,
                static_cast<const char*>(send) + at(send_counts, rank_) * element_size, mine * element_size);
  if (size_ == 1) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(Kind::all_to_all, name_, what);
  set_blocks(*p, recv_counts);  // set_blocks fills counts and displs: the received blocks' first
  p->recv_counts = std::exchange(p->counts, {});
  p->recv_displs = std::exchange(p->displs, {});
  set_blocks(*p, send_counts);
  p->me = rank_;
  p->in = send, p->data = recv, p->element_size = element_size, p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

void Channel::check_peer(int peer, const std::string& what) const {
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw CommError("'" + name_ + "': " + what + ": rank " + std::to_string(peer) + " is not another rank of this group of " +
                    std::to_string(size_) + " (this one is rank " + std::to_string(rank_) + ")");
}

Request Channel::send(const void* data, size_t bytes, int peer, const std::string& what) {
  return point(const_cast<void*>(data), bytes, peer, what, true);  // a send only reads it
}

Request Channel::recv(void* data, size_t bytes, int peer, const std::string& what) {
  return point(data, bytes, peer, what, false);
}

Request Channel::point(void* data, size_t bytes, int peer, const std::string& what, bool sending) {
  check_peer(peer, what);
  if (bytes == 0) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(sending ? Kind::send : Kind::recv, name_, what);
  p->in = data, p->data = data, p->bytes = bytes, p->root = peer, p->comm = impl_->comm;
  return Request(submit(p));
#else
  (void)data;
  return Request();
#endif
}

Request Channel::barrier(const std::string& what) {
  if (size_ == 1) return Request();
#ifdef FLOWRUN_MPI
  auto p = make(Kind::barrier, name_, what);
  p->comm = impl_->comm;
  return Request(submit(p));
#else
  return Request();
#endif
}

void allreduce(Channel& ch, double* data, size_t count, Op op, const std::string& what) {
  ch.allreduce(data, count, DType::f64, op, what).wait();
}

void broadcast(Channel& ch, void* data, size_t bytes, int root, const std::string& what) {
  ch.broadcast(data, bytes, root, what).wait();
}

std::vector<std::string> allgather_text(Channel& ch, const std::string& mine, const std::string& what) {
  const auto n = static_cast<size_t>(ch.size());
  std::vector<uint64_t> lengths(n, 0);
  const uint64_t own = mine.size();
  ch.allgather(&own, lengths.data(), sizeof own, what + " (lengths)").wait();
  std::vector<size_t> counts(lengths.begin(), lengths.end());
  size_t total = 0, at = 0;
  for (size_t c : counts) total += c;
  std::string all(total, '\0');
  for (size_t r = 0; r < static_cast<size_t>(ch.rank()); ++r) at += counts[r];
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(at));
  if (total > 0) ch.allgather_blocks(all.data(), counts, 1, what).wait();
  std::vector<std::string> out;
  at = 0;
  for (size_t c : counts) {
    out.push_back(all.substr(at, c));
    at += c;
  }
  return out;
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

// ---- failure --------------------------------------------------------------------------------

void abort_job(const std::string& message, int code) {
  World& w = world();
  if (!w.mpi || w.size == 1) return;
#ifdef FLOWRUN_MPI
  if (w.aborting.exchange(true)) sleep_forever();  // someone else is ending the job
  spdlog::error("{}; ending the job on all {} ranks", message, w.size);
  {
    std::lock_guard<std::mutex> l(w.mu);
    w.abort_message = message;
    w.abort_code = code;
    w.abort_requested = true;
    w.cv.notify_one();
  }
  if (std::this_thread::get_id() == w.thread_id) do_abort();
  if (!w.thread.joinable()) do_abort();  // the thread is gone (after finalize began)
  sleep_forever();                         // the communication thread ends the process
#else
  (void)message;
  (void)code;
#endif
}

}  // namespace flowrun::comm
