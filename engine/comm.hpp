// The world of processes a run spans, and collectives between them (MPI).
//
// Launched by mpirun or srun, every process is a rank of one MPI world; launched plainly,
// the world is this process alone and nothing here ever calls MPI (no MPI on the hot path).
//
// Threading: after init(), one communication thread makes every MPI call (MPI_THREAD_SERIALIZED),
// and only non-blocking ones (MPI_Iallreduce, MPI_Ibcast, ...), polling them all. Nodes on
// executor threads submit operations and get a Request to wait on. Because the thread never
// blocks inside MPI, a collective that the other ranks have not joined yet never stops the
// others from progressing, and a failure message from another rank is always noticed.
//
// Ordering: MPI matches collectives on a communicator by their order, but the executor runs
// nodes of different steps concurrently, so a metrics all-reduce and a gradient all-reduce may
// be issued in different orders on different ranks. Each user therefore gets its own Channel
// (a duplicated communicator); within a channel, every rank issues the same collectives in the
// same order (a node runs its steps one at a time, in step order).
//
// Faults: a wait longer than timeout() throws CommError (the job is hung: a rank died or is
// stuck). Sooner, heartbeats: each rank's communication thread beats to its right neighbour in
// the ring every second and watches its left one; a neighbour silent for set_heartbeat_timeout()
// ends the job, naming the rank and host that went silent (a killed process, a dead host, a link
// down: what a collective would otherwise wait out). abort_job() tells every other rank why
// (they log it, naming this rank) and ends the whole job with MPI_Abort, so one failing rank
// never leaves the others waiting forever.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace flowrun::comm {

using Clock = std::chrono::steady_clock;

// Start MPI if this process was started by an MPI launcher (mpirun, mpiexec, srun: their
// environment variables), else the world is this process alone. Call once, early in main().
// Throws when launched by a launcher but flowrun was built without MPI.
void init(int* argc, char*** argv);
// After a run that ended normally on this rank: stop the communication thread, MPI_Finalize.
void finalize();

int rank();
int size();
// This process's index among the ranks on its machine (the launcher's local rank: Open MPI,
// Slurm, torchrun variables), 0 for a single process. Picks the GPU of `run.device: cuda`.
int local_rank();
// How many ranks share this machine (the same launchers' variables), 1 for a single process.
// Splits the cores: run.threads 0 = cores / local_size().
int local_size();
inline bool distributed() { return size() > 1; }
// "rank 1 of 4" (or "single process"), for messages.
std::string where();

// How long a collective may wait for the other ranks (run.comm_timeout_s; default 60 s).
void set_timeout(double seconds);
double timeout();
// How long a rank's neighbour in the ring may send no heartbeat before this rank ends the job
// naming it and its host (run.heartbeat_timeout_s; default 10 s). The communication thread beats
// every second whatever the nodes are doing, so only a dead process, host or link goes silent.
void set_heartbeat_timeout(double seconds);
// The host rank `rank` runs on (learned at init; this machine's name for a single process).
std::string host_of(int rank);

class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class DType { f32, f64, bf16, i32, i64, u8 };
enum class Op { sum, max, min };
size_t dtype_size(DType t);

struct Pending;  // comm.cpp

// A submitted operation. The buffers it names must stay alive and untouched until wait()
// returns. A default-constructed Request (or one of a single-process world) is already done.
class Request {
 public:
  Request() = default;
  explicit Request(std::shared_ptr<Pending> p) : p_(std::move(p)) {}
  // Block until done. Throws CommError after timeout() (naming the operation) or when the
  // operation failed.
  void wait();
  bool done() const;
  // When the communication thread started it and saw it complete (for traces); both equal
  // to the submit time for a request that needed no communication.
  Clock::time_point started() const;
  Clock::time_point finished() const;

 private:
  std::shared_ptr<Pending> p_;
};

