// The one interface for collectives (docs/distributed.md): a group of ranks (the world, or one
// dimension of the mesh, parallel/mesh.hpp) and its collectives on tensors. CPU tensors go
// through MPI (engine/comm.hpp: the communication thread), CUDA ones through NCCL
// (parallel/nccl.hpp: a communicator with its own stream, bootstrapped over the group's MPI
// channel at the group's first CUDA collective). Nodes call this and hold no #if FLOWRUN_CUDA.
//
//   group_ = parallel::Group::world(ctx.name());     // setup(): every rank, in file order
//   parallel::Work w = group_->all_reduce(bucket, comm::Op::sum, "all-reduce of bucket 3 (step 7)");
//   ...                                               // returns at once: more work, more collectives
//   w.wait();    // the result is there for what comes next: on the CPU the host waited; on a GPU the
//                // current stream waits for it, the host does not
//   w.check();   // the next step: a GPU collective has ended (the host, within run.comm_timeout_s)
//
// Every rank issues the same collectives on a group in the same order (a node runs its steps one
// at a time, in step order); the tensors stay alive and untouched until wait() returned.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "comm.hpp"
#include "parallel/mesh.hpp"

namespace flowrun::parallel {

// The collectives' element type of a tensor dtype (float, double, bfloat16, uint8); else an error
// naming `who`.
comm::DType comm_dtype(torch::Dtype t, const std::string& who);

class Work {
 public:
  struct Impl {
    virtual ~Impl() = default;
    virtual void wait() = 0;
    virtual void check() = 0;
    virtual bool done() const = 0;
    virtual bool timed() const { return false; }
    virtual comm::Clock::time_point started() const { return {}; }
    virtual comm::Clock::time_point finished() const { return {}; }
  };
  Work() = default;  // nothing to wait for
  explicit Work(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  // What comes next sees the result: CPU, the host waited (CommError after run.comm_timeout_s);
  // CUDA, the calling thread's current stream waits for it on the device.
  void wait() {
    if (impl_) impl_->wait();
  }
  // The collective has ended, checked on the host within run.comm_timeout_s (a CUDA one: its
  // event; a CPU one has, once wait() returned).
  void check() {
    if (impl_) impl_->check();
  }
  // A host poll: it has ended.
  bool done() const { return !impl_ || impl_->done(); }
  // When it started and ended, for traces: known for MPI's (the communication thread saw them).
  bool timed() const { return impl_ && impl_->timed(); }
  comm::Clock::time_point started() const { return impl_ ? impl_->started() : comm::Clock::time_point(); }
  comm::Clock::time_point finished() const { return impl_ ? impl_->finished() : comm::Clock::time_point(); }

 private:
  std::shared_ptr<Impl> impl_;
};

class Group {
 public:
  // The world. Collective over every rank (a node's setup(): every rank, file order); `name`
  // names the group's channel in errors. A node's schema declares the groups it opens
  // (`collectives:`; the executor refuses a setup() that opened one undeclared).
  static std::shared_ptr<Group> world(const std::string& name);
  // `rank`'s group along `dim` of `mesh`, ranked by its coordinate there: the world itself (named
  // `name`) when the dimension spans every rank, else a split of it named "NAME (dim)"; either
  // way a channel of the group `dim`. Collective over the world.
  static std::shared_ptr<Group> along(const std::string& name, const Mesh& mesh, Dim dim, int rank);
  // `rank`'s place in its group along `dim` (rank and size, named "NAME (dim)") without a
  // channel: what a split model holds to know its part (parallel/tensor_parallel.hpp), whose
  // collectives run on the channel of the node running it. Creates nothing; a collective on it
  // is refused, naming the group.
  static std::shared_ptr<Group> place(const std::string& name, const Mesh& mesh, Dim dim, int rank);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  struct Cuda;  // the NCCL side (collectives.cpp), made at the group's first CUDA collective

  const std::string& name() const { return channel_ ? channel_->name() : place_.name; }
  int rank() const { return channel_ ? channel_->rank() : place_.rank; }
  int size() const { return channel_ ? channel_->size() : place_.size; }

