// forward_backward: loss and gradients of a model on a batch.
// Schema: schemas/forward_backward.yaml. Test: tests/nodes/forward_backward_test.cpp.
#include "train/forward_backward.hpp"

#include <map>

#include "registry.hpp"

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

const std::map<std::string, Objective>& objectives() {
  static const std::map<std::string, Objective> m = {
      {"mse", &mse},
  };
  return m;
}

}  // namespace

const Objective* find_objective(const std::string& name) {
  auto it = objectives().find(name);
  return it == objectives().end() ? nullptr : &it->second;
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

FwdBwdResult forward_backward(ModelState& model, const TensorMap& batch, Objective objective, int64_t accumulate) {
  std::vector<torch::Tensor> params = model.trainable_parameters();
  if (params.empty()) throw std::runtime_error("the model has no trainable parameters");
  // Fresh grads each step (like zero_grad(set_to_none=True)): the previous step's grads, still
  // held by their consumers, are never overwritten.
  for (auto& p : params) p.mutable_grad() = torch::Tensor();

  torch::AutoGradMode grad_on(true);
  const int64_t total = batch_rows(batch);
  std::vector<TensorMap> parts =
      accumulate == 1 ? std::vector<TensorMap>{batch} : split_batch(batch, accumulate);
  torch::Tensor loss_sum;
  for (const TensorMap& part : parts) {
    const double w = static_cast<double>(batch_rows(part)) / static_cast<double>(total);
    torch::Tensor loss = objective(model, part);
    if (loss.dim() != 0) throw std::runtime_error("the objective returned a non-scalar loss");
    if (!loss.requires_grad()) throw std::runtime_error("the loss does not depend on any trainable parameter");
    (loss * w).backward();
    torch::Tensor l = loss.detach() * w;
    loss_sum = loss_sum.defined() ? loss_sum + l : l;
  }
  FwdBwdResult r;
  r.loss = loss_sum;
  r.grads.reserve(params.size());
  for (const auto& p : params) r.grads.push_back(p.grad());
  return r;
}

namespace {

class ForwardBackwardNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const std::string name = ctx.params().get<std::string>("objective");
    const Objective* o = find_objective(name);
    if (!o) throw std::runtime_error(ctx.who() + ": unknown objective '" + name + "'");
    objective_ = *o;
    accumulate_ = ctx.params().get<int64_t>("accumulate");
  }

  void run(StepContext& ctx) override {
    const TensorMap& batch = ctx.in<TensorMap>("batch");
    ModelState& model = ctx.state_as<ModelState>("model");
    FwdBwdResult r = forward_backward(model, batch, objective_, accumulate_);
    ctx.out("loss", r.loss);
    ctx.out("grads", std::move(r.grads));
  }

 private:
  Objective objective_ = nullptr;
  int64_t accumulate_ = 1;
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(forward_backward, flowrun::ForwardBackwardNode)
