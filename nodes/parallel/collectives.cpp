// The one collective interface (collectives.hpp): MPI for CPU tensors, NCCL for CUDA ones. The
// only #if FLOWRUN_CUDA of the collectives' users is here.
#include "parallel/collectives.hpp"

#include <deque>
#include <stdexcept>

#if FLOWRUN_CUDA
#include <c10/cuda/CUDAStream.h>

#include "parallel/nccl.hpp"
#endif

namespace flowrun::parallel {

comm::DType comm_dtype(torch::Dtype t, const std::string& who) {
  switch (t) {
    case torch::kFloat: return comm::DType::f32;
    case torch::kDouble: return comm::DType::f64;
    case torch::kBFloat16: return comm::DType::bf16;
    case torch::kByte: return comm::DType::u8;
    default:
      throw std::runtime_error(who + ": cannot send " + std::string(c10::toString(t)) +
                               " tensors between ranks (float, double, bfloat16 and uint8 are supported)");
  }
}

namespace {

// An MPI collective: the communication thread's request.
struct MpiWork : Work::Impl {
  explicit MpiWork(comm::Request r) : req(std::move(r)) {}
  void wait() override { req.wait(); }
  void check() override { req.wait(); }
  bool done() const override { return req.done(); }
  bool timed() const override { return true; }
  comm::Clock::time_point started() const override { return req.started(); }
  comm::Clock::time_point finished() const override { return req.finished(); }
  comm::Request req;
};

void check_tensor(const torch::Tensor& t, const std::string& what) {
  if (!t.defined() || !t.is_contiguous())
    throw std::logic_error(what + ": collectives take defined, contiguous tensors");
}

}  // namespace

// ---- the NCCL side --------------------------------------------------------------------------

#if FLOWRUN_CUDA
struct Group::Cuda {
  int device = 0;
  std::unique_ptr<nccl::Communicator> nccl;
  // Event pairs (0: the caller's stream reached the collective, 1: NCCL finished it), reused once
  // no Work holds them.
  std::deque<std::shared_ptr<nccl::Events>> events;

  std::shared_ptr<nccl::Events> take() {
    for (auto& e : events)
      if (e.use_count() == 1) return e;
    events.push_back(std::make_shared<nccl::Events>(2, device));
    return events.back();
  }
  nccl::Stream current() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  }
};

namespace {
struct NcclWork : Work::Impl {
  NcclWork(std::shared_ptr<nccl::Events> e, nccl::Communicator* c, int dev, std::string w)
      : events(std::move(e)), nccl(c), device(dev), what(std::move(w)) {}
  void wait() override {
    events->make_wait(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), 1);
  }
  void check() override { nccl->wait(events->at(1), what); }
  bool done() const override { return events->query(1); }
  std::shared_ptr<nccl::Events> events;
  nccl::Communicator* nccl;
  int device;
  std::string what;
};

// `enqueue(ready, done)` on the communicator's stream, behind what the caller's stream has queued.
template <class Enqueue>
Work on_nccl(Group::Cuda& c, const std::string& what, Enqueue enqueue) {
  std::shared_ptr<nccl::Events> ev = c.take();
  ev->record(0, c.current());
  enqueue(ev->at(0), ev->at(1));
  return Work(std::make_shared<NcclWork>(ev, c.nccl.get(), c.device, what));
}
}  // namespace
#else
struct Group::Cuda {};
#endif

Group::Cuda& Group::cuda(const torch::Tensor& t, const std::string& what) {
#if FLOWRUN_CUDA
  const int device = t.device().index() < 0 ? 0 : t.device().index();
  if (!cuda_) {
    cuda_ = std::make_unique<Cuda>();
    cuda_->device = device;
    cuda_->nccl = nccl::Communicator::create(*channel_, device);
  }
  if (cuda_->device != device)
    throw std::runtime_error(what + ": a tensor on cuda:" + std::to_string(device) + ", the group's NCCL communicator is on cuda:" +
                             std::to_string(cuda_->device) + "; keep a rank's tensors on one GPU");
  return *cuda_;
#else
  throw std::runtime_error(what + ": a tensor on " + t.device().str() + ": this flowrun was built without CUDA " +
                           "(FLOWRUN_CUDA), so only CPU tensors go between ranks; rebuild against a CUDA libtorch");
#endif
}

// ---- the group ------------------------------------------------------------------------------

