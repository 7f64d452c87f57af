// NCCL communicators bootstrapped over MPI (nccl.hpp).
#include "parallel/nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <thread>

namespace flowrun::nccl {

namespace {

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw comm::CommError(what + ": CUDA error: " + cudaGetErrorString(e));
}

void check_nccl(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw comm::CommError(what + ": NCCL error: " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(comm::DType t) {
  switch (t) {
    case comm::DType::f32: return ncclFloat32;
    case comm::DType::f64: return ncclFloat64;
    case comm::DType::bf16: return ncclBfloat16;
    case comm::DType::i32: return ncclInt32;
    case comm::DType::i64: return ncclInt64;
    case comm::DType::u8: return ncclUint8;
  }
  return ncclFloat32;
}

}  // namespace

std::unique_ptr<Communicator> Communicator::create(comm::Channel& bootstrap, int device) {
  std::unique_ptr<Communicator> c(new Communicator());
  c->device_ = device;
  const std::string what = "'" + bootstrap.name() + "': NCCL set-up";
  check_cuda(cudaSetDevice(device), what);
  ncclUniqueId id{};
  if (bootstrap.rank() == 0) check_nccl(ncclGetUniqueId(&id), what);
  comm::broadcast(bootstrap, &id, sizeof id, 0, what + " (sending the NCCL id)");
  // Non-blocking init, so a rank that never joins ends in a timeout instead of a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, bootstrap.size(), id, bootstrap.rank(), &config);
  if (r != ncclSuccess && r != ncclInProgress) check_nccl(r, what);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(comm::timeout());
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) {
    check_nccl(ncclCommGetAsyncError(comm, &state), what);
    if (state == ncclInProgress && std::chrono::steady_clock::now() > until) {
      ncclCommAbort(comm);
      throw comm::CommError(what + ": the other ranks did not join within run.comm_timeout_s");
    }
    if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  check_nccl(state, what);
  c->comm_ = comm;
  cudaStream_t s = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), what);
  c->stream_ = s;
  c->rank_ = bootstrap.rank();
  c->size_ = bootstrap.size();
  return c;
}

Communicator::~Communicator() {
  if (comm_) ncclCommDestroy(static_cast<ncclComm_t>(comm_));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

template <class Enqueue>
void Communicator::on_stream(Event ready, Event done, const std::string& what, Enqueue enqueue) {
  auto s = static_cast<cudaStream_t>(stream_);
  check_cuda(cudaSetDevice(device_), what);
  if (ready) check_cuda(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(ready), 0), what);
  enqueue(static_cast<ncclComm_t>(comm_), s);
  if (done) check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(done), s), what);
}

namespace {
// A non-blocking communicator answers ncclInProgress while it queues; that is no error.
void check_queued(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess && r != ncclInProgress) check_nccl(r, what);
}

void check_counts(const std::vector<size_t>& counts, int ranks, const std::string& what) {
  if (static_cast<int>(counts.size()) != ranks)
    throw comm::CommError(what + ": " + std::to_string(counts.size()) + " block sizes for " + std::to_string(ranks) +
                          " ranks");
}

ncclRedOp_t nccl_op(comm::Op op) {
  switch (op) {
    case comm::Op::sum: return ncclSum;
    case comm::Op::max: return ncclMax;
    case comm::Op::min: return ncclMin;
  }
  return ncclSum;
}

// Each owner q's block of `data` (counts[q] elements of `bytes` bytes, one after the other) as
// fn(q, its first byte, its count), inside one NCCL group; empty blocks skipped.
template <class Fn>
void grouped_blocks(const void* data, const std::vector<size_t>& counts, size_t bytes, const std::string& what, Fn fn) {
  check_queued(ncclGroupStart(), what);
  size_t at = 0;
  for (size_t q = 0; q < counts.size(); ++q) {
    if (counts[q] > 0) fn(static_cast<int>(q), static_cast<const char*>(data) + at * bytes, counts[q]);
    at += counts[q];
  }
  check_queued(ncclGroupEnd(), what);
}
}  // namespace

void Communicator::allreduce(void* data, size_t count, comm::DType type, Event ready, Event done,
                             const std::string& what, comm::Op op) {
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    check_queued(ncclAllReduce(data, data, count, nccl_type(type), nccl_op(op), c, s), what);
  });
}

void Communicator::broadcast(void* data, size_t count, comm::DType type, int root, Event ready, Event done,
                             const std::string& what) {
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    check_queued(ncclBroadcast(data, data, count, nccl_type(type), root, c, s), what);
  });
}

