// The layers several model families share (models/layers.hpp): one LayerNorm for GPT-2's,
// the DiT's (diffusers' FP32LayerNorm) and CapPa's (flax's), told apart by its options.
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
// without it the statistics are taken in bf16's own layer norm.
TEST(Layers, Fp32LayerNormNormalizesABf16InputInFloat32) {
  torch::manual_seed(2);
  torch::Tensor x = (torch::randn({4, 64}) * 30 + 100).to(torch::kBFloat16);
  layers::LayerNorm ln(64, layers::fp32_norm());
  torch::Tensor y = ln(x);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  torch::Tensor want = torch::layer_norm(x.to(torch::kFloat), {64}, {}, {}, 1e-6).to(torch::kBFloat16);
  EXPECT_TRUE(torch::equal(y, want));
  EXPECT_FALSE(torch::equal(torch::layer_norm(x, {64}, {}, {}, 1e-6), want));  // bf16's own differs
  EXPECT_ANY_THROW(layers::LayerNorm(64)(x));  // fp32 weights on a bf16 input: torch refuses the mix
}

}  // namespace
}  // namespace flowrun
