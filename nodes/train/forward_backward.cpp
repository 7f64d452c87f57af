// forward_backward: loss and gradients of a model on a batch.
// Schema: schemas/forward_backward.yaml. Test: tests/nodes/forward_backward_test.cpp.
#include "train/forward_backward.hpp"

#include <spdlog/spdlog.h>

#include <map>
#include <mutex>

#include "common/seed.hpp"
#include "models/dropout.hpp"
#include "registry.hpp"
#include "train/cross_entropy.hpp"
#include "train/diffusion.hpp"

namespace flowrun {

namespace {

const torch::Tensor& need(const TensorMap& batch, const char* key, const char* objective) {
  auto it = batch.find(key);
  if (it == batch.end()) {
    std::string have;
    for (const auto& [k, _] : batch) have += (have.empty() ? "" : ", ") + k;
    throw std::runtime_error(std::string("objective ") + objective + " needs the batch's '" + key + "'; it has {" +
                             have + "}");
  }
  return it->second;
}

// Mean squared error between the model's output and the batch's "y".
torch::Tensor mse(ModelState& model, const TensorMap& batch) {
  const torch::Tensor& y = need(batch, "y", "mse");
  torch::Tensor pred = model.forward(batch);
  if (!pred.sizes().equals(y.sizes()))
    throw std::runtime_error("objective mse: model output " + std::string(c10::str(pred.sizes())) +
                             " and target y " + std::string(c10::str(y.sizes())) + " differ in shape");
  return torch::mse_loss(pred, y.to(pred.dtype()));
}

int64_t mse_targets(const TensorMap& batch) { return batch_rows(batch); }

// Next-token cross-entropy of a language model: the model maps batch["tokens"] [B, T+1] to
// logits [B, T, vocab] for tokens[:, :-1] (models/gpt.hpp); the targets are tokens[:, 1:].
// Mean over the B*T targets. The softmax over the vocabulary runs in fp32 whatever precision
// the model computed its logits in, fused (train/cross_entropy.hpp: with a 50k vocabulary the
// loss is a large part of a small model's step).
torch::Tensor lm(ModelState& model, const TensorMap& batch) {
  const torch::Tensor& tokens = need(batch, "tokens", "lm");
  if (tokens.dim() != 2 || tokens.size(1) < 2)
    throw std::runtime_error("objective lm: batch 'tokens' must be [batch, T+1] with T >= 1, got " +
                             std::string(c10::str(tokens.sizes())));
  const int64_t B = tokens.size(0), T = tokens.size(1) - 1;
  torch::Tensor logits = model.forward(batch);
  if (logits.dim() != 3 || logits.size(0) != B || logits.size(1) != T)
    throw std::runtime_error("objective lm: the model returned " + std::string(c10::str(logits.sizes())) +
                             " for tokens " + std::string(c10::str(tokens.sizes())) + "; expected [" +
                             std::to_string(B) + ", " + std::to_string(T) + ", vocab]");
  const int64_t V = logits.size(2);
  torch::Tensor targets = tokens.narrow(1, 1, T).reshape({B * T}).to(torch::kLong);
  return cross_entropy_mean(logits.reshape({B * T, V}).to(torch::kFloat), targets);
}

int64_t lm_targets(const TensorMap& batch) {
  const torch::Tensor& tokens = need(batch, "tokens", "lm");
  return tokens.dim() == 2 && tokens.size(1) >= 2 ? tokens.size(0) * (tokens.size(1) - 1) : 0;
}

// Denoising diffusion with default options (diffusion.hpp; the node configures its own with
// make_objective_def): the targets are the batch's rows (images).
torch::Tensor diffusion_default(ModelState& model, const TensorMap& batch) {
  return diffusion::loss(model, batch, diffusion::Options{});
}

int64_t rows_targets(const TensorMap& batch) { return batch_rows(batch); }

const std::map<std::string, ObjectiveDef>& objectives() {
  static const std::map<std::string, ObjectiveDef> m = {
      {"mse", {&mse, &mse_targets}},
      {"lm", {&lm, &lm_targets}},
      {"diffusion", {&diffusion_default, &rows_targets}},
  };
  return m;
}

}  // namespace

const ObjectiveDef* find_objective_def(const std::string& name) {
  auto it = objectives().find(name);
  return it == objectives().end() ? nullptr : &it->second;
}

const Objective* find_objective(const std::string& name) {
  const ObjectiveDef* d = find_objective_def(name);
  return d ? &d->loss : nullptr;
}

ObjectiveDef make_objective_def(const std::string& name, const YAML::Node& params) {
  const ObjectiveDef* d = find_objective_def(name);
  if (!d) throw std::runtime_error("unknown objective '" + name + "'");
  ObjectiveDef def = *d;
  if (name == "diffusion") {
    diffusion::Options o;
    const YAML::Node n = params["diffusion"];
    if (n && n.IsMap()) {
      if (n["schedule"]) o.schedule = diffusion::parse_schedule(n["schedule"].as<std::string>());
      if (n["beta_start"]) o.beta_start = n["beta_start"].as<double>();
      if (n["beta_end"]) o.beta_end = n["beta_end"].as<double>();
      if (n["timesteps"]) o.timesteps = n["timesteps"].as<int64_t>();
      if (n["prediction"]) o.prediction = diffusion::parse_prediction(n["prediction"].as<std::string>());
      if (n["noise_offset"]) o.noise_offset = n["noise_offset"].as<double>();
      if (n["x_key"]) o.x_key = n["x_key"].as<std::string>();
    }
    diffusion::NoiseSchedule::make(o.schedule, o.beta_start, o.beta_end, o.timesteps);  // checks the values now
    def.loss = [o](ModelState& model, const TensorMap& batch) { return diffusion::loss(model, batch, o); };
  }
  return def;
}

TensorMap merge_batches(const TensorMap& batch, const TensorMap& extra) {
  TensorMap out = batch;
  for (const auto& [k, t] : extra) {
    if (out.count(k))
      throw std::runtime_error("the batch and the cond input both have '" + k +
                               "' (rename one: the objective would not know which to use)");
    out[k] = t;
  }
  return out;
}

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

FwdBwdResult forward_backward(ModelState& model, const TensorMap& given, Objective objective,
                              const FwdBwdOptions& options) {
  const int64_t accumulate = options.accumulate;
  const c10::Device device = model_device(model);
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
  std::mutex mu;  // hooks may run on autograd's device threads (CUDA)
  std::vector<char> used(n, 0), reported(n, 0);
  bool last = false;  // in the last micro-batch's backward
  std::optional<GradHooks::Armed> armed;
  if (track)
    armed.emplace(*hooks, [&](int i) {
      std::lock_guard<std::mutex> l(mu);
      const size_t k = static_cast<size_t>(i);
      used[k] = 1;
      if (last && options.on_ready && !reported[k]) {
        reported[k] = 1;
        options.on_ready(i, true);
      }
    });

  if (options.buffer) {
    // Zeroed grads that autograd adds into in place (AccumulateGrad: grad += new, grad mode
    // being off in backward); 0 + g is g exactly, so the result equals the fresh-tensor path.
    options.buffer->zero();
    options.buffer->attach(params);
  } else {
    // Fresh grads each step (like zero_grad(set_to_none=True)): the previous step's grads,
    // still held by their consumers, are never overwritten.
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
  }

  torch::AutoGradMode grad_on(true);
  const int64_t total = batch_rows(batch);
  std::vector<TensorMap> parts =
      accumulate == 1 ? std::vector<TensorMap>{batch} : split_batch(batch, accumulate);
  torch::Tensor loss_sum;
  for (size_t i = 0; i < parts.size(); ++i) {
    const TensorMap& part = parts[i];
    const double w = static_cast<double>(batch_rows(part)) / static_cast<double>(total);
    torch::Tensor loss;
    {
      std::optional<TrainingScope> training;
      if (options.dropout_seed) training.emplace(mix_seed({*options.dropout_seed, static_cast<uint64_t>(i)}));
      AutocastScope autocast(options.precision, device);
      loss = objective(model, part);
    }
    if (loss.dim() != 0) throw std::runtime_error("the objective returned a non-scalar loss");
    if (!loss.requires_grad()) throw std::runtime_error("the loss does not depend on any trainable parameter");
    {
      std::lock_guard<std::mutex> l(mu);
      last = i + 1 == parts.size();
    }
    (loss * w).backward();
    torch::Tensor l = loss.detach() * w;
    loss_sum = loss_sum.defined() ? loss_sum + l : l;
  }
  armed.reset();
  // The parameters backward did not reach in the last micro-batch, in reverse module order
  // (the buffer's order): all at once, now that backward is over.
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

class ForwardBackwardNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const std::string name = ctx.params().get<std::string>("objective");
    try {
      objective_ = make_objective_def(name, ctx.params().node());
    } catch (const std::exception& e) {
      throw std::runtime_error(ctx.who() + ": " + e.what());
    }
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
    rank_ = ctx.run().rank;
  }

