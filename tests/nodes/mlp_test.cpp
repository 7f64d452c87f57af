// mlp: parameter names as PyTorch's nn.Sequential, initialisation from the seed alone, forward.
#include <gtest/gtest.h>

#include <cmath>

#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

std::unique_ptr<test::GraphRun> model_graph(const std::string& with, uint64_t run_seed = 1) {
  return test::load_graph_text("flowrun: 1\nrun: { steps: 1, seed: " + std::to_string(run_seed) +
                               " }\nnodes:\n  model: { type: mlp, with: " + with + " }\n");
}

TEST(Mlp, ParameterNamesAndShapesFollowNnSequential) {
  auto g = model_graph("{ in_dim: 5, hidden: 7, layers: 2, out_dim: 3 }");
  ModelState& m = g->state<ModelState>("model", "params");
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& [k, v] : m.named_parameters()) {
    names.push_back(k);
    shapes.push_back(v.sizes().vec());
    EXPECT_TRUE(v.requires_grad()) << k;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}));
  EXPECT_EQ(shapes, (std::vector<std::vector<int64_t>>{{7, 5}, {7}, {7, 7}, {7}, {3, 7}, {3}}));
  EXPECT_EQ(m.trainable_parameters().size(), 6u);
  EXPECT_EQ(m.kind, "mlp");
}

TEST(Mlp, ZeroLayersIsALinearModel) {
  auto g = model_graph("{ in_dim: 4, layers: 0, out_dim: 2 }");
  ModelState& m = g->state<ModelState>("model", "params");
  auto p = m.tensors();
  ASSERT_EQ(p.size(), 2u);
  torch::Tensor x = torch::randn({6, 4});
  torch::Tensor y = m.forward({{"x", x}});
  EXPECT_TRUE(torch::allclose(y, torch::addmm(p.at("0.bias"), x, p.at("0.weight").t()), 1e-5, 1e-6));
}

TEST(Mlp, ForwardIsLinearActivationLinear) {
  for (const std::string act : {"relu", "gelu", "tanh"}) {
    auto g = model_graph("{ in_dim: 4, hidden: 6, layers: 1, out_dim: 2, activation: " + act + " }");
    ModelState& m = g->state<ModelState>("model", "params");
    auto p = m.tensors();
    torch::Tensor x = torch::randn({5, 4});
    torch::Tensor h = torch::addmm(p.at("0.bias"), x, p.at("0.weight").t());
    h = act == "relu" ? torch::relu(h) : act == "gelu" ? torch::gelu(h) : torch::tanh(h);
    torch::Tensor want = torch::addmm(p.at("2.bias"), h, p.at("2.weight").t());
    torch::Tensor got = m.forward({{"x", x}});
    EXPECT_EQ(got.sizes(), (std::vector<int64_t>{5, 2}));
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << act;
  }
}

TEST(Mlp, InitDependsOnTheSeedOnly) {
  const std::string with = "{ in_dim: 5, hidden: 9, layers: 2, out_dim: 2 }";
  const std::string with_seed = "{ in_dim: 5, hidden: 9, layers: 2, out_dim: 2, seed: 4 }";
  auto a = test::snapshot(model_graph(with, 3)->state<ModelState>("model", "params"));
  torch::manual_seed(12345);  // torch's global generator plays no part
  auto b = test::snapshot(model_graph(with, 3)->state<ModelState>("model", "params"));
  auto c = test::snapshot(model_graph(with, 4)->state<ModelState>("model", "params"));
  auto d = test::snapshot(model_graph(with_seed, 3)->state<ModelState>("model", "params"));
  for (const auto& [k, v] : a) {
    EXPECT_TRUE(torch::equal(v, b.at(k))) << k;
    EXPECT_FALSE(torch::equal(v, c.at(k))) << k;
    EXPECT_TRUE(torch::equal(c.at(k), d.at(k))) << k << ": with.seed 4 is run.seed 4";
  }
}

TEST(Mlp, InitIsPyTorchsLinearDefault) {
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases: inside the bound and spread over it.
  auto g = model_graph("{ in_dim: 100, hidden: 400, layers: 1, out_dim: 50 }");
  auto p = g->state<ModelState>("model", "params").tensors();
  for (const auto& [name, fan_in] : std::vector<std::pair<std::string, int>>{{"0", 100}, {"2", 400}}) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    for (const char* part : {".weight", ".bias"}) {
      torch::Tensor t = p.at(name + part);
      EXPECT_LE(t.abs().max().item<double>(), bound) << name << part;
      EXPECT_GT(t.abs().max().item<double>(), 0.9 * bound) << name << part;
    }
    // Uniform on [-b, b] has standard deviation b / sqrt(3).
    EXPECT_NEAR(p.at(name + ".weight").std().item<double>(), bound / std::sqrt(3.0), 0.05 * bound);
  }
}

}  // namespace
}  // namespace flowrun
