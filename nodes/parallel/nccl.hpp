// NCCL collectives for CUDA tensors (built only with FLOWRUN_CUDA), the GPU backend of
// parallel/collectives.hpp, which nodes call (CPU tensors go through MPI, engine/comm.hpp). Torch-free and CUDA-header-free interface: streams and events are passed
// as the runtime's opaque handles (cudaStream_t / cudaEvent_t are pointers).
//
// Bootstrap: NCCL needs every rank to hold the same ncclUniqueId; rank 0 makes it and the
// node's MPI channel broadcasts it (the only MPI traffic; tensors never go through MPI).
// Each communicator owns a CUDA stream, so reductions overlap the compute stream: the producer
// records an event after backward wrote a bucket, the communicator's stream waits on it (not
// the host), reduces, and records `done`; the consumer's stream waits on `done`.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm.hpp"

namespace flowrun::nccl {

using Stream = void*;  // cudaStream_t
using Event = void*;   // cudaEvent_t

class Communicator {
 public:
  // Collective over the channel's ranks (a communicator of the same group: the world, or a
  // dimension of the mesh). `device`: the CUDA device this rank's tensors live on.
  static std::unique_ptr<Communicator> create(comm::Channel& bootstrap, int device);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  Stream stream() const { return stream_; }
  // Enqueue on stream(): wait for `ready` (if any), reduce `count` elements of `data` in place
  // over the ranks (`op`), record `done`. Returns at once; the host never waits here.
  void allreduce(void* data, size_t count, comm::DType type, Event ready, Event done, const std::string& what,
                 comm::Op op = comm::Op::sum);
  // The same for `count` elements of `data` from the group's rank `root` to every rank.
  void broadcast(void* data, size_t count, comm::DType type, int root, Event ready, Event done, const std::string& what);
  // The same for uneven blocks (the same counts on every rank), as comm::Channel's:
  // recv = the sum over the ranks of this rank's block of `send` (counts[q] elements of rank q's
  // block, the blocks one after the other; recv holds counts[rank]).
  void reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, comm::DType type, Event ready,
                      Event done, const std::string& what);
  // In place: rank q's block of `data` (counts[q] elements, the blocks one after the other) from
  // rank q to every rank.
  void allgather_blocks(void* data, const std::vector<size_t>& counts, comm::DType type, Event ready, Event done,
                        const std::string& what);
  // The same for an all-to-all of uneven blocks, as comm::Channel's: block q of `send`
  // (send_counts[q] elements) to rank q, rank q's block for this rank into place q of `recv`
  // (recv_counts[q]); one NCCL group of sends and receives.
  void all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                  const std::vector<size_t>& recv_counts, comm::DType type, Event ready, Event done,
                  const std::string& what);
  // The same for point to point: `count` elements of `data` to the group's rank `peer`, or from
  // it into `data`. NCCL pairs a send with the peer's receive in issue order, and a send waits
  // on the device until its receive runs: two ranks that both send to each other first wait on
  // each other (issue one side's receive first).
  void send(const void* data, size_t count, comm::DType type, int peer, Event ready, Event done, const std::string& what);
  void recv(void* data, size_t count, comm::DType type, int peer, Event ready, Event done, const std::string& what);
  // Host wait for `done`, polling NCCL's asynchronous error state; after comm::timeout() the
  // communicator is aborted and CommError names `what` (a rank died or hangs).
  void wait(Event done, const std::string& what);

 private:
  Communicator() = default;
  // On stream(), behind `ready`: `enqueue` (NCCL calls), then `done` recorded.
  template <class Enqueue>
  void on_stream(Event ready, Event done, const std::string& what, Enqueue enqueue);
  void* comm_ = nullptr;  // ncclComm_t
  Stream stream_ = nullptr;
  int device_ = 0;
  int rank_ = 0, size_ = 1;  // in the bootstrap channel's group
};

// Reusable CUDA events (timing off), one per bucket: recorded on one stream, waited on by
// another, so streams order each other without the host waiting.
class Events {
 public:
  Events(size_t n, int device);
  ~Events();
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  size_t size() const { return events_.size(); }
  Event at(size_t i) const { return events_.at(i); }
  void record(size_t i, Stream on);          // cudaEventRecord(at(i), on)
  bool query(size_t i) const;                // cudaEventQuery(at(i)): what it follows has finished
  void make_wait(Stream who, size_t i);      // cudaStreamWaitEvent(who, at(i))

 private:
  std::vector<Event> events_;
};

}  // namespace flowrun::nccl
