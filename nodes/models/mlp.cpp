// mlp: a multi-layer perceptron model (owns its parameters; no per-step work).
// Schema: schemas/mlp.yaml. Test: tests/nodes/mlp_test.cpp.
#include <spdlog/fmt/fmt.h>

#include <cmath>

#include "common/device.hpp"
#include "common/memory.hpp"
#include "common/seed.hpp"
#include "models/model_state.hpp"
#include "registry.hpp"

namespace flowrun {
namespace {

torch::nn::AnyModule activation(const std::string& name) {
  if (name == "relu") return torch::nn::AnyModule(torch::nn::ReLU());
  if (name == "gelu") return torch::nn::AnyModule(torch::nn::GELU());
  if (name == "tanh") return torch::nn::AnyModule(torch::nn::Tanh());
  throw std::runtime_error("mlp: unknown activation '" + name + "'");
}

class MlpNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    const int64_t in_dim = p.get<int64_t>("in_dim"), hidden = p.get<int64_t>("hidden"),
                  layers = p.get<int64_t>("layers"), out_dim = p.get<int64_t>("out_dim");
    const std::string act = p.get<std::string>("activation");
    const uint64_t seed = p.has("seed") ? p.get<uint64_t>("seed") : ctx.run().seed;

    check_model_fits(ctx.who(), fmt::format("{} layers of {}, {} in, {} out", layers, hidden, in_dim, out_dim),
                     layers == 0 ? static_cast<double>(in_dim + 1) * out_dim
                                 : static_cast<double>(in_dim + 1) * hidden +
                                       static_cast<double>(layers - 1) * (hidden + 1) * hidden +
                                       static_cast<double>(hidden + 1) * out_dim);
    // nn.Sequential layout, so names match PyTorch's: 0.weight, 0.bias, 2.weight, ...
    torch::nn::Sequential seq;
    int64_t d = in_dim;
    for (int64_t i = 0; i < layers; ++i) {
      seq->push_back(torch::nn::Linear(d, hidden));
      seq->push_back(activation(act));
      d = hidden;
    }
    seq->push_back(torch::nn::Linear(d, out_dim));

    // PyTorch's default Linear init (weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in))),
    // drawn from a generator of our own so the result depends on `seed` only.
    {
      torch::NoGradGuard no_grad;
      at::Generator g = make_cpu_generator(mix_seed({seed, kSeedTagInit}));
      for (const auto& child : seq->children()) {
        if (auto* lin = child->as<torch::nn::LinearImpl>()) {
          const double bound = 1.0 / std::sqrt(static_cast<double>(lin->weight.size(1)));  // fan_in
          lin->weight.uniform_(-bound, bound, g);
          if (lin->bias.defined()) lin->bias.uniform_(-bound, bound, g);
        }
      }
    }

    ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
      auto it = batch.find("x");
      if (it == batch.end()) throw std::runtime_error("mlp: the batch has no 'x'");
      auto* s = m.as<torch::nn::SequentialImpl>();
      if (!s) throw std::runtime_error("mlp: the model's module is not an nn::Sequential");
      return s->forward(it->second);
    };
    seq->to(run_device(ctx.run()));  // initialised on the CPU (seeded, device-independent), then placed
    std::shared_ptr<ModelState> state =
        std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(seq.ptr()), fwd, "mlp");
    ctx.own_state("params", state);
  }

  void run(StepContext&) override {}  // parameters change only through the optimizer
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(mlp, flowrun::MlpNode)
