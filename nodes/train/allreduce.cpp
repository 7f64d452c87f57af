// allreduce: averages the gradients over the ranks in buckets, while backward still runs (DDP).
// Schema: schemas/allreduce.yaml. Test: tests/nodes/allreduce_test.cpp. Docs: docs/distributed.md.
//
// forward_backward emits each trainable parameter on its `ready` stream as soon as its gradient
// is final (train/grad_buffer.hpp). Here on_item() marks it ready and launches every bucket whose
// parameters are all ready, strictly in bucket order: all-reduces on a channel are matched by
// their order, so every rank must submit the same buckets in the same order whatever order its
// backward finished the parameters in (DDP's Reducer does the same with next_bucket_). run(),
// called after the last item, launches what is left, waits for all, and outputs the views.
//
// CUDA gradients (FLOWRUN_CUDA builds) go through NCCL on the communicator's own stream
// (comm/nccl.hpp): a bucket's all-reduce waits on an event the compute stream recorded after
// backward wrote it, and the compute stream waits on the all-reduce's `done` event before the
// optimizer reads the gradients, so the host never blocks on a reduction. Failures still end
// within run.comm_timeout_s: each step first checks (on the host, with the timeout) that the
// previous step's reductions finished, one step behind, when they are long done normally.
#include "train/allreduce.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "comm.hpp"
#include "common/grads.hpp"
#include "registry.hpp"

#if FLOWRUN_CUDA
#include <c10/cuda/CUDAStream.h>

#include "comm/nccl.hpp"
#endif

