// forward_backward: loss and gradients of a model on a batch.
// Schema: schemas/forward_backward.yaml. Test: tests/nodes/forward_backward_test.cpp.
#include "train/forward_backward.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "common/cuda_graph.hpp"
#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/named_scalars.hpp"
#include "common/seed.hpp"
#include "models/activation_checkpoint.hpp"
#include "models/dropout.hpp"
#include "parallel/zero_plan.hpp"
#include "parallel/cost_model.hpp"
#include "parallel/expert_parallel.hpp"
#include "parallel/layout.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"
#include "registry.hpp"
#include "train/fully_sharded.hpp"
#include "train/optimizer_shard.hpp"
#include "train/pipeline.hpp"
#include "train/step_memory.hpp"

namespace flowrun {

int64_t batch_rows(const TensorMap& batch) {
  int64_t rows = -1;
  std::string first;
  for (const auto& [k, t] : batch) {
    if (!t.defined() || t.dim() == 0) continue;
    if (rows < 0) {
      rows = t.size(0);
      first = k;
    } else if (t.size(0) != rows) {
      throw std::runtime_error("batch tensors disagree on the batch size: '" + first + "' has " +
                               std::to_string(rows) + " rows, '" + k + "' has " + std::to_string(t.size(0)));
    }
  }
  if (rows < 0) throw std::runtime_error("the batch has no tensor with a batch dimension");
  return rows;
}

std::vector<TensorMap> split_batch(const TensorMap& batch, int64_t n) {
  const int64_t rows = batch_rows(batch);
  if (n < 1) throw std::runtime_error("accumulate must be >= 1");
  if (n > rows)
    throw std::runtime_error("accumulate " + std::to_string(n) + " is more than the batch's " + std::to_string(rows) +
                             " rows");
  std::vector<TensorMap> parts(static_cast<size_t>(n));
  for (const auto& [k, t] : batch) {
    if (!t.defined() || t.dim() == 0) {
      for (auto& p : parts) p[k] = t;
      continue;
    }
    std::vector<torch::Tensor> chunks = t.tensor_split(n, 0);
    for (int64_t i = 0; i < n; ++i) parts[static_cast<size_t>(i)][k] = chunks[static_cast<size_t>(i)];
  }
  return parts;
}

void start_grads(const FwdBwdOptions& options, std::vector<torch::Tensor>& params) {
  if (options.buffer && options.fill == GradFill::accumulate) {
    // Zeroed grads that autograd adds into in place (AccumulateGrad: grad += new, grad mode
    // being off in backward); 0 + g is g exactly, so the result equals the fresh-tensor path.
    options.buffer->zero();
    options.buffer->attach(params);
  } else {
    // Fresh grads each step (like zero_grad(set_to_none=True)): autograd takes the first
    // gradient it computes as the .grad() itself, and the previous step's grads, still held by
    // their consumers, are never overwritten.
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    if (options.buffer) options.buffer->remember(params);
  }
}

FwdBwdResult forward_backward(ModelState& model, const TensorMap& given, const Objective& objective,
                              const FwdBwdOptions& options) {
  const int64_t accumulate = options.accumulate;
  const c10::Device device = model_device(model);
  check_needs(objective, given);
  // Data nodes place batches on the run's device; a batch from elsewhere (a plugin) follows.
  const TensorMap batch = to_device(given, device);
  std::vector<torch::Tensor> params = model.trainable_parameters();
  if (params.empty()) throw std::runtime_error("the model has no trainable parameters");
  const size_t n = params.size();

  // With a buffer or on_ready, hooks on the grad accumulators say which parameters got a
  // gradient (any micro-batch: `used`) and report each once during the last backward.
  const bool track = options.buffer || options.on_ready;
  std::shared_ptr<GradHooks> hooks = options.hooks;
  if (track && !hooks) hooks = std::make_shared<GradHooks>(params);
  if (track && !hooks->covers(params))
    throw std::runtime_error("forward_backward: the gradient hooks were made for other parameters than the model's");
  // GradFill::copy: each finished gradient goes into its view once (settle), the .grad() then
  // pointing there.
  const bool copy = options.buffer && options.fill == GradFill::copy;
  std::mutex mu;  // hooks may run on autograd's device threads (CUDA)
  std::vector<char> used(n, 0), reported(n, 0), settled(n, 0);
  bool last = false;  // in the last micro-batch's backward
  std::optional<GradHooks::Armed> armed;
  if (track)
    armed.emplace(*hooks, [&](int i) {
      std::lock_guard<std::mutex> l(mu);
      const size_t k = static_cast<size_t>(i);
      used[k] = 1;
      if (options.on_grad) options.on_grad(i);
      if (!last) return;
      if (copy && !settled[k]) {
        settled[k] = 1;
        options.buffer->settle(k, params[k]);
      }
      if (options.on_ready && !reported[k]) {
        reported[k] = 1;
        options.on_ready(i, true);
      }
    });

  start_grads(options, params);

  torch::AutoGradMode grad_on(true);
  const int64_t total = batch_rows(batch);
  std::vector<TensorMap> parts =
      accumulate == 1 ? std::vector<TensorMap>{batch} : split_batch(batch, accumulate);
  torch::Tensor loss_sum;
  int64_t first_row = options.first_row;  // the global index of parts[i]'s first row
  for (size_t i = 0; i < parts.size(); ++i) {
    const TensorMap& part = parts[i];
    const double w = static_cast<double>(batch_rows(part)) / static_cast<double>(total);
    if (options.on_pass) options.on_pass(static_cast<int>(i));
    torch::Tensor loss;
    {
      std::optional<TrainingScope> training;
      if (options.dropout_seed) {
        training.emplace(mix_seed({*options.dropout_seed, static_cast<uint64_t>(i)}));
        training->set_rows(options.rows_seed, first_row);
      }
      AutocastScope autocast(options.precision, device);
      loss = objective.loss(model, part);
      // The model's own term (a mixture of experts' router load-balancing loss), as transformers
      // adds it to its loss.
      if (model.extra_loss)
        if (const torch::Tensor extra = model.extra_loss(*model.module); extra.defined()) loss = loss + extra.to(loss.dtype());
    }
    if (loss.dim() != 0) throw std::runtime_error("objective " + objective.type + " returned a non-scalar loss");
    if (!loss.requires_grad()) throw std::runtime_error("the loss does not depend on any trainable parameter");
    {
      std::lock_guard<std::mutex> l(mu);
      last = i + 1 == parts.size();
    }
    first_row += batch_rows(part);
    (loss * w).backward();
    torch::Tensor l = loss.detach() * w;
    loss_sum = loss_sum.defined() ? loss_sum + l : l;
  }
  armed.reset();
  // The parameters backward did not reach in the last micro-batch, in reverse module order
  // (the buffer's order): all at once, now that backward is over.
  if (copy)
    for (size_t k = n; k-- > 0;)
      if (!settled[k]) options.buffer->settle(k, params[k]);
  if (options.on_ready)
    for (size_t k = n; k-- > 0;)
      if (!reported[k]) options.on_ready(static_cast<int>(k), used[k] != 0);

  FwdBwdResult r;
  r.loss = loss_sum;
  r.grads.reserve(n);
  for (size_t k = 0; k < n; ++k)
    r.grads.push_back(!track || used[k] ? params[k].grad() : torch::Tensor());
  return r;
}

namespace {

// The model families that split over tp and cut into stages ("cappa, dit, gpt and llama"): the
// registered types whose schema has `family:`.
std::string families() {
  const std::vector<std::string> f = Registry::global().families();
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) out += (i == 0 ? "" : i + 1 == f.size() ? " and " : ", ") + f[i];
  return out;
}

class ForwardBackwardNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    objective_ = &ctx.state_as<Objective>("objective");
    has_cond_ = ctx.connected("cond");
    options_.accumulate = ctx.params().get<int64_t>("accumulate");
    options_.precision = run_precision(ctx.run());
    // Refuse an unsupported precision now rather than at step 1 (reading the model's device
    // in setup touches no parameter data).
    const c10::Device device = model_device(ctx.state_as<ModelState>("model"));
    check_precision(options_.precision, device, ctx.who());
    if (options_.precision == Precision::bf16 && device.is_cpu() && ctx.run().rank == 0)
      spdlog::warn("{}: run.precision bf16 on the CPU runs matrix products in bf16, which is much slower than fp32 "
                   "on CPUs without bf16 matrix instructions (about 17x on the 2-core CI machine)",
                   ctx.who());
    seed_ = ctx.run().seed;
    // Draws (dropout masks, per-row noise) by data-parallel replica: the tp ranks of a replica
    // run the same rows and draw alike. ZeRO shards over the replicas too.
    dp_ = parallel::replica_of(ctx.run());
    tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // this node's channel for the split model's collectives
    if (tp_group_ && !ctx.state_as<ModelState>("model").tp)
      throw std::runtime_error(ctx.who() + ": run.parallel.tp is " + std::to_string(tp_group_->size()) + ", but its model (" +
                               ctx.state_as<ModelState>("model").kind +
                               ") does not split over tensor parallel (built for " + families() + "): every tp rank would "
                               "train the whole model; set run.parallel.tp=1");
    // Expert parallel: this node's channel for the all-to-alls of a mixture of experts split over
    // the ep ranks, and the experts' gradients kept in buffers of their own (the allreduce averages
    // them over the ranks holding the same experts).
    ep_group_ = parallel::own_ep_group(ctx.name(), ctx.run());
    if (ep_group_) {
      const ModelState& model = ctx.state_as<ModelState>("model");
      for (const auto& [name, t] : model.named_parameters(/*trainable_only=*/true)) {
        const bool expert = model.tp && model.tp->split(name).experts && model.tp->group_of(model.tp->split(name));
        grad_kinds_.push_back(expert ? GradBuffer::kExperts : 0);
      }
      if (std::find(grad_kinds_.begin(), grad_kinds_.end(), GradBuffer::kExperts) == grad_kinds_.end())
        throw std::runtime_error(ctx.who() + ": run.parallel.ep is " + std::to_string(ep_group_->size()) + ", but its model (" +
                                 model.kind + ") has no trainable experts to split (expert parallel is for a mixture of "
                                 "experts: llama's moe); set run.parallel.ep=1");
    }
    fresh_ = ctx.params().get<std::string>("grad_layout") == "fresh";
    refuse_ = ctx.params().get<std::string>("memory_check") == "refuse";
    time_blocks_ = ctx.params().get<bool>("time_blocks");
    profile_ = std::make_shared<StepProfile>();
    ctx.own_state("profile", profile_);
    const std::vector<std::string> model_ref = ctx.refs("model");
    model_node_ = model_ref.empty() ? "model" : model_ref.front().substr(0, model_ref.front().find('.'));
    if (ctx.connected("zero")) zero_ = &ctx.state_as<ZeroPlan>("zero");
    // ZeRO stage params: this node's channel over the data-parallel ranks for the gathers (the
    // optimizer shards the model at its setup, after this one).
    if (zero_ && zero_->shards_params()) gather_group_ = parallel::own_dp_group(ctx.name() + " gathers", ctx.run());
    cuda_graph_ = ctx.run().graph && ctx.run().graph->settings.cuda_graph;
    setup_pipeline(ctx);
    if (cuda_graph_) {
      refuse_uncapturable(ctx, device);
      work_ = std::make_unique<CapturedWork>(device.index());
    }
  }

  void run(StepContext& ctx) override {
    const parallel::TpChannel tp_channel(tp_group_.get());
    const parallel::EpChannel ep_channel(ep_group_.get());
    const TensorMap& in_batch = ctx.in<TensorMap>("batch");
    TensorMap batch = in_batch;
    if (has_cond_)
      for (const Value* c : ctx.in_all("cond")) batch = merge_batches(batch, c->as<TensorMap>(ctx.who() + " input cond"));
    ModelState& model = ctx.state_as<ModelState>("model");
    // Dropout masks of step s depend only on (run seed, s, rank): reproducible and resumable.
    FwdBwdOptions o = options_;
    o.dropout_seed = mix_seed({seed_, kSeedTagDropout, static_cast<uint64_t>(ctx.step()), static_cast<uint64_t>(dp_.index)});
    // Per-row draws of step s depend on (run seed, s, global row): the same for any number of ranks.
    o.rows_seed = mix_seed({seed_, kSeedTagRows, static_cast<uint64_t>(ctx.step())});
    o.first_row = static_cast<int64_t>(dp_.index) * batch_rows(batch);

    if (!memory_checked_) check_memory(ctx, model, batch);
    // run.cuda_graph: all of autograd's work on the graph's own stream, from the gradient hooks
    // on (they make the parameters' accumulators, which keep the stream they were made on).
    std::optional<CapturedWork::OnStream> on_graph_stream;
    if (cuda_graph_) on_graph_stream.emplace(*work_);
    // ZeRO stage params: the model's parameters gathered around their use, from here to the end
    // of backward (train/fully_sharded.hpp); each block's let go once its gradients are made.
    std::unique_ptr<ParamUse> use;
    if (model.shards) use = model.shards->open(gather_group_.get(), ctx.who() + " of step " + std::to_string(ctx.step()));
    const std::vector<torch::Tensor> params = model.trainable_parameters();
    if (!hooks_ || !hooks_->covers(params)) {
      // First step, or the model's parameter tensors changed: new hooks, new buffers.
      hooks_.reset();
      pool_.clear();
      grad_shard_.reset();
      graph_.reset();  // run.cuda_graph: captured for the old tensors; again after the warm-up
      eager_steps_ = 0;
      if (!params.empty()) hooks_ = std::make_shared<GradHooks>(params);
    }
    o.hooks = hooks_;
    // Each parameter once, as its gradient becomes final: allreduce reduces buckets meanwhile.
    // With one replica (one process, or tp and pp ranks only) there is nothing to reduce during
    // backward: all of them after it, in the buffer's order, rather than waking a worker for each
    // parameter while backward runs (and no gradient buffers).
    const int count = static_cast<int>(params.size());
    const bool overlap = dp_.count > 1;
    const bool sharded = zero_ && zero_->shards_gradients();  // at any world size (one process: owns all)
    int index = 0;
    if (sharded) {
      // ZeRO stage 2: no buffer. Each finished gradient goes to the allreduce as autograd wrote
      // it, and its .grad() is let go (safe in the hook: its accumulator is done for this
      // backward), so it is freed once the allreduce has sent its bucket.
      if (!fresh_)
        throw std::runtime_error(ctx.who() + ": grad_layout buffer keeps every gradient in a whole buffer, which the "
                                 "ZeRO plan's stage gradients is there to avoid: set grad_layout: fresh");
      if (!grad_shard_ || grad_shard_->plan.layout.slots.size() != params.size())
        grad_shard_ = use ? static_cast<const ShardedParams&>(*model.shards).grad_shard()
                          : GradShard::make(model.named_parameters(/*trainable_only=*/true), dp_.index, dp_.count,
                                            zero_->whole_tensors);
      o.buffer = nullptr;
      o.on_ready = [&ctx, &index, count, &params, shard = grad_shard_, use = use.get()](int param, bool used) {
        torch::Tensor p = params[static_cast<size_t>(param)];  // a handle: mutable_grad() is non-const
        torch::Tensor grad = used ? p.grad() : torch::Tensor();
        p.mutable_grad() = torch::Tensor();
        ctx.emit("ready", GradReady{param, used && grad.defined(), nullptr, std::move(grad), shard}, index++, count);
      };
      if (use) {  // ZeRO-3: each micro-batch's blocks let go as their gradients are made (they are gathered again for the next)
        o.on_pass = [use = use.get()](int) { use->new_pass(); };
        o.on_grad = [use = use.get()](int param) { use->grad_done(param); };
      }
    } else {
      // The all-reduce needs the grads in a buffer; one process needs none with fresh grads.
      o.buffer = params.empty() || (fresh_ && !overlap) ? nullptr : take_buffer(params);
      o.fill = fresh_ ? GradFill::copy : GradFill::accumulate;
      if (overlap)
        o.on_ready = [&ctx, &index, count, buffer = o.buffer](int param, bool used) {
          torch::Tensor grad = used ? buffer->views[static_cast<size_t>(param)] : torch::Tensor();
          ctx.emit("ready", GradReady{param, used, buffer, std::move(grad)}, index++, count);
        };
    }
    FwdBwdResult r;
    // time_blocks: each block's forward and backward in the trace (BlockClock; `flowrun plan`).
    std::optional<BlockClock> clock;
    if (time_blocks_) clock.emplace();
    try {
      r = pipeline_   ? pipeline_forward_backward(model, batch, *objective_, o, *pipeline_)
          : cuda_graph_ ? graphed(ctx, model, batch, o)
                        : forward_backward(model, batch, *objective_, o);
    } catch (const c10::OutOfMemoryError& e) {  // the allocator's message, without its C++ backtrace
      std::string what = e.what_without_backtrace();
      what = what.substr(0, std::min(what.find('\n'), what.find(" See documentation")));  // torch's link, on the next line
      throw std::runtime_error(ctx.who() + ": out of memory in step " + std::to_string(ctx.step()) + " (" + what +
                               "); " + memory_advice_);
    }
    if (clock) {  // each block by its place in the model (blocks_of: CapPa's encoder blocks, then its decoder's)
      clock->end_backward();
      std::map<const torch::nn::Module*, size_t> place;
      for (const torch::nn::Module* block : blocks_of(*model.module)) place.emplace(block, place.size());
      for (const BlockClock::Span& b : clock->spans())
        if (auto it = place.find(b.block); it != place.end())
          ctx.trace_mark("block " + std::to_string(it->second) + (b.backward ? " backward" : " forward"), b.start, b.end);
    }
    if (pipeline_)  // the stage's operations in the trace (run.trace): the measured timeline
      for (const PipelineRun::Timed& t : pipeline_->last_step) ctx.trace_mark(parallel::pipeline::str(t.op), t.start, t.end);
    if (on_graph_stream) {  // back on the node's stream, which now waits for the graph's
      on_graph_stream.reset();
      CapturedWork::used_here(r.loss);
      // A replay's grads live in the graph's pool for the whole run (nothing hands them out
      // again): only an eager step's, freed later, need their use on this stream noted.
      if (!replayed_)
        for (const torch::Tensor& g : r.grads) CapturedWork::used_here(g);
    }
    if (!overlap && !sharded)
      for (int k = count; k-- > 0;) {
        const torch::Tensor& grad = r.grads[static_cast<size_t>(k)];
        ctx.emit("ready", GradReady{k, grad.defined(), o.buffer, grad}, index++, count);
      }
    ctx.out("loss", r.loss);
    ctx.out("grads", std::move(r.grads));
    ctx.out("tokens", objective_->targets(batch));
    // A mixture of experts: how its routers spread this step's tokens (none for other models).
    NamedScalars experts = model.take_routing_metrics ? model.take_routing_metrics(*model.module) : NamedScalars{};
    // Expert parallel: the step's time in the all-to-alls on this rank (the tokens to their
    // experts and back, forward and backward; waiting for the slowest rank included).
    if (ep_group_) experts.emplace_back("a2a_ms", 1e3 * parallel::take_exchange_seconds(*ep_group_));
    ctx.out("experts", std::move(experts));
  }

 private:
  // run.parallel.pp > 1 (train/pipeline.hpp): the schedule this rank runs and its channel over
  // the pp ranks; refused for what the pipeline path does not do yet, naming the setting.
  void setup_pipeline(SetupContext& ctx) {
    const RunInfo& info = ctx.run();
    if (!info.graph || info.graph->settings.parallel.pp == 1) return;
    const RunSettings::Parallel& par = info.graph->settings.parallel;
    const ModelState& model = ctx.state_as<ModelState>("model");
    const std::string pp = "run.parallel.pp is " + std::to_string(par.pp);
    if (!model.stages)
      throw std::runtime_error(ctx.who() + ": " + pp + ", but its model (" + model.kind + ") does not cut into pipeline "
                               "stages (built for " + families() + "); set run.parallel.pp=1");
    if (options_.accumulate != 1)
      throw std::runtime_error(ctx.who() + ": " + pp + " and accumulate is " + std::to_string(options_.accumulate) +
                               ": under pipeline parallel the batch's micro-batches are run.parallel.microbatches; set "
                               "accumulate: 1 and run.parallel.microbatches instead");
    if (cuda_graph_)
      throw std::runtime_error(ctx.who() + ": " + pp + " with run.cuda_graph is not built yet; set run.cuda_graph=false");
    if (!model_device(model).is_cpu())
      throw std::runtime_error(ctx.who() + ": " + pp + " with the model on " + model_device(model).str() +
                               ": pipeline stages on GPUs are not built yet (NCCL's point-to-point sends wait for their "
                               "receives, and the schedule's stages send to each other at once, which needs the sends "
                               "and receives grouped); run on the CPU (run.device=cpu) or set run.parallel.pp=1");
    const parallel::Mesh mesh = parallel::mesh_of(info);
    pipeline_ = std::make_unique<PipelineRun>(
        parallel::pipeline::make(parallel::pipeline::Config::of(par.pp, par.microbatches, par.schedule, par.virtual_stages)),
        parallel::Group::along(ctx.name() + " pipeline", mesh, parallel::Dim::pp, info.rank), mesh.coord(info.rank).pp);
  }

  std::unique_ptr<PipelineRun> pipeline_;  // run.parallel.pp > 1

  // ---- run.cuda_graph: forward and backward captured once, replayed every step ----
  // The first kEagerSteps steps run eagerly (cuBLAS handles and workspaces, autocast and the
  // caching allocator settle outside the capture, as torch's docs advise), the next is captured
  // (common/cuda_graph.hpp) on copies of its batch, and from then on each step copies its batch
  // into those tensors and replays: the grads are written where the capture's backward wrote
  // them (each .grad() pointed there again after the replay), the loss is copied out (the next
  // replay overwrites it while a logger may still read this step's). Safe because the next
  // step's forward_backward runs after this step's optimizer on the device (it reads the model
  // the optimizer writes), and nothing else keeps a step's grads.
  static constexpr int kEagerSteps = 3;
  struct Replay {
    TensorMap batch;                    // the inputs the capture read; each step's batch is copied in
    torch::Tensor loss;                 // where each replay writes the loss
    std::vector<torch::Tensor> grads;   // where each replay writes the grads (undefined: none)
    std::string key;                    // the batch's names, shapes and dtypes
  };

  // What a capture can never replay, refused at setup with the setting to change.
  void refuse_uncapturable(SetupContext& ctx, const c10::Device& device) const {
    const std::string off = "; set run.cuda_graph=false";
    if (zero_ && zero_->shards_gradients())
      throw std::runtime_error(ctx.who() + ": run.cuda_graph with the ZeRO stage gradients is not built yet (each "
                               "gradient leaves for the allreduce during backward)" + off);
    if (!fresh_)
      throw std::runtime_error(ctx.who() + ": run.cuda_graph needs grad_layout fresh: grad_layout buffer takes "
                               "one of two gradient buffers each step, and a replay writes where the capture did" + off);
    if (ctx.run().world > 1)
      throw std::runtime_error(ctx.who() + ": run.cuda_graph with several processes is not built yet (the gradient "
                               "all-reduce starts during backward, from hooks a replayed graph does not call)" + off);
    if (!CapturedWork::available())
      throw std::runtime_error(ctx.who() + ": run.cuda_graph needs a CUDA build of flowrun (FLOWRUN_CUDA)" + off);
    if (!device.is_cuda())
      throw std::runtime_error(ctx.who() + ": run.cuda_graph needs the model on a GPU; it is on " + device.str() +
                               " (run.device " + ctx.run().device + ")" + off);
  }

  static std::string batch_key(const TensorMap& batch) {
    std::string key;
    for (const auto& [name, t] : batch)
      key += name + (t.defined() ? shape_str(t) + c10::toString(t.scalar_type()) : std::string("-")) + ";";
    return key;
  }

  FwdBwdResult graphed(StepContext& ctx, ModelState& model, const TensorMap& batch, const FwdBwdOptions& o) {
    const std::string key = batch_key(batch);
    replayed_ = false;
    if (!graph_) {
      if (++eager_steps_ <= kEagerSteps) return forward_backward(model, batch, *objective_, o);
      return capture(ctx, model, batch, o, key);
    }
    if (graph_->key != key) {  // not the captured shapes (a short last batch): this step eagerly
      if (!shape_warned_ && ctx.run().rank == 0)
        spdlog::warn("{}: step {}'s batch ({}) is not the shape run.cuda_graph captured ({}): such steps run eagerly",
                     ctx.who(), ctx.step(), key, graph_->key);
      shape_warned_ = true;
      return forward_backward(model, batch, *objective_, o);
    }
    Replay& g = *graph_;
    for (auto& [name, t] : g.batch)
      if (t.defined()) t.copy_(batch.at(name), /*non_blocking=*/true);
    work_->replay();
    replayed_ = true;
    const std::vector<torch::Tensor> params = model.trainable_parameters();
    for (size_t k = 0; k < params.size(); ++k) {
      torch::Tensor p = params[k];  // a handle: mutable_grad() is non-const
      p.mutable_grad() = g.grads[k];  // an eager step in between may have made new ones
    }
    FwdBwdResult r;
    r.loss = g.loss.clone();
    r.grads = g.grads;
    return r;
  }

  FwdBwdResult capture(StepContext& ctx, ModelState& model, const TensorMap& batch, const FwdBwdOptions& o,
                       const std::string& key) {
    auto g = std::make_unique<Replay>();
    g->key = key;
    // Copies on the model's device: a batch from the host would be copied inside the capture,
    // which waits for the host.
    const c10::Device device = model_device(model);
    for (const auto& [name, t] : batch)
      g->batch[name] = t.defined() ? t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true) : t;
    const uint64_t drawn = TrainingScope::draws();
    const std::string why = ctx.who() + ": run.cuda_graph: step " + std::to_string(ctx.step()) + " ";
    const std::string draws = "draws random numbers (dropout, or the objective's own draws such as diffusion's t "
                              "and noise), and a replayed graph would draw the same ones every step; set the "
                              "model's dropout to 0 or run.cuda_graph=false";
    FwdBwdResult r;
    try {
      work_->capture([&] { r = forward_backward(model, g->batch, *objective_, o); });
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception& e) {
      if (TrainingScope::draws() != drawn) throw std::runtime_error(why + draws);
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      throw std::runtime_error(why + "could not be captured as a CUDA graph (" + what +
                               "); set run.cuda_graph=false to run it eagerly");
    }
    if (TrainingScope::draws() != drawn) throw std::runtime_error(why + draws);
    g->loss = r.loss;
    g->grads = r.grads;
    if (ctx.run().rank == 0)
      spdlog::info("{}: run.cuda_graph: forward and backward captured at step {} ({} eager steps before), "
                   "replayed from here on", ctx.who(), ctx.step(), kEagerSteps);
    graph_ = std::move(g);
    r.loss = graph_->loss.clone();
    return r;
  }

  // Before the first step: the step's memory per rank (common/memory.hpp), logged; on the CPU,
  // refused (memory_check: refuse) when what is still to allocate exceeds what is available,
  // naming the settings that would make it fit.
  // The memory model (train/step_memory.hpp), once, before the first step.
  void check_memory(StepContext& ctx, const ModelState& model, const TensorMap& batch) {
    memory_checked_ = true;
    StepMemorySetup s;
    s.who = ctx.who(), s.node = ctx.name(), s.model_node = model_node_;
    s.rank = ctx.run().rank, s.world = ctx.run().world, s.graph = ctx.run().graph;
    s.dp = dp_, s.zero = zero_;
    if (ctx.connected("zero")) s.zero_refs = ctx.refs("zero");
    s.fresh = fresh_, s.grad_buffers = static_cast<int>(kPool);
    s.accumulate = options_.accumulate, s.precision = options_.precision, s.pipeline = pipeline_.get();
    const StepMemoryCheck check = check_step_memory(s, model, batch, time_blocks_ ? profile_.get() : nullptr);
    memory_advice_ = check.advice;
    if (check.over.empty()) return;
    if (refuse_) throw std::runtime_error(check.over + " (" + ctx.name() + ".memory_check=warn runs anyway)");
    if (ctx.run().rank == 0) spdlog::warn("{}", check.over);
  }

  // A buffer nobody holds any more, else a new one. Step s's grads stay held (by the step's
  // values until the step retires, by a slow reader) while step s+1 runs its backward, so one
  // buffer would not do; two usually do. The pool keeps at most kPool buffers: a buffer dropped
  // from it lives on only as long as its holders.
  std::shared_ptr<GradBuffer> take_buffer(const std::vector<torch::Tensor>& params) {
    for (size_t i = 0; i < pool_.size(); ++i)
      if (pool_[i]->reusable()) {
        std::shared_ptr<GradBuffer> b = pool_[i];
        pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(i));
        pool_.push_back(b);  // most recently used last
        return b;
      }
    if (!grad_kinds_.empty() && grad_kinds_.size() != params.size())
      throw std::logic_error("forward_backward: " + std::to_string(params.size()) + " trainable parameters, " +
                             std::to_string(grad_kinds_.size()) + " at setup");
    std::shared_ptr<GradBuffer> b = GradBuffer::make(params, grad_kinds_);
    if (pool_.size() >= kPool) pool_.erase(pool_.begin());
    pool_.push_back(b);
    return b;
  }

  static constexpr size_t kPool = 2;
  const Objective* objective_ = nullptr;  // the objective node's; read-only, lives as long as the graph
  bool has_cond_ = false;
  bool fresh_ = true;  // grad_layout fresh
  bool refuse_ = true;  // memory_check refuse
  bool time_blocks_ = false;
  std::shared_ptr<StepProfile> profile_;  // the `profile` state output (time_blocks: filled at the first step)
  bool memory_checked_ = false;
  std::string memory_advice_;  // check_memory's estimate and the settings that reduce it
  std::string model_node_;  // the model node's name (for the settings a refusal names)
  FwdBwdOptions options_;
  uint64_t seed_ = 0;
  parallel::Replica dp_;  // this rank's data-parallel replica and their count
  std::shared_ptr<parallel::Group> tp_group_;  // run.parallel.tp > 1: the split model's collectives (TpChannel)
  std::shared_ptr<parallel::Group> ep_group_;  // run.parallel.ep > 1: the experts' all-to-alls (EpChannel)
  std::vector<int> grad_kinds_;                // run.parallel.ep > 1: per trainable parameter, expert or not
  std::shared_ptr<GradHooks> hooks_;
  std::vector<std::shared_ptr<GradBuffer>> pool_;  // least recently used first
  std::shared_ptr<const GradShard> grad_shard_;     // ZeRO stage 2: the plan each item carries
  const ZeroPlan* zero_ = nullptr;  // the zero node's plan, if `zero` is connected
  std::shared_ptr<parallel::Group> gather_group_;  // ZeRO stage params: this node's channel for the gathers
  bool cuda_graph_ = false;  // run.cuda_graph
  int eager_steps_ = 0;      // steps run eagerly before the capture
  bool shape_warned_ = false;
  bool replayed_ = false;    // this step replayed the graph (its grads are the graph's)
  std::unique_ptr<CapturedWork> work_;  // run.cuda_graph: the graph's stream, and the graph
  std::unique_ptr<Replay> graph_;        // what the graph reads and writes, once captured
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(forward_backward, flowrun::ForwardBackwardNode)
