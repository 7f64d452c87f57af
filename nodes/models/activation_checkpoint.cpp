// Activation checkpointing (activation_checkpoint.hpp): the recompute node autograd runs in
// backward, and the policy and estimates. Test: tests/nodes/activation_checkpoint_test.cpp.
#include "models/activation_checkpoint.hpp"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "common/device.hpp"
#include "models/dropout.hpp"
#include "models/param_use.hpp"
#include "parallel/cost_model.hpp"

namespace flowrun {

namespace {

// The thread's autocast settings (CPU and GPU), to run the recompute as the forward ran.
struct AutocastState {
  bool cpu = false, gpu = false;
  at::ScalarType cpu_dtype = at::kBFloat16, gpu_dtype = at::kHalf;

  static AutocastState now() {
    AutocastState s;
    s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.gpu = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.gpu_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    return s;
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, gpu);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, gpu_dtype);
  }
};

// Autocast as in `s` for the guard's lifetime; the settings before, after. The cast cache is
// cleared on the way out, as torch.autocast's exit does at the outermost level.
class AutocastAs {
 public:
  explicit AutocastAs(const AutocastState& s) : before_(AutocastState::now()) {
    s.apply();
    on_ = s.cpu || s.gpu;
    if (on_) at::autocast::increment_nesting();
  }
  ~AutocastAs() {
    if (on_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    before_.apply();
  }
  AutocastAs(const AutocastAs&) = delete;
  AutocastAs& operator=(const AutocastAs&) = delete;

 private:
  AutocastState before_;
  bool on_ = false;
};

// The node autograd runs for a checkpointed block's output: recompute, then backpropagate.
struct RecomputeBackward : torch::autograd::Node {
  CheckpointBody body;
  std::vector<torch::Tensor> inputs;  // detached, as given to the forward
  std::vector<bool> needs_grad;       // per input
  std::optional<TrainingScope::Snapshot> scope;
  AutocastState autocast;
  std::function<void()> after_backward;  // checkpointed's

  std::string name() const override { return "flowrun::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::vector<torch::Tensor> in;
    in.reserve(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i)
      in.push_back(inputs[i].defined() && needs_grad[i] ? inputs[i].detach().requires_grad_(true) : inputs[i]);
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      std::optional<TrainingScope> again;
      if (scope) again.emplace(*scope);  // the same draws as the first run
      AutocastAs cast(autocast);
      y = body(in);
    }
    torch::autograd::variable_list out(inputs.size());
    if (grads.empty() || !grads[0].defined() || !y.requires_grad()) return out;
    // Into the leaves: the block's parameters (their .grad(), hooks and all) and the inputs' copies.
    torch::autograd::backward({y}, {grads[0]}, /*retain_graph=*/false, /*create_graph=*/false);
    for (size_t i = 0; i < in.size(); ++i)
      if (in[i].defined() && needs_grad[i]) out[i] = in[i].grad();
    if (after_backward) after_backward();
    return out;
  }

  void release_variables() override {
    inputs.clear();
    body = nullptr;
    after_backward = nullptr;
  }
};

}  // namespace

// ---- BlockClock

struct BlockClock::Record {
  std::mutex mu;
  std::vector<Span> spans;
  std::map<const torch::nn::Module*, Time> backward_started;
};

namespace {
thread_local BlockClock* g_clock = nullptr;
}  // namespace

BlockClock::BlockClock() : record_(std::make_shared<Record>()), previous_(g_clock) { g_clock = this; }
BlockClock::~BlockClock() { g_clock = previous_; }
BlockClock* BlockClock::current() { return g_clock; }

std::vector<BlockClock::Span> BlockClock::spans() const {
  std::lock_guard<std::mutex> lock(record_->mu);
  return record_->spans;
}

void BlockClock::end_backward() {
  const Time now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(record_->mu);
  for (const auto& [block, start] : record_->backward_started) record_->spans.push_back({block, true, start, now});
  record_->backward_started.clear();
}

void BlockClock::forward(const torch::nn::Module* block, Time start, Time end) {
  std::lock_guard<std::mutex> lock(record_->mu);
  record_->spans.push_back({block, false, start, end});
}