  void run(StepContext& ctx) override {
    const TensorMap& in_batch = ctx.in<TensorMap>("batch");
    const TensorMap batch = has_cond_ ? merge_batches(in_batch, ctx.in<TensorMap>("cond")) : in_batch;
    ModelState& model = ctx.state_as<ModelState>("model");
    // Dropout masks of step s depend only on (run seed, s, rank): reproducible and resumable.
    FwdBwdOptions o = options_;
    o.dropout_seed = mix_seed({seed_, kSeedTagDropout, static_cast<uint64_t>(ctx.step()), static_cast<uint64_t>(rank_)});

    const std::vector<torch::Tensor> params = model.trainable_parameters();
    if (!hooks_ || !hooks_->covers(params)) {
      // First step, or the model's parameter tensors changed: new hooks, new buffers.
      hooks_.reset();
      pool_.clear();
      if (!params.empty()) hooks_ = std::make_shared<GradHooks>(params);
    }
    o.hooks = hooks_;
    o.buffer = params.empty() ? nullptr : take_buffer(params);
    // Each parameter once, as its gradient becomes final: allreduce reduces buckets meanwhile.
    // With one process there is nothing to reduce during backward: all of them after it, in
    // the buffer's order, rather than waking a worker for each parameter while backward runs.
    const int count = static_cast<int>(params.size());
    const bool overlap = ctx.run().world > 1;
    int index = 0;
    if (overlap)
      o.on_ready = [&ctx, &index, count, buffer = o.buffer](int param, bool used) {
        ctx.emit("ready", GradReady{param, used, buffer}, index++, count);
      };
    FwdBwdResult r = forward_backward(model, batch, objective_.loss, o);
    if (!overlap)
      for (int k = count; k-- > 0;) ctx.emit("ready", GradReady{k, r.grads[static_cast<size_t>(k)].defined(), o.buffer}, index++, count);
    ctx.out("loss", r.loss);
    ctx.out("grads", std::move(r.grads));
    ctx.out("tokens", objective_.targets(batch));
  }

 private:
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
    std::shared_ptr<GradBuffer> b = GradBuffer::make(params);
    if (pool_.size() >= kPool) pool_.erase(pool_.begin());
    pool_.push_back(b);
    return b;
  }

  static constexpr size_t kPool = 2;
  ObjectiveDef objective_{};
  bool has_cond_ = false;
  FwdBwdOptions options_;
  uint64_t seed_ = 0;
  int rank_ = 0;
  std::shared_ptr<GradHooks> hooks_;
  std::vector<std::shared_ptr<GradBuffer>> pool_;  // least recently used first
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(forward_backward, flowrun::ForwardBackwardNode)
