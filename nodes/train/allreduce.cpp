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
// The reductions go through the one collective interface (parallel/collectives.hpp): MPI for CPU
// gradients, NCCL for CUDA ones on the communicator's own stream, where a bucket's all-reduce
// waits for what the compute stream queued before it (backward writing the bucket), and the
// compute stream waits for the all-reduce before the optimizer reads the gradients, so the host
// never blocks on a reduction. Failures still end within run.comm_timeout_s: each step first
// checks (on the host, with the timeout) that the previous step's reductions ended, one step
// behind, when they are long done normally.
//
// Sharded gradients (a zero plan's stage gradients, ZeRO stage 2): each bucket is packed by
// owner and reduce-scattered instead (MPI, or NCCL as grouped reduces), and what this rank owns
// is unpacked into its slices. This path runs with one process too (the rank owns everything),
// so the sharded code is the same at any world size.
#include "train/allreduce.hpp"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "common/grads.hpp"
#include "parallel/collectives.hpp"
#include "parallel/expert_parallel.hpp"
#include "registry.hpp"
#include "train/optimizer_shard.hpp"

namespace flowrun {

FlatLayout layout_of(const GradBuffer& b) {
  FlatLayout l;
  l.slots = b.slots;
  l.order = b.order;
  l.position = b.position;
  for (size_t g = 0; g < b.flats.size(); ++g)
    l.groups.push_back({b.flats[g].scalar_type(), b.flats[g].device(), b.flats[g].numel(), g < b.kinds.size() ? b.kinds[g] : 0});
  return l;
}

bool BucketPlan::fits(const GradBuffer& b) const { return layout == layout_of(b); }

BucketPlan plan_buckets(const GradBuffer& buffer, double first_bucket_mb, double bucket_mb) {
  return plan_buckets(layout_of(buffer), first_bucket_mb, bucket_mb);
}

BucketPlan plan_buckets(const FlatLayout& layout, double first_bucket_mb, double bucket_mb) {
  BucketPlan plan;
  plan.layout = layout;
  plan.bucket_of.assign(layout.slots.size(), -1);

  const double mib = 1024.0 * 1024.0;
  const auto first_cap = static_cast<int64_t>(first_bucket_mb * mib);
  const auto cap = static_cast<int64_t>(bucket_mb * mib);
  int last_group = -1;
  bool open = false;
  for (int k = 0; k < static_cast<int>(layout.order.size()); ++k) {
    const int param = layout.order[static_cast<size_t>(k)];
    const FlatLayout::Slot& s = layout.slots[static_cast<size_t>(param)];
    const int64_t bytes = s.numel * static_cast<int64_t>(c10::elementSize(layout.groups[static_cast<size_t>(s.group)].dtype));
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
    // Collective: setup() runs in file order on every rank, so groups are made in one order.
    // The data-parallel group (run.parallel's dp: the world while tp and pp are 1). Under tp the
    // ranks of one replica hold different parts of the parameters: each part is averaged over
    // the ranks holding the same part, its replicas.
    group_ = parallel::Group::along(ctx.name(), parallel::mesh_of(ctx.run()), parallel::Dim::dp, ctx.run().rank);
    world_ = group_->size();
    // Expert parallel: an expert's gradient (its own buffers, GradBuffer::kExperts) holds what
    // every ep rank's tokens gave it; summed over the ranks that hold the same experts (edp, dp / ep
    // of them; none when ep is dp) and divided by dp, it is the data-parallel average.
    edp_group_ = parallel::own_edp_group(ctx.name(), ctx.run());
  }

  void on_item(StepContext& ctx, const std::string& /*port*/, const Value& v, int /*index*/, int count) override {
    const GradReady& r = v.as<GradReady>(ctx.who() + " input 'ready'");
    if (!r.buffer && !r.shard && world_ > 1)
      throw std::runtime_error(ctx.who() + ": an item on 'ready' carries no gradient buffer, which the all-reduce "
                               "of " + std::to_string(world_) + " processes needs");
    if (r.used && !r.grad.defined())
      throw std::runtime_error(ctx.who() + ": the item on 'ready' for parameter " + std::to_string(r.param) +
                               " says it has a gradient but carries none");
    if (!started_) begin_step(ctx, r, count);
    if (r.buffer != buffer_ || r.shard != shard_)
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) +
                               ": the items on 'ready' name two different gradient buffers (or shard plans)");
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
    if (!reduces()) return;  // nothing to reduce: the grads pass through
    --missing_[static_cast<size_t>(plan_.bucket_of[i])];
    if (overlap_) launch_ready();
  }

  void run(StepContext& ctx) override {
    const int n = started_ ? static_cast<int>(grads_.size()) : -1;
    if (!started_ || items_ != n)
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) + ": got " + std::to_string(items_) +
                               " items on 'ready' for " + (n < 0 ? std::string("a model") : std::to_string(n) + " trainable parameters") +
                               "; connect it to forward_backward's `ready`, which sends each parameter once a step");
    launch_ready();  // all of them when overlap is off; else what waited on earlier buckets
    for (size_t k = 0; k < works_.size(); ++k) {
      // CPU: the host waits; GPU: the optimizer's kernels queue behind the reduction, and what
      // follows here runs on the compute stream behind that wait.
      works_[k].wait();
      torch::NoGradGuard no_grad;
      if (shard_) {
        if (k >= settled_) settle_sharded(k);
      } else if (compressed_[k].defined()) {
        slice(k).copy_(compressed_[k]);
      }
      if (world_ > 1 && works_[k].timed())
        ctx.trace_mark("bucket " + std::to_string(k) + " (" + mib(plan_.buckets[k].bytes) + ")", works_[k].started(),
                       works_[k].finished());
    }
    if (world_ > 1) {
      // Used on any rank: averaged gradient (zeros from the ranks that did not use it). Used on
      // none: undefined, so the optimizer skips it, as DDP with find_unused_parameters leaves it.
      const torch::Tensor used = torch::from_blob(used_.data(), {static_cast<int64_t>(used_.size())}, torch::kByte);
      group_->all_reduce(used, comm::Op::max, "used-parameter flags (step " + std::to_string(ctx.step()) + ")").wait();
    }
    previous_ = works_;  // checked when the next step begins
    // After the reduction in place, a used parameter's grad (its view of the buffer) holds the
    // average; sharded, this rank's piece of it (none where it owns none).
    Grads grads(static_cast<size_t>(n));
    const Grads pieces = shard_ ? pieces_of_slices(shard_->plan, slices_) : Grads();
    for (size_t i = 0; i < grads.size(); ++i)
      if (used_[i]) grads[i] = shard_ ? pieces[i] : grads_[i];
    end_step();
    ctx.out("grads", std::move(grads));
  }

 private:
  // The first item of a step: the buffer it names (null in a single process with fresh grads,
  // and with sharded gradients: then the shard plan) and, with several processes, its bucket plan.
  void begin_step(StepContext& ctx, const GradReady& first, int count) {
    const std::shared_ptr<GradBuffer>& buffer = first.buffer;
    const int n = count;
    if (buffer && static_cast<int>(buffer->views.size()) != n)
      throw std::runtime_error(ctx.who() + ": the 'ready' stream announces " + std::to_string(count) +
                               " items, its gradient buffer holds " + std::to_string(buffer->views.size()) +
                               " parameters");
    // Last step's reductions ended (long since, normally): the host checks, bounded by
    // run.comm_timeout_s, so a dead rank ends the run here instead of hanging it (a CPU
    // reduction was waited for already).
    for (parallel::Work& w : previous_) w.check();
    previous_.clear();
    if (first.shard) {
      begin_sharded(ctx, *first.shard, n);
    } else if (world_ > 1 && (plan_.bucket_of.empty() || !plan_.fits(*buffer))) {
      plan_ = plan_buckets(*buffer, first_bucket_mb_, bucket_mb_);
      if (ctx.run().rank == 0)
        spdlog::debug("{}: {} parameters in {} buckets", ctx.who(), n, plan_.buckets.size());
      choose_transport(ctx, plan_.layout);
    }
    started_ = true;
    buffer_ = buffer;
    shard_ = first.shard;
    grads_.assign(static_cast<size_t>(n), torch::Tensor());
    ready_.assign(static_cast<size_t>(n), 0);
    used_.assign(static_cast<size_t>(n), 0);
    missing_.clear();
    if (reduces())
      for (const auto& b : plan_.buckets) missing_.push_back(b.end - b.first);
    items_ = 0;
    next_ = 0;
    settled_ = 0;
    step_ = ctx.step();
  }

  // ZeRO stage 2 (train/optimizer_shard.hpp): buckets over the shard's layout, reduce-scattered
  // into this rank's slice of each buffer, over MPI (CPU) or NCCL (CUDA).
  void begin_sharded(StepContext& ctx, const GradShard& shard, int n) {
    if (static_cast<int>(shard.buckets.slots.size()) != n || shard.plan.world != world_)
      throw std::runtime_error(ctx.who() + ": the shard plan on 'ready' is for " +
                               std::to_string(shard.buckets.slots.size()) + " parameters and " +
                               std::to_string(shard.plan.world) + " ranks; the step has " + std::to_string(n) +
                               " parameters and " + std::to_string(world_) + " ranks");
    if (!(plan_.layout == shard.buckets) || plan_.bucket_of.empty()) {
      plan_ = plan_buckets(shard.buckets, first_bucket_mb_, bucket_mb_);
      if (ctx.run().rank == 0)
        spdlog::debug("{}: {} parameters in {} buckets (reduce-scattered)", ctx.who(), n, plan_.buckets.size());
      choose_transport(ctx, plan_.layout);
    }
    // This step's slices: every element is written by some bucket (unused parameters: zeros).
    // New each step (the last step's may still be held by its optimizer); reusing them through
    // a pool, as the gradient buffers are, kept two sets alive and raised the peak by one set.
    slices_.clear();
    for (size_t g = 0; g < shard.plan.groups.size(); ++g)
      slices_.push_back(torch::empty({shard.plan.groups[g].end - shard.plan.groups[g].begin},
                                     torch::TensorOptions()
                                         .dtype(shard.plan.layout.groups[g].dtype)
                                         .device(shard.plan.layout.groups[g].device)));
  }

  // The gradients' flat buffers: one device (MPI for the CPU, NCCL for CUDA: the collective
  // interface picks by it), dtypes the ranks can exchange. After a new bucket plan.
  void choose_transport(StepContext& ctx, const FlatLayout& layout) {
    const torch::Device device = layout.groups.front().device;
    for (const auto& g : layout.groups) {
      parallel::comm_dtype(g.dtype, ctx.who());
      if (g.device != device)
        throw std::runtime_error(ctx.who() + ": gradients on both " + device.str() + " and " + g.device.str() +
                                 "; keep the model on one device");
    }
    if (!device.is_cpu() && !device.is_cuda())
      throw std::runtime_error(ctx.who() + ": cannot all-reduce gradients on " + device.str());
    on_gpu_ = device.is_cuda();
  }

  void end_step() {
    started_ = false;
    buffer_.reset();
    shard_.reset();
    slices_.clear();
    received_.clear();
    staged_.clear();
    staged_dtype_.clear();
    grads_.clear();
    works_.clear();
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

  // Whether this step sends anything: with several processes, or sharded (then even alone).
  bool reduces() const { return world_ > 1 || shard_; }

  // Launch buckets in order while the next one has all its parameters (none in a single
  // unsharded process: nothing to average, no copy, no division, no message).
  void launch_ready() {
    if (!reduces()) return;
    while (next_ < plan_.buckets.size() && missing_[next_] == 0) launch(next_++);
    // Sharded over MPI: what arrived is put in place now, so a bucket's buffers live only while it
    // is sent. (Over NCCL the host does not know; run() settles each bucket behind its event.)
    while (shard_ && !on_gpu_ && settled_ < works_.size() && works_[settled_].done()) settle_sharded(settled_);
  }

  // Sharded: bucket k's reduce-scatter is done: this rank's block into its slices, the buffers let go.
  void settle_sharded(size_t k) {
    torch::NoGradGuard no_grad;
    const Bucket& b = plan_.buckets[k];
    unpack_mine(*shard_, b.first, b.end, received_[k].to(staged_dtype_[k]), slices_);
    staged_[k].reset();
    received_[k].reset();
    settled_ = k + 1;
  }

  void launch(size_t k) {
    compressed_.emplace_back();
    torch::NoGradGuard no_grad;
    if (shard_) return launch_sharded(k);
    torch::Tensor s = slice(k);
    // Average = sum of grad / world: divide before the sum (exact for a power-of-two world), as
    // DDP's default communication hook does.
    s.div_(world_);
    torch::Tensor data = s;
    const bool experts = buffer_->kinds.size() > static_cast<size_t>(plan_.buckets[k].group) &&
                         buffer_->kinds[static_cast<size_t>(plan_.buckets[k].group)] == GradBuffer::kExperts;
    parallel::Group* over = experts ? edp_group_.get() : group_.get();
    if (!over) {  // experts held by this rank only (ep = dp): the division is the average
      works_.emplace_back();
      return;
    }
    if (compress_bf16_ && s.scalar_type() != torch::kBFloat16) data = compressed_.back() = s.to(torch::kBFloat16);
    works_.push_back(over->all_reduce(data, comm::Op::sum,
                                      "all-reduce of bucket " + std::to_string(k) + " (step " + std::to_string(step_) + ")"));
  }

  // ZeRO stage 2: bucket k's gradients packed by owner (divided by the world first, as above),
  // its parameters' own gradients let go, and the packed buffer reduce-scattered: this rank
  // receives the sum of its block.
  void launch_sharded(size_t k) {
    const Bucket& b = plan_.buckets[k];
    std::vector<size_t> counts;
    torch::Tensor packed = pack_by_owner(*shard_, b.first, b.end, grads_, counts, world_);
    for (int pos = b.first; pos < b.end; ++pos) grads_[static_cast<size_t>(plan_.layout.order[static_cast<size_t>(pos)])].reset();
    staged_dtype_.push_back(packed.scalar_type());
    if (compress_bf16_ && packed.scalar_type() != torch::kBFloat16) packed = packed.to(torch::kBFloat16);
    torch::Tensor mine = torch::empty({static_cast<int64_t>(counts[static_cast<size_t>(group_->rank())])}, packed.options());
    const std::string what = "reduce-scatter of bucket " + std::to_string(k) + " (step " + std::to_string(step_) + ")";
    staged_.push_back(packed);  // kept until the bucket is settled
    received_.push_back(mine);
    works_.push_back(group_->reduce_scatter(packed, mine, counts, what));  // behind the packing, on a GPU too
  }

  double bucket_mb_ = 0, first_bucket_mb_ = 0;  // setup: the schema's (defaults there)
  bool compress_bf16_ = false, overlap_ = false;
  std::shared_ptr<parallel::Group> group_;  // the data-parallel ranks
  int world_ = 1;                           // their number
  std::shared_ptr<parallel::Group> edp_group_;  // the ranks holding this rank's experts (null: it alone)
  BucketPlan plan_;
  bool on_gpu_ = false;                     // the gradients are CUDA tensors (NCCL)
  std::vector<parallel::Work> previous_;    // the last step's reductions, checked at the next

  // This step's state (reset by end_step()).
  bool started_ = false;  // its first item arrived
  std::shared_ptr<GradBuffer> buffer_;
  std::shared_ptr<const GradShard> shard_;  // sharded gradients (then no buffer_)
  std::vector<torch::Tensor> slices_;       // sharded: this rank's slice of each buffer, averaged
  std::vector<torch::Tensor> staged_, received_;  // sharded, per launched bucket: sent, this rank's block
  std::vector<torch::Dtype> staged_dtype_;        // sharded, per launched bucket: the gradients' dtype
  Grads grads_;  // per parameter: the grad its item carried (sharded: until its bucket is sent)
  std::vector<uint8_t> ready_, used_;  // per parameter; used_ is all-reduced in place (u8 max)
  std::vector<int> missing_;           // per bucket: parameters not ready yet
  std::vector<parallel::Work> works_;        // per launched bucket: its reduction
  std::vector<torch::Tensor> compressed_;    // per launched bucket: its bf16 copy (compress: bf16)
  int items_ = 0;
  size_t next_ = 0;  // next bucket to launch
  size_t settled_ = 0;  // sharded: buckets before this one are in slices_
  int64_t step_ = 0;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(allreduce, flowrun::AllreduceNode)