void BlockClock::hook_backward(const torch::nn::Module* block, const torch::Tensor& input, const torch::Tensor& output) {
  if (!output.defined() || !output.requires_grad()) return;
  std::shared_ptr<Record> r = record_;
  // On a GPU the host clock sees launches: each mark waits for the device first (a profile's cost).
  const c10::Device device = output.device();
  torch::Tensor(output).register_hook([r, block, device](const torch::Tensor&) {
    synchronize_device(device);
    std::lock_guard<std::mutex> lock(r->mu);
    r->backward_started[block] = std::chrono::steady_clock::now();
  });
  if (!input.defined() || !input.requires_grad()) return;
  torch::Tensor(input).register_hook([r, block, device](const torch::Tensor&) {
    synchronize_device(device);
    const Time now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(r->mu);
    auto it = r->backward_started.find(block);
    if (it == r->backward_started.end()) return;
    r->spans.push_back({block, true, it->second, now});
    r->backward_started.erase(it);
  });
}

std::vector<const torch::nn::Module*> blocks_of(const torch::nn::Module& model) {
  std::vector<const torch::nn::Module*> out;
  for (const auto& child : model.children()) {
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(child.get())) {
      for (const auto& item : child->children()) out.push_back(item.get());
    } else {
      for (const torch::nn::Module* b : blocks_of(*child)) out.push_back(b);
    }
  }
  return out;
}

// ---- run_block

torch::Tensor run_block(const CheckpointPolicy& policy, int64_t index, const torch::nn::Module& block,
                        const std::vector<torch::Tensor>& inputs, const CheckpointBody& body) {
  if (BlockClock* const clock = BlockClock::current()) {
    // Timed: the same run with the clock set aside meanwhile (a block's own run_block calls, none
    // today, are not timed twice), then its forward noted and its backward hooked.
    struct Aside {
      BlockClock* clock;
      ~Aside() { g_clock = clock; }
    } aside{clock};
    g_clock = nullptr;
    const c10::Device device = inputs.empty() || !inputs[0].defined() ? c10::Device(c10::kCPU) : inputs[0].device();
    synchronize_device(device);  // a GPU's clock: the block's kernels alone (a no-op on the CPU)
    const auto start = std::chrono::steady_clock::now();
    const torch::Tensor y = run_block(policy, index, block, inputs, body);
    synchronize_device(device);
    clock->forward(&block, start, std::chrono::steady_clock::now());
    if (torch::GradMode::is_enabled()) clock->hook_backward(&block, inputs.empty() ? torch::Tensor() : inputs[0], y);
    return y;
  }
  const bool recompute = policy.recompute(index);
  ParamUse* use = ParamUse::current();
  if (!use) return recompute ? checkpointed(inputs, body) : body(inputs);
  use->gather(block, /*recompute=*/false);
  // A recomputed block is gathered again in backward (its forward let the parameters go); the
  // ParamUse outlives the backward that runs the recompute. (The body's first run, in forward,
  // finds the block gathered already.)
  const torch::Tensor y = recompute ? checkpointed(
                                          inputs,
                                          [use, &block, body](const std::vector<torch::Tensor>& in) {
                                            use->gather(block, /*recompute=*/true);
                                            return body(in);
                                          },
                                          [use, &block] { use->backward_done(block); })
                                    : body(inputs);
  use->after_forward(block, /*kept=*/!recompute && torch::GradMode::is_enabled());
  return y;
}

torch::Tensor checkpointed(const std::vector<torch::Tensor>& inputs, CheckpointBody body,
                           std::function<void()> after_backward) {
  std::vector<bool> needs(inputs.size(), false);
  for (size_t i = 0; i < inputs.size(); ++i) needs[i] = inputs[i].defined() && inputs[i].requires_grad();
  // Parameters need gradients even when the inputs do not (the first block's input is data):
  // record the node whenever autograd records anything.
  if (!torch::GradMode::is_enabled()) return body(inputs);
  auto node = std::shared_ptr<RecomputeBackward>(new RecomputeBackward(), torch::autograd::deleteNode);
  node->needs_grad = needs;
  node->autocast = AutocastState::now();
  TrainingScope::Snapshot snap;
  if (TrainingScope::snapshot(snap)) node->scope = snap;
  torch::Tensor y;
  {
    torch::NoGradGuard no_grad;
    y = body(inputs);
  }
  if (!y.defined()) throw std::logic_error("checkpointed: the block returned no tensor");
  if (y.is_floating_point()) {
    // A fresh tensor for the node to own (a block that returns one of its inputs as it is).
    for (const auto& t : inputs)
      if (t.defined() && y.is_same(t)) y = y.clone();
    node->inputs.reserve(inputs.size());
    for (const auto& t : inputs) node->inputs.push_back(t.defined() ? t.detach() : t);
    node->body = std::move(body);
    node->after_backward = std::move(after_backward);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    torch::autograd::set_history(y, node);
  }
  return y;
}