  // In place: t = op over the group of t (contiguous; bfloat16: sum only).
  Work all_reduce(const torch::Tensor& t, comm::Op op, const std::string& what);
  // recv = the sum over the group of this rank's block of `send`: `send` holds every rank's block
  // one after the other, counts[q] elements for rank q (the same counts on every rank); recv
  // holds counts[rank()].
  Work reduce_scatter(const torch::Tensor& send, const torch::Tensor& recv, const std::vector<size_t>& counts,
                      const std::string& what);
  // In place: rank q's block of `data` (counts[q] elements, the blocks one after the other) from
  // rank q to every rank.
  Work all_gather(const torch::Tensor& data, const std::vector<size_t>& counts, const std::string& what);
  // An all-to-all of uneven blocks along dim 0 (MPI_Alltoallv's; expert parallel's tokens): rows
  // [sum of send_rows[<q]], send_rows[q] of them) of `send` to rank q; rank q's rows for this rank
  // into `recv` in rank order (recv_rows[q] of them). The counts are this rank's: what each rank
  // sends must be what its peer expects (exchange them first, e.g. by an all-to-all of counts).
  // send and recv of one dtype and device, contiguous, of the same row size.
  Work all_to_all(const torch::Tensor& send, const std::vector<int64_t>& send_rows, const torch::Tensor& recv,
                  const std::vector<int64_t>& recv_rows, const std::string& what);
  // `t` of rank `root` (its rank in the group) to every rank.
  Work broadcast(const torch::Tensor& t, int root, const std::string& what);
  // Point to point (pipeline stages): `t` to the group's rank `peer`, or `t` filled from it (the
  // same dtype and number of elements on both ends). Between two ranks the messages are paired
  // in the order each side issues them; on a GPU (NCCL) a send also waits until its receive runs,
  // so two ranks that send to each other issue one side's receive first. A rank never sends to
  // itself (refused, naming the ranks).
  Work send(const torch::Tensor& t, int peer, const std::string& what);
  Work recv(const torch::Tensor& t, int peer, const std::string& what);

 private:
  explicit Group(std::shared_ptr<comm::Channel> channel);
  struct Place {
    std::string name;
    int rank = 0, size = 1;
  };
  explicit Group(Place place);
  void require_channel(const std::string& what) const;  // a place: refused
  Cuda& cuda(const torch::Tensor& t, const std::string& what);
  Work point(const torch::Tensor& t, int peer, const std::string& what, bool sending);  // send, recv
  template <class Nccl, class Mpi>
  Work run(const torch::Tensor& t, const std::string& what, Nccl nccl, Mpi mpi);  // collectives.cpp
  std::shared_ptr<comm::Channel> channel_;  // null for a place
  Place place_;
  std::unique_ptr<Cuda> cuda_;
};

// Whose channel a split model's collectives use. A Group is one MPI channel whose messages pair
// up by the order each rank issues them, so only one node may issue on it: two nodes running the
// same model at once (forward_backward of step s+1 and an evaluator of step s) would interleave
// differently on each rank. So every node that runs a split model makes its own group over the
// ranks of the dimension it splits over in setup (its schema declares `collectives: { group: ...
// }`, which the executor checks) and opens it around its work; the model's layers use the one open
// on the calling thread for that dimension (as autocast's mode is the thread's), for the span of
// the node's run(). The model itself holds only its place among those ranks (Group::place: a
// collective on it is refused), so a split layer run outside a node's channel fails naming it;
// outside a graph (tests, tools) a model may hold a real group instead, which the layers then use.
// Backward uses the group its forward used. A null group opens nothing. (TpChannel, EpChannel.)
class ThreadChannel {
 public:
  ThreadChannel(Dim d, Group* g);
  ~ThreadChannel();
  ThreadChannel(const ThreadChannel&) = delete;
  ThreadChannel& operator=(const ThreadChannel&) = delete;

 private:
  Dim dim_;
  Group* previous_;
};
// The group a layer placed by `place` along `d` runs its collectives on: the ThreadChannel open for
// d on this thread (checked to be over the same ranks; `what` names the strategy in the error), else
// `place` itself.
Group& thread_channel(Dim d, const std::shared_ptr<Group>& place, const char* what);

}  // namespace flowrun::parallel