void Communicator::reduce_scatter(const void* send, void* recv, const std::vector<size_t>& counts, comm::DType type,
                                  Event ready, Event done, const std::string& what) {
  check_counts(counts, size_, what);
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    grouped_blocks(send, counts, comm::dtype_size(type), what, [&](int q, const char* block, size_t n) {
      // Only the root's recvbuff is written; the others pass their own block, untouched.
      void* into = q == rank_ ? recv : const_cast<char*>(block);
      check_queued(ncclReduce(block, into, n, nccl_type(type), ncclSum, q, c, s), what);
    });
  });
}

void Communicator::allgather_blocks(void* data, const std::vector<size_t>& counts, comm::DType type, Event ready,
                                    Event done, const std::string& what) {
  check_counts(counts, size_, what);
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    grouped_blocks(data, counts, comm::dtype_size(type), what, [&](int q, const char* block, size_t n) {
      void* at = const_cast<char*>(block);  // in place: the owner's block is the broadcast's source and target
      check_queued(ncclBroadcast(at, at, n, nccl_type(type), q, c, s), what);
    });
  });
}

void Communicator::all_to_all(const void* send, const std::vector<size_t>& send_counts, void* recv,
                              const std::vector<size_t>& recv_counts, comm::DType type, Event ready, Event done,
                              const std::string& what) {
  check_counts(send_counts, size_, what);
  check_counts(recv_counts, size_, what);
  const size_t bytes = comm::dtype_size(type);
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    check_queued(ncclGroupStart(), what);
    size_t sent = 0, received = 0;
    for (size_t q = 0; q < send_counts.size(); ++q) {
      if (send_counts[q] > 0)
        check_queued(ncclSend(static_cast<const char*>(send) + sent * bytes, send_counts[q], nccl_type(type),
                              static_cast<int>(q), c, s), what);
      if (recv_counts[q] > 0)
        check_queued(ncclRecv(static_cast<char*>(recv) + received * bytes, recv_counts[q], nccl_type(type),
                              static_cast<int>(q), c, s), what);
      sent += send_counts[q];
      received += recv_counts[q];
    }
    check_queued(ncclGroupEnd(), what);
  });
}

void Communicator::send(const void* data, size_t count, comm::DType type, int peer, Event ready, Event done,
                        const std::string& what) {
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    check_queued(ncclSend(data, count, nccl_type(type), peer, c, s), what);
  });
}

void Communicator::recv(void* data, size_t count, comm::DType type, int peer, Event ready, Event done,
                        const std::string& what) {
  on_stream(ready, done, what, [&](ncclComm_t c, cudaStream_t s) {
    check_queued(ncclRecv(data, count, nccl_type(type), peer, c, s), what);
  });
}

void Communicator::wait(Event done, const std::string& what) {
  auto e = static_cast<cudaEvent_t>(done);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(comm::timeout());
  for (;;) {
    const cudaError_t q = cudaEventQuery(e);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, what);
    ncclResult_t state = ncclSuccess;
    check_nccl(ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &state), what);
    if (state != ncclSuccess && state != ncclInProgress) check_nccl(state, what);
    if (std::chrono::steady_clock::now() > until) {
      ncclCommAbort(static_cast<ncclComm_t>(comm_));
      comm_ = nullptr;
      throw comm::CommError(what + ": no answer from the other ranks in " + std::to_string(comm::timeout()) +
                            " s (run.comm_timeout_s): a rank has died or is stuck");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

Events::Events(size_t n, int device) {
  check_cuda(cudaSetDevice(device), "CUDA events");
  events_.resize(n, nullptr);
  for (auto& e : events_) {
    cudaEvent_t ev = nullptr;
    check_cuda(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "CUDA events");
    e = ev;
  }
}

Events::~Events() {
  for (Event e : events_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}

void Events::record(size_t i, Stream on) {
  check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(at(i)), static_cast<cudaStream_t>(on)), "CUDA event record");
}

bool Events::query(size_t i) const {
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(at(i)));
  if (e == cudaErrorNotReady) return false;
  check_cuda(e, "CUDA event query");
  return true;
}

void Events::make_wait(Stream who, size_t i) {
  check_cuda(cudaStreamWaitEvent(static_cast<cudaStream_t>(who), static_cast<cudaEvent_t>(at(i)), 0),
             "CUDA stream wait");
}

}  // namespace flowrun::nccl