CheckpointPolicy CheckpointPolicy::parse(const std::string& v) {
  CheckpointPolicy p;
  if (v == "none") return p;
  if (v == "blocks") {
    p.every = 1;
    return p;
  }
  if (v.rfind("every_", 0) == 0) {
    try {
      size_t used = 0;
      const int n = std::stoi(v.substr(6), &used);
      if (used == v.size() - 6 && n >= 1) {
        p.every = n;
        return p;
      }
    } catch (const std::exception&) {
    }
  }
  throw std::invalid_argument("checkpoint: '" + v + "' is not none, blocks or every_N (N >= 1: recompute blocks 0, N, 2N, ...)");
}

std::string CheckpointPolicy::str() const {
  if (every == 0) return "none";
  if (every == 1) return "blocks";
  return "every_" + std::to_string(every);
}

ActivationEstimate estimate_activations(int64_t blocks, int64_t tokens, int64_t dim, int64_t heads, int64_t seq,
                                        int64_t bytes, const CheckpointPolicy& policy, AttentionKeeps keeps, int64_t tp,
                                        const BlockUnits& block) {
  // Korthikanti et al.: s b h (34 + 5 a s / h) bytes per layer with 2-byte activations; the CPU's
  // fused attention keeps 2 of the 5 (its probabilities), a GPU's fused one no scores but one fp32
  // logsumexp per head and token.
  const double h_tokens = static_cast<double>(heads) * static_cast<double>(tokens) / static_cast<double>(tp);  // this rank's heads
  const double units = keeps == AttentionKeeps::scores ? 5.0 : 2.0;
  const double per_token = block.whole + block.split / static_cast<double>(tp);  // GPT's: 34 at tp 1, 24 of them split
  const double per_block = per_token * static_cast<double>(tokens) * static_cast<double>(dim) * static_cast<double>(bytes) / 2.0 +
                           (keeps == AttentionKeeps::logsumexp
                                ? 4.0 * h_tokens
                                : units * h_tokens * static_cast<double>(seq) * static_cast<double>(bytes) / 2.0);
  const double input = static_cast<double>(tokens) * static_cast<double>(dim) * static_cast<double>(bytes);
  ActivationEstimate e;
  e.plain = static_cast<double>(blocks) * per_block;
  int64_t recomputed = 0;
  for (int64_t b = 0; b < blocks; ++b) recomputed += policy.recompute(b) ? 1 : 0;
  e.recompute_live = recomputed > 0 ? per_block : 0.0;
  e.checkpointed = static_cast<double>(blocks - recomputed) * per_block + static_cast<double>(recomputed) * input +
                   e.recompute_live;
  if (keeps == AttentionKeeps::probabilities) {  // and one block's fp32 gradient of them in its backward
    const double grads = h_tokens * static_cast<double>(seq) * 4.0;
    e.plain += grads;
    e.checkpointed += grads;
  }
  e.block_tokens.assign(static_cast<size_t>(blocks), static_cast<double>(tokens));
  e.attention_flops = 12.0 * static_cast<double>(blocks) * static_cast<double>(tokens) * static_cast<double>(seq) *
                      static_cast<double>(dim) / static_cast<double>(tp);
  return e;
}

ActivationEstimate& ActivationEstimate::then(const ActivationEstimate& next) {
  plain += next.plain;
  checkpointed += next.checkpointed;
  recompute_live = std::max(recompute_live, next.recompute_live);
  block_tokens.insert(block_tokens.end(), next.block_tokens.begin(), next.block_tokens.end());
  attention_flops += next.attention_flops;
  return *this;
}

}  // namespace flowrun
