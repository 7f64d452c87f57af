// The layers several model families share (models/layers.hpp): one LayerNorm for GPT-2's,
// the DiT's (diffusers' FP32LayerNorm), CapPa's (flax's) and BERT's, told apart by its options;
// T5's RMS norm; one MLP whose projections carry each family's names; one patch embedding.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/layers.hpp"

namespace flowrun {
namespace {

std::vector<std::string> names(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

TEST(Layers, LayerNormIsTorchsWithTheParametersTheOptionsAsk) {
  torch::manual_seed(1);
  layers::LayerNorm gpt(8);  // GPT-2's: eps 1e-5, weight and bias
  EXPECT_EQ(names(*gpt), (std::vector<std::string>{"weight", "bias"}));
  torch::nn::LayerNorm ref(torch::nn::LayerNormOptions({8}).eps(1e-5));
  torch::Tensor x = torch::randn({3, 8}) * 4 + 1;
  EXPECT_TRUE(torch::allclose(gpt(x), ref(x)));
  layers::LayerNorm plain(8, layers::fp32_norm(/*affine=*/false));  // the DiT's norm_out: no parameters
  EXPECT_TRUE(names(*plain).empty());
  layers::LayerNorm no_bias(8, layers::NormOptions{1e-6, true, false, false});  // CapPa's decoder without biases
  EXPECT_EQ(names(*no_bias), (std::vector<std::string>{"weight"}));
  EXPECT_THROW(layers::LayerNorm(8, layers::NormOptions{1e-6, false, true, false}), std::logic_error);
}

// fp32: a bf16 input is normalized in float32 and cast back once, as diffusers' FP32LayerNorm;
// without it, the layer calls torch's layer norm on the bf16 input with its float32 weights
// (torch's mixed-dtype kernel). What each of torch's kernels rounds to is torch's business (its
// bf16 kernel computes in float32 too on some CPU paths, ATEN_CPU_CAPABILITY=default): the test
// checks which computation the layer asks for, not how they differ.
TEST(Layers, Fp32LayerNormNormalizesABf16InputInFloat32) {
  torch::manual_seed(2);
  torch::Tensor x = (torch::randn({4, 64}) * 30 + 100).to(torch::kBFloat16);
  layers::LayerNorm ln(64, layers::fp32_norm());
  torch::Tensor y = ln(x);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  torch::Tensor want = torch::layer_norm(x.to(torch::kFloat), {64}, ln->weight, ln->bias, 1e-6).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, want));
  layers::LayerNorm plain(64);
  torch::Tensor mixed = torch::layer_norm(x, {64}, plain->weight, plain->bias, 1e-5);
  EXPECT_EQ(mixed.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(plain(x), mixed));
}

TEST(Layers, RmsNormScalesByTheRootMeanSquareWithoutAMean) {
  torch::manual_seed(3);
  layers::RmsNorm norm(8, 1e-6);
  EXPECT_EQ(names(*norm), (std::vector<std::string>{"weight"}));
  torch::NoGradGuard no_grad;
  norm->weight.copy_(torch::arange(1, 9, torch::kFloat));
  torch::Tensor x = torch::randn({3, 8}) + 5;  // a mean far from 0: a layer norm would remove it
  torch::Tensor want = x / (x.pow(2).mean(-1, true) + 1e-6).sqrt() * torch::arange(1, 9, torch::kFloat);
  EXPECT_TRUE(torch::allclose(norm(x), want, 1e-6, 1e-6));
}

// Each family's MLP is the shared one with its own names, so HF / diffusers / timm state dicts
// load as before: the parameters sit where the names say, in the order the family registers them.
TEST(Layers, MlpParametersCarryTheFamilysNamesAndNestAtDottedPaths) {
  layers::Mlp gpt(4, 16, layers::MlpOptions{"c_fc", "c_proj", layers::Act::gelu_tanh, "", true, /*fan_in_fan_out=*/true});
  EXPECT_EQ(names(*gpt), (std::vector<std::string>{"c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"}));
  EXPECT_EQ(gpt->fc1->weight.sizes(), torch::IntArrayRef({4, 16}));  // HF Conv1D: [in, out]
  layers::Mlp dit(4, 16, layers::MlpOptions{"net.0.proj", "net.2", layers::Act::gelu_tanh});
  EXPECT_EQ(names(*dit), (std::vector<std::string>{"net.0.proj.weight", "net.0.proj.bias", "net.2.weight", "net.2.bias"}));
  EXPECT_EQ(dit->fc1->weight.sizes(), torch::IntArrayRef({16, 4}));
  layers::Mlp t5(4, 16, layers::MlpOptions{"wi_0", "wo", layers::Act::gelu_tanh, "wi_1", /*bias=*/false});
  EXPECT_EQ(names(*t5), (std::vector<std::string>{"wi_0.weight", "wi_1.weight", "wo.weight"}));
  EXPECT_THROW((layers::Mlp(4, 16, layers::MlpOptions{"net..proj", "net.2"})), std::logic_error);
}

TEST(Layers, MlpComputesFc2OfTheActivatedFc1AndGatedTimesTheGate) {
  torch::manual_seed(4);
  torch::Tensor x = torch::randn({2, 3, 4});
  auto fill = [](torch::nn::Module& m) {
    torch::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.copy_(torch::randn(p.sizes()));
  };
  layers::Mlp plain(4, 16, layers::MlpOptions{"fc1", "fc2", layers::Act::gelu});
  fill(*plain);
  namespace F = torch::nn::functional;
  auto lin = [](const torch::Tensor& v, const lora::Linear& l) { return F::linear(v, l->weight, l->bias); };
  EXPECT_TRUE(torch::allclose(plain(x), lin(torch::gelu(lin(x, plain->fc1)), plain->fc2), 1e-5, 1e-5));
  layers::Mlp conv1d(4, 16, layers::MlpOptions{"c_fc", "c_proj", layers::Act::gelu_tanh, "", true, true});
  fill(*conv1d);
  auto c1d = [](const torch::Tensor& v, const lora::Linear& l) { return torch::matmul(v, l->weight) + l->bias; };
  EXPECT_TRUE(torch::allclose(conv1d(x), c1d(torch::gelu(c1d(x, conv1d->fc1), "tanh"), conv1d->fc2), 1e-5, 1e-5));
  layers::Mlp gated(4, 16, layers::MlpOptions{"wi_0", "wo", layers::Act::gelu_tanh, "wi_1", false});
  fill(*gated);
  torch::Tensor want = lin(torch::gelu(lin(x, gated->fc1), "tanh") * lin(x, gated->gate), gated->fc2);
  EXPECT_TRUE(torch::allclose(gated(x), want, 1e-5, 1e-5));
  layers::Mlp relu(4, 16, layers::MlpOptions{"wi", "wo", layers::Act::relu, "", false});
  fill(*relu);
  EXPECT_TRUE(torch::allclose(relu(x), lin(torch::relu(lin(x, relu->fc1)), relu->fc2), 1e-5, 1e-5));
  layers::MlpOptions narrow{"linear_1", "linear_2", layers::Act::silu};  // diffusers' TimestepEmbedding: 4 -> 16 -> 6
  narrow.out = 6;
  layers::Mlp silu(4, 16, narrow);
  fill(*silu);
  EXPECT_EQ(silu->fc2->weight.sizes(), torch::IntArrayRef({6, 16}));
  EXPECT_TRUE(torch::allclose(silu(x), lin(torch::silu(lin(x, silu->fc1)), silu->fc2), 1e-5, 1e-5));
}

// A model's copy (the EMA's, a clone for another device) computes with its own parameters, also
// where the projections sit at dotted paths, whose levels torch's Cloneable cannot rebuild itself.
TEST(Layers, AClonedMlpComputesWithItsOwnParametersAtNestedPaths) {
  torch::manual_seed(5);
  layers::Mlp ff(4, 8, layers::MlpOptions{"net.0.proj", "net.2", layers::Act::gelu_tanh});
  torch::NoGradGuard no_grad;
  for (auto& p : ff->parameters()) p.copy_(torch::randn(p.sizes()));
  auto copy = std::dynamic_pointer_cast<layers::MlpImpl>(ff->clone());
  ASSERT_TRUE(copy);
  torch::Tensor x = torch::randn({5, 4});
  EXPECT_TRUE(torch::equal(copy->forward(x), ff(x)));
  EXPECT_EQ(names(*copy), names(*ff));
  for (auto& p : copy->parameters()) p.mul_(2);  // the copy's own tensors: the original is untouched
  EXPECT_FALSE(torch::equal(copy->forward(x), ff(x)));
  EXPECT_TRUE(torch::equal(copy->fc1->weight, copy->named_parameters()["net.0.proj.weight"]));
  EXPECT_TRUE(torch::equal(copy->fc1->weight, ff->fc1->weight * 2));
  // Inside a parent module, cloned through the parent (the path a model's clone takes).
  struct Parent : torch::nn::Cloneable<Parent> {
    void reset() override { ff = register_module("ff", layers::Mlp(4, 8, layers::MlpOptions{"net.0.proj", "net.2", layers::Act::gelu_tanh})); }
    layers::Mlp ff{nullptr};
  };
  auto parent = std::make_shared<Parent>();
  parent->reset();
  for (auto& p : parent->parameters()) p.copy_(torch::randn(p.sizes()));
  auto parent_copy = std::dynamic_pointer_cast<Parent>(parent->clone());
  EXPECT_TRUE(torch::equal(parent_copy->ff(x), parent->ff(x)));
  for (auto& p : parent_copy->parameters()) p.zero_();
  EXPECT_TRUE(torch::equal(parent_copy->ff(x), torch::zeros({5, 4})));  // the pointers reach the copy's zeros
}

// Tokens in row-major patch order: token (i, j) of the grid is the conv of the patch at rows
// i*p.., columns j*p...
TEST(Layers, PatchEmbedTurnsImagesIntoRowMajorPatchTokens) {
  torch::manual_seed(6);
  layers::PatchEmbed embed(3, 8, 2);
  EXPECT_EQ(names(*embed), (std::vector<std::string>{"proj.weight", "proj.bias"}));
  torch::NoGradGuard no_grad;
  embed->proj->weight.copy_(torch::randn({8, 3, 2, 2}));
  embed->proj->bias.copy_(torch::randn({8}));
  torch::Tensor images = torch::randn({2, 3, 4, 6});
  torch::Tensor tokens = embed(images);
  ASSERT_EQ(tokens.sizes(), torch::IntArrayRef({2, 6, 8}));  // a 2 x 3 grid
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j) {
      torch::Tensor patch = images.narrow(2, 2 * i, 2).narrow(3, 2 * j, 2).reshape({2, 12});
      torch::Tensor want = torch::matmul(patch, embed->proj->weight.reshape({8, 12}).t()) + embed->proj->bias;
      EXPECT_TRUE(torch::allclose(tokens.select(1, 3 * i + j), want, 1e-5, 1e-5)) << "patch " << i << "," << j;
    }
}

}  // namespace
}  // namespace flowrun