class Channel {
 public:
  // Collective over all ranks: every rank must create its channels in the same order (nodes do
  // it in setup(), which runs in file order). `name` appears in error messages. `group`: the
  // mesh group the channel serves (world, dp, tp, pp: a world-wide dp when tp = pp = 1), which
  // a node's schema must declare among its `collectives:` (the executor checks after setup).
  static std::shared_ptr<Channel> create(const std::string& name, const std::string& group = "world");
  // Collective over all ranks, as create(): a channel among the ranks that pass the same `color`
  // (0-based, one group per color), ranked by `key` (MPI_Comm_split): the groups of one
  // dimension of a parallel mesh (nodes/parallel/mesh.hpp), `group` naming it (dp, tp, pp). Its
  // collectives count ranks in the group: rank() and size() are the group's, and counts have one
  // entry per member.
  static std::shared_ptr<Channel> create_split(const std::string& name, int color, int key, const std::string& group);
  // How many channels this process has created, and the groups of those created after the
  // first `count` (the executor tells the nodes that communicate, and checks that each declares
  // the groups it opened channels over, by what their setup() created).
  static uint64_t created();
  static std::vector<std::string> groups_created_since(uint64_t count);
  ~Channel();
  const std::string& name() const { return name_; }
  // This rank's place in the channel and the channel's size (the world's, unless create_split).
  int rank() const { return rank_; }
  int size() const { return size_; }

  // In place: data[i] = op over ranks of data[i]. bf16 supports only sum (added in fp32).
  Request allreduce(void* data, size_t count, DType type, Op op, const std::string& what);
  // bytes of data from `root` (its rank in the channel) to every rank.
  Request broadcast(void* data, size_t bytes, int root, const std::string& what);
  // all[r * bytes_each ...] = rank r's `mine`. `all` holds size() * bytes_each bytes.
  Request allgather(const void* mine, void* all, size_t bytes_each, const std::string& what);
  // In place: rank q's block of `data` (counts[q] elements of element_size bytes, the blocks one
  // after the other, the same counts on every rank) from rank q to every rank (an all-gather, sent
  // point to point).
  Request allgather_blocks(void* data, const std::vector<size_t>& counts, size_t element_size, const std::string& what);
  // recv = op over ranks of rank q's block of `send`, for this rank q (a reduce-scatter, sent
  // point to point and reduced in rank order):
  // `send` holds the blocks of every rank one after the other, counts[q] elements each (the
  // same counts on every rank); recv holds counts[rank()]. bf16 supports only sum.
  Request reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, DType type, Op op,
                         const std::string& what);
  // An all-to-all of uneven blocks (MPI_Alltoallv's): block q of `send` (send_counts[q] elements
  // of element_size bytes, the blocks one after the other) to rank q, rank q's block for this rank
  // into place q of `recv` (recv_counts[q] elements, one after the other), sent point to point.
  // The counts are each rank's own (rank q's send count to this rank must be this rank's
  // recv_counts[q]: exchange them first); this rank's own block is copied before it returns.
  Request all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                     const std::vector<size_t>& recv_counts, size_t element_size, const std::string& what);
  // Point to point: `bytes` of data to rank `peer` (its rank in the channel), or from it into
  // data. Between two ranks the messages of a channel are matched in the order each side issues
  // them (issue sends and receives in the same order on both ends: pipeline stages); the sizes
  // must agree. A rank has no channel to itself: peer == rank() is refused.
  Request send(const void* data, size_t bytes, int peer, const std::string& what);
  Request recv(void* data, size_t bytes, int peer, const std::string& what);
  // CommError unless `peer` is another rank of the channel (send's and recv's check, for the
  // backends beside MPI's too).
  void check_peer(int peer, const std::string& what) const;
  Request barrier(const std::string& what);

  struct Impl;

 private:
  Channel(std::string name, std::unique_ptr<Impl> impl, int rank, int size);
  Request point(void* data, size_t bytes, int peer, const std::string& what, bool sending);  // send, recv
  std::string name_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Impl> impl_;
};

// End the whole job because this rank failed: log `message`, send it to every other rank (each
// logs "rank R failed: MESSAGE" and ends too), then MPI_Abort(code). In a single-process world
// it only logs and returns (the caller exits as usual). Safe from any thread; only the first
// call acts, later ones wait for the end.
void abort_job(const std::string& message, int code = 1);

// Blocking helpers over a channel (submit + wait).
void allreduce(Channel& ch, double* data, size_t count, Op op, const std::string& what);
void broadcast(Channel& ch, void* data, size_t bytes, int root, const std::string& what);
// Every rank's `mine` (of any length), in the channel's rank order: the lengths, then the bytes.
std::vector<std::string> allgather_text(Channel& ch, const std::string& mine, const std::string& what);

// This machine's name (gethostname), for messages that name where a rank runs.
std::string host_name();

}  // namespace flowrun::comm