Group::Group(std::shared_ptr<comm::Channel> channel) : channel_(std::move(channel)) {}
Group::Group(Place place) : place_(std::move(place)) {}
Group::~Group() = default;

std::shared_ptr<Group> Group::world(const std::string& name) {
  return std::shared_ptr<Group>(new Group(comm::Channel::create(name)));
}

std::shared_ptr<Group> Group::along(const std::string& name, const Mesh& mesh, Dim dim, int rank) {
  if (mesh.size(dim) == mesh.world())  // the dimension spans every rank (dp when tp = pp = 1)
    return std::shared_ptr<Group>(new Group(comm::Channel::create(name, parallel::name(dim))));
  return std::shared_ptr<Group>(
      new Group(comm::Channel::create_split(name + " (" + parallel::name(dim) + ")", mesh.color(dim, rank),
                                            mesh.at(mesh.coord(rank), dim), parallel::name(dim))));
}

std::shared_ptr<Group> Group::place(const std::string& name, const Mesh& mesh, Dim dim, int rank) {
  return std::shared_ptr<Group>(
      new Group(Place{name + " (" + parallel::name(dim) + ")", mesh.at(mesh.coord(rank), dim), mesh.size(dim)}));
}

void Group::require_channel(const std::string& what) const {
  if (!channel_)
    throw std::logic_error(what + ": '" + place_.name + "' is a place among the ranks, not a channel; a collective " +
                           "runs on the channel of the node that issues it (a node running a split model opens " +
                           "parallel::ThreadChannel (TpChannel, EpChannel) over its own group)");
}

// One collective: `nccl(communicator, ready, done, what)` for CUDA tensors (on the group's
// stream, behind the caller's), else `mpi(what)`, MPI's request.
template <class Nccl, class Mpi>
Work Group::run(const torch::Tensor& t, const std::string& what, Nccl nccl, Mpi mpi) {
  require_channel(what);
  if (t.is_cuda()) {
#if FLOWRUN_CUDA
    Cuda& c = cuda(t, what);
    const std::string w = "'" + name() + "': " + what;
    return on_nccl(c, w, [&](nccl::Event ready, nccl::Event done) { nccl(*c.nccl, ready, done, w); });
#else
    (void)nccl;
    cuda(t, what);
#endif
  }
  return Work(std::make_shared<MpiWork>(mpi(what)));
}

Work Group::all_reduce(const torch::Tensor& t, comm::Op op, const std::string& what) {
  check_tensor(t, what);
  const comm::DType type = comm_dtype(t.scalar_type(), what);
  const auto n = static_cast<size_t>(t.numel());
  return run(
      t, what, [&](auto& c, auto ready, auto done, const std::string& w) { c.allreduce(t.data_ptr(), n, type, ready, done, w, op); },
      [&](const std::string& w) { return channel_->allreduce(t.data_ptr(), n, type, op, w); });
}

Work Group::reduce_scatter(const torch::Tensor& send, const torch::Tensor& recv, const std::vector<size_t>& counts,
                           const std::string& what) {
  check_tensor(send, what);
  check_tensor(recv, what);
  if (send.scalar_type() != recv.scalar_type() || send.device() != recv.device())
    throw std::logic_error(what + ": reduce-scatter between tensors of two dtypes or devices");
  const comm::DType type = comm_dtype(send.scalar_type(), what);
  return run(
      send, what,
      [&](auto& c, auto ready, auto done, const std::string& w) {
        c.reduce_scatter(send.data_ptr(), recv.data_ptr(), counts, type, ready, done, w);
      },
      [&](const std::string& w) {
        return channel_->reduce_scatter(send.data_ptr(), recv.data_ptr(), counts, type, comm::Op::sum, w);
      });
}

Work Group::all_gather(const torch::Tensor& data, const std::vector<size_t>& counts, const std::string& what) {
  check_tensor(data, what);
  const comm::DType type = comm_dtype(data.scalar_type(), what);
  return run(
      data, what,
      [&](auto& c, auto ready, auto done, const std::string& w) { c.allgather_blocks(data.data_ptr(), counts, type, ready, done, w); },
      [&](const std::string& w) { return channel_->allgather_blocks(data.data_ptr(), counts, comm::dtype_size(type), w); });
}