namespace flowrun {

bool BucketPlan::fits(const GradBuffer& b) const {
  if (b.order != order || b.slots.size() != slots.size() || b.flats.size() != flat_numel.size()) return false;
  for (size_t i = 0; i < slots.size(); ++i)
    if (b.slots[i].group != slots[i].group || b.slots[i].offset != slots[i].offset || b.slots[i].numel != slots[i].numel)
      return false;
  for (size_t g = 0; g < b.flats.size(); ++g)
    if (b.flats[g].numel() != flat_numel[g] || b.flats[g].scalar_type() != flat_dtype[g] ||
        b.flats[g].device() != flat_device[g])
      return false;
  return true;
}

BucketPlan plan_buckets(const GradBuffer& buffer, double first_bucket_mb, double bucket_mb) {
  BucketPlan plan;
  plan.order = buffer.order;
  plan.slots = buffer.slots;
  for (const auto& f : buffer.flats) {
    plan.flat_numel.push_back(f.numel());
    plan.flat_dtype.push_back(f.scalar_type());
    plan.flat_device.push_back(f.device());
  }
  plan.bucket_of.assign(buffer.slots.size(), -1);

  const double mib = 1024.0 * 1024.0;
  const auto first_cap = static_cast<int64_t>(first_bucket_mb * mib);
  const auto cap = static_cast<int64_t>(bucket_mb * mib);
  int last_group = -1;
  bool open = false;
  for (int k = 0; k < static_cast<int>(buffer.order.size()); ++k) {
    const int param = buffer.order[static_cast<size_t>(k)];
    const GradBuffer::Slot& s = buffer.slots[static_cast<size_t>(param)];
    const int64_t bytes = s.numel * static_cast<int64_t>(buffer.flats[static_cast<size_t>(s.group)].element_size());
    const bool new_group = s.group != last_group;
    if (open && !new_group) {
      Bucket& b = plan.buckets.back();
      // The group's first bucket has the small cap, the rest the large one (per group, as DDP).
      const bool groups_first = plan.buckets.size() == 1 || plan.buckets[plan.buckets.size() - 2].group != b.group;
      if (b.bytes + bytes > (groups_first ? first_cap : cap)) open = false;
    }
    if (!open || new_group) {
      Bucket b;
      b.group = s.group;
      b.offset = s.offset;
      b.first = k;
      b.end = k;
      plan.buckets.push_back(b);
      open = true;
      last_group = s.group;
    }
    Bucket& b = plan.buckets.back();
    // Positions of a group are consecutive in the flat buffer (GradBuffer::make), so a bucket
    // stays one slice.
    if (b.offset + b.numel != s.offset)
      throw std::logic_error("plan_buckets: parameter " + std::to_string(param) + " is not next to the bucket's slice");
    b.numel += s.numel;
    b.bytes += bytes;
    b.end = k + 1;
    plan.bucket_of[static_cast<size_t>(param)] = static_cast<int>(plan.buckets.size()) - 1;
  }
  return plan;
}

namespace {

comm::DType comm_dtype(torch::Dtype t, const std::string& who) {
  switch (t) {
    case torch::kFloat: return comm::DType::f32;
    case torch::kDouble: return comm::DType::f64;
    case torch::kBFloat16: return comm::DType::bf16;
    default:
      throw std::runtime_error(who + ": cannot all-reduce " + std::string(c10::toString(t)) +
                               " gradients (float, double and bfloat16 are supported)");
  }
}

std::string mib(int64_t bytes) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f MB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return s;
}

class AllreduceNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    bucket_mb_ = p.get<double>("bucket_mb");
    first_bucket_mb_ = p.get<double>("first_bucket_mb");
    compress_bf16_ = p.get<std::string>("compress") == "bf16";
    overlap_ = p.get<bool>("overlap");
    // Collective: setup() runs in file order on every rank, so channels are made in one order.
    channel_ = comm::Channel::create(ctx.name());
    world_ = comm::size();
  }

  void on_item(StepContext& ctx, const std::string& /*port*/, const Value& v, int /*index*/, int count) override {
    const GradReady& r = v.as<GradReady>(ctx.who() + " input 'ready'");
    if (!r.buffer && world_ > 1)
      throw std::runtime_error(ctx.who() + ": an item on 'ready' carries no gradient buffer, which the all-reduce "
                               "of " + std::to_string(world_) + " processes needs");
    if (r.used && !r.grad.defined())
      throw std::runtime_error(ctx.who() + ": the item on 'ready' for parameter " + std::to_string(r.param) +
                               " says it has a gradient but carries none");
    if (!started_) begin_step(ctx, r.buffer, count);
    if (r.buffer != buffer_)
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) +
                               ": the items on 'ready' name two different gradient buffers");
    const int n = static_cast<int>(grads_.size());
    if (r.param < 0 || r.param >= n)
      throw std::runtime_error(ctx.who() + ": item for parameter " + std::to_string(r.param) + ", the model has " +
                               std::to_string(n) + " trainable parameters");
    const size_t i = static_cast<size_t>(r.param);
    if (ready_[i])
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) + ": parameter " +
                               std::to_string(r.param) + " arrived twice on 'ready'");
    ready_[i] = 1;
    used_[i] = r.used ? 1 : 0;
    if (r.used) grads_[i] = r.grad;
    ++items_;
    if (world_ == 1) return;  // nothing to reduce: the grads pass through
    --missing_[static_cast<size_t>(plan_.bucket_of[i])];
    if (overlap_) launch_ready(ctx);
  }

  void run(StepContext& ctx) override {
    const int n = started_ ? static_cast<int>(grads_.size()) : -1;
    if (!started_ || items_ != n)
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) + ": got " + std::to_string(items_) +
                               " items on 'ready' for " + (n < 0 ? std::string("a model") : std::to_string(n) + " trainable parameters") +
                               "; connect it to forward_backward's `ready`, which sends each parameter once a step");
    launch_ready(ctx);  // all of them when overlap is off; else what waited on earlier buckets
    for (size_t k = 0; k < requests_.size(); ++k) {
      comm::Request& req = requests_[k];
#if FLOWRUN_CUDA
      if (cuda_) {
        done_ev_->make_wait(compute_stream(), k);  // the optimizer's kernels queue behind the reduction
        if (compressed_[k].defined()) slice(k).copy_(compressed_[k]);
        previous_ = k + 1;
        continue;
      }
#endif
      req.wait();
      if (compressed_[k].defined()) {
        torch::NoGradGuard no_grad;
        slice(k).copy_(compressed_[k]);
      }
      if (world_ > 1)
        ctx.trace_mark("bucket " + std::to_string(k) + " (" + mib(plan_.buckets[k].bytes) + ")", req.started(),
                       req.finished());
    }
    if (world_ > 1) {
      // Used on any rank: averaged gradient (zeros from the ranks that did not use it). Used on
      // none: undefined, so the optimizer skips it, as DDP with find_unused_parameters leaves it.
      comm::Request req = channel_->allreduce(used_.data(), used_.size(), comm::DType::u8, comm::Op::max,
                                              "used-parameter flags (step " + std::to_string(ctx.step()) + ")");
      req.wait();
    }
    // After the reduction in place, a used parameter's grad (its view of the buffer) holds the average.
    Grads grads(static_cast<size_t>(n));
    for (size_t i = 0; i < grads.size(); ++i)
      if (used_[i]) grads[i] = grads_[i];
    end_step();
    ctx.out("grads", std::move(grads));
  }

 private:
  // The first item of a step: the buffer it names (null in a single process with fresh grads)
  // and, with several processes, its bucket plan.
  void begin_step(StepContext& ctx, const std::shared_ptr<GradBuffer>& buffer, int count) {
    const int n = count;
    if (buffer && static_cast<int>(buffer->views.size()) != n)
      throw std::runtime_error(ctx.who() + ": the 'ready' stream announces " + std::to_string(count) +
                               " items, its gradient buffer holds " + std::to_string(buffer->views.size()) +
                               " parameters");
#if FLOWRUN_CUDA
    if (cuda_) finish_previous_step(ctx);
#endif
    if (world_ > 1 && (plan_.bucket_of.empty() || !plan_.fits(*buffer))) {
      plan_ = plan_buckets(*buffer, first_bucket_mb_, bucket_mb_);
      if (ctx.run().rank == 0)
        spdlog::debug("{}: {} parameters in {} buckets", ctx.who(), n, plan_.buckets.size());
      choose_transport(ctx, *buffer);
    }
    started_ = true;
    buffer_ = buffer;
    grads_.assign(static_cast<size_t>(n), torch::Tensor());
    ready_.assign(static_cast<size_t>(n), 0);
    used_.assign(static_cast<size_t>(n), 0);
    missing_.clear();
    if (world_ > 1)
      for (const auto& b : plan_.buckets) missing_.push_back(b.end - b.first);
    items_ = 0;
    next_ = 0;
    step_ = ctx.step();
  }

  // MPI for CPU gradients, NCCL for CUDA ones; never a mix.
  void choose_transport(StepContext& ctx, const GradBuffer& buffer) {
    const torch::Device device = buffer.flats.front().device();
    for (const auto& f : buffer.flats) {
      comm_dtype(f.scalar_type(), ctx.who());
      if (f.device() != device)
        throw std::runtime_error(ctx.who() + ": gradients on both " + device.str() + " and " + f.device().str() +
                                 "; keep the model on one device");
    }
    if (device.is_cpu()) return;
#if FLOWRUN_CUDA
    if (!device.is_cuda())
      throw std::runtime_error(ctx.who() + ": cannot all-reduce gradients on " + device.str());
    cuda_ = true;
    device_ = device.index() < 0 ? 0 : device.index();
    if (!nccl_) nccl_ = nccl::Communicator::create(*channel_, device_);
    ready_ev_ = std::make_unique<nccl::Events>(plan_.buckets.size(), device_);
    done_ev_ = std::make_unique<nccl::Events>(plan_.buckets.size(), device_);
    previous_ = 0;
#else
    throw std::runtime_error(ctx.who() + ": gradients on " + device.str() +
                             ": this flowrun was built without CUDA (FLOWRUN_CUDA), so only CPU gradients can be "
                             "all-reduced; rebuild against a CUDA libtorch");
#endif
  }

#if FLOWRUN_CUDA
  void* compute_stream() const { return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream(); }

  // Host check, bounded by run.comm_timeout_s, that last step's reductions ended (see top).
  void finish_previous_step(StepContext& ctx) {
    for (size_t k = 0; k < previous_; ++k)
      nccl_->wait(done_ev_->at(k), ctx.who() + ": all-reduce of bucket " + std::to_string(k) + " (step " +
                                       std::to_string(ctx.step() - 1) + ")");
    previous_ = 0;
  }
#endif

  void end_step() {
    started_ = false;
    buffer_.reset();
    grads_.clear();
    requests_.clear();
    compressed_.clear();
    ready_.clear();
    used_.clear();
    missing_.clear();
    items_ = 0;
    next_ = 0;
  }

  torch::Tensor slice(size_t k) const {
    const Bucket& b = plan_.buckets[k];
    return buffer_->flats[static_cast<size_t>(b.group)].narrow(0, b.offset, b.numel);
  }

  // Launch buckets in order while the next one has all its parameters (none in a single
  // process: nothing to average, no copy, no division, no message).
  void launch_ready(StepContext& ctx) {
    if (world_ == 1) return;
    while (next_ < plan_.buckets.size() && missing_[next_] == 0) launch(ctx, next_++);
  }

  void launch(StepContext& ctx, size_t k) {
    requests_.emplace_back();
    compressed_.emplace_back();
    torch::NoGradGuard no_grad;
    torch::Tensor s = slice(k);
    // Average = sum of grad / world: divide before the sum (exact for a power-of-two world), as
    // DDP's default communication hook does.
    s.div_(world_);
    const std::string what = "all-reduce of bucket " + std::to_string(k) + " (step " + std::to_string(step_) + ")";
#if FLOWRUN_CUDA
    if (cuda_) {
      torch::Tensor data = s;
      if (compress_bf16_ && s.scalar_type() != torch::kBFloat16) data = compressed_.back() = s.to(torch::kBFloat16);
      ready_ev_->record(k, compute_stream());
      nccl_->allreduce(data.data_ptr(), static_cast<size_t>(data.numel()), comm_dtype(data.scalar_type(), ctx.who()),
                       ready_ev_->at(k), done_ev_->at(k), ctx.who() + ": " + what);
      return;
    }
#endif
    if (compress_bf16_ && s.scalar_type() != torch::kBFloat16) {
      compressed_.back() = s.to(torch::kBFloat16);
      requests_.back() = channel_->allreduce(compressed_.back().data_ptr(), static_cast<size_t>(s.numel()),
                                             comm::DType::bf16, comm::Op::sum, what);
    } else {
      requests_.back() = channel_->allreduce(s.data_ptr(), static_cast<size_t>(s.numel()),
                                             comm_dtype(s.scalar_type(), ctx.who()), comm::Op::sum, what);
    }
  }

  double bucket_mb_ = 0, first_bucket_mb_ = 0;  // setup: the schema's (defaults there)
  bool compress_bf16_ = false, overlap_ = false;
  std::shared_ptr<comm::Channel> channel_;
  int world_ = 1;
  BucketPlan plan_;
#if FLOWRUN_CUDA
  bool cuda_ = false;
  int device_ = 0;
  std::unique_ptr<nccl::Communicator> nccl_;
  std::unique_ptr<nccl::Events> ready_ev_, done_ev_;  // per bucket
  size_t previous_ = 0;  // buckets of the previous step to check in finish_previous_step()
#endif

  // This step's state (reset by end_step()).
  bool started_ = false;  // its first item arrived
  std::shared_ptr<GradBuffer> buffer_;
  Grads grads_;  // per parameter: the grad its item carried
  std::vector<uint8_t> ready_, used_;  // per parameter; used_ is all-reduced in place (u8 max)
  std::vector<int> missing_;           // per bucket: parameters not ready yet
  std::vector<comm::Request> requests_;      // per launched bucket
  std::vector<torch::Tensor> compressed_;    // per launched bucket: its bf16 copy (compress: bf16)
  int items_ = 0;
  size_t next_ = 0;  // next bucket to launch
  int64_t step_ = 0;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(allreduce, flowrun::AllreduceNode)