Work Group::all_to_all(const torch::Tensor& send, const std::vector<int64_t>& send_rows, const torch::Tensor& recv,
                       const std::vector<int64_t>& recv_rows, const std::string& what) {
  check_tensor(send, what);
  check_tensor(recv, what);
  if (send.scalar_type() != recv.scalar_type() || send.device() != recv.device() || send.dim() < 1 ||
      send.dim() != recv.dim() || send.sizes().slice(1) != recv.sizes().slice(1))
    throw std::logic_error(what + ": all-to-all from " + c10::str(send.sizes()) + " into " + c10::str(recv.sizes()) +
                           " (one dtype, device and row shape)");
  int64_t row = 1;
  for (int64_t d = 1; d < send.dim(); ++d) row *= send.size(d);
  auto elements = [&](const std::vector<int64_t>& rows, const torch::Tensor& t, const char* side) {
    std::vector<size_t> out;
    int64_t total = 0;
    for (int64_t r : rows) {
      out.push_back(static_cast<size_t>(r * row));
      total += r;
    }
    if (total != t.size(0))
      throw std::logic_error(what + ": the " + side + " counts add up to " + std::to_string(total) + " rows, the tensor has " +
                             std::to_string(t.size(0)));
    return out;
  };
  const std::vector<size_t> sc = elements(send_rows, send, "sent"), rc = elements(recv_rows, recv, "received");
  const comm::DType type = comm_dtype(send.scalar_type(), what);
  return run(
      send, what,
      [&](auto& c, auto ready, auto done, const std::string& w) {
        c.all_to_all(send.data_ptr(), sc, recv.data_ptr(), rc, type, ready, done, w);
      },
      [&](const std::string& w) {
        return channel_->all_to_all(send.data_ptr(), sc, recv.data_ptr(), rc, comm::dtype_size(type), w);
      });
}

Work Group::broadcast(const torch::Tensor& t, int root, const std::string& what) {
  check_tensor(t, what);
  const comm::DType type = comm_dtype(t.scalar_type(), what);
  const auto n = static_cast<size_t>(t.numel());
  return run(
      t, what, [&](auto& c, auto ready, auto done, const std::string& w) { c.broadcast(t.data_ptr(), n, type, root, ready, done, w); },
      [&](const std::string& w) { return channel_->broadcast(t.data_ptr(), n * comm::dtype_size(type), root, w); });
}

Work Group::send(const torch::Tensor& t, int peer, const std::string& what) { return point(t, peer, what, true); }
Work Group::recv(const torch::Tensor& t, int peer, const std::string& what) { return point(t, peer, what, false); }

Work Group::point(const torch::Tensor& t, int peer, const std::string& what, bool sending) {
  check_tensor(t, what);
  require_channel(what);
  channel_->check_peer(peer, what);
  const comm::DType type = comm_dtype(t.scalar_type(), what);
  const auto n = static_cast<size_t>(t.numel());
  return run(
      t, what,
      [&](auto& c, auto ready, auto done, const std::string& w) {
        if (sending) c.send(t.data_ptr(), n, type, peer, ready, done, w);
        else c.recv(t.data_ptr(), n, type, peer, ready, done, w);
      },
      [&](const std::string& w) {
        const size_t bytes = n * comm::dtype_size(type);
        return sending ? channel_->send(t.data_ptr(), bytes, peer, w) : channel_->recv(t.data_ptr(), bytes, peer, w);
      });
}

namespace {
thread_local Group* t_open[5] = {};  // the ThreadChannel open on this thread, by Dim
Group*& open_for(Dim d) { return t_open[static_cast<int>(d)]; }
}  // namespace

ThreadChannel::ThreadChannel(Dim d, Group* g) : dim_(d), previous_(open_for(d)) {
  if (g) open_for(d) = g;
}
ThreadChannel::~ThreadChannel() { open_for(dim_) = previous_; }

Group& thread_channel(Dim d, const std::shared_ptr<Group>& place, const char* what) {
  Group* open = open_for(d);
  if (!open) return *place;
  if (open->size() != place->size() || open->rank() != place->rank())
    throw std::logic_error(std::string(what) + ": the open channel (" + open->name() + ", rank " + std::to_string(open->rank()) +
                           " of " + std::to_string(open->size()) + ") is not over the model's " + name(d) + " ranks (" +
                           place->name() + ")");
  return *open;
}

}  // namespace flowrun::parallel
