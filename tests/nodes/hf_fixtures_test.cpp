// Parity with the reference libraries on files they wrote themselves: tests/fixtures/hf/ holds a
// tiny HunyuanDiT2DModel (8 shards and an index) and AutoencoderKL saved by diffusers v0.30.3's
// save_pretrained, and their outputs for fixed inputs (tests/fixtures/hf/make_fixtures.py).
// flowrun loads each folder by `pretrained:`, as a user's graph does, and must give the same
// outputs: the DiT with the pipeline's RoPE positions (rope_base_grid 32, the default), both
// text streams with padded prompts, size/style conditioning and the learned-sigma channels;
// the VAE's posterior and its decoder.
#include <gtest/gtest.h>

#include <cstdio>

#include "common/safetensors.hpp"
#include "models/dit.hpp"
#include "models/model_state.hpp"
#include "models/vae.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

const std::string kFixtures = std::string(FLOWRUN_SOURCE_DIR) + "/tests/fixtures/hf";

const safetensors::Tensors& reference() {
  static const safetensors::Tensors r = safetensors::load(kFixtures + "/reference.safetensors").tensors;
  return r;
}
const torch::Tensor& ref(const std::string& name) { return reference().at(name); }

// ||a - b|| / ||b||, the measure the parity bar (1e-5) is stated in.
double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a.to(torch::kDouble) - b.to(torch::kDouble)).norm() / b.to(torch::kDouble).norm()).item<double>();
}

// The fixture's DiT through the dit node (`more`: extra parameters), on the stored inputs.
torch::Tensor dit_output(const std::string& more = "") {
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: dit, with: { pretrained: '" +
                                 kFixtures + "/hunyuandit'" + more + " } }\n");
  auto dit = std::dynamic_pointer_cast<dit::DitImpl>(g->state<ModelState>("model", "params").module);
  EXPECT_TRUE(dit);
  dit->eval();
  dit::DitImpl::Inputs in;
  in.x = ref("dit.x");
  in.t = ref("dit.t");
  in.text = ref("dit.text");
  in.text_mask = ref("dit.text_mask").to(torch::kLong);
  in.t5 = ref("dit.t5");
  in.t5_mask = ref("dit.t5_mask").to(torch::kLong);
  in.image_meta_size = ref("dit.image_meta_size");
  in.style = ref("dit.style").to(torch::kLong);
  torch::NoGradGuard ng;
  return dit->forward(in);
}

TEST(HfFixtures, HunyuanDitFromItsShardedDiffusersFolderMatchesDiffusersForward) {
  const torch::Tensor out = dit_output();
  ASSERT_EQ(out.sizes(), ref("dit.out").sizes());  // the prediction and the variance channels
  EXPECT_LT(rel(out, ref("dit.out")), 1e-5) << rel(out, ref("dit.out"));
  std::printf("HunyuanDiT vs diffusers: %.2e relative\n", rel(out, ref("dit.out")));
  EXPECT_LT(rel(out[1], ref("dit.out")[1]), 1e-5);  // the row of the padded prompts alone
  // The bar can fail: integer RoPE positions (not the pipeline's) give another output.
  EXPECT_GT(rel(dit_output(", rope_base_grid: null"), ref("dit.out")), 1e-4);  // measured 7.3e-4
}

TEST(HfFixtures, VaeFromItsDiffusersFolderMatchesDiffusersEncodeAndDecode) {
  auto g = test::load_graph_text("flowrun: 1\nrun: { steps: 1 }\nnodes:\n  model: { type: vae, with: { pretrained: '" +
                                 kFixtures + "/vae' } }\n");
  auto& state = static_cast<vae::VaeState&>(g->state<ModelState>("model", "params"));
  EXPECT_DOUBLE_EQ(state.config.scaling_factor, 0.13025);
  vae::AutoencoderKLImpl& m = state.vae();
  m.eval();
  torch::NoGradGuard ng;
  const auto [mean, logvar] = m.encode(ref("vae.images"));
  EXPECT_LT(rel(mean, ref("vae.mean")), 1e-5);
  EXPECT_LT(rel(logvar, ref("vae.logvar")), 1e-5);
  const torch::Tensor decoded = m.decode(ref("vae.mean"));
  EXPECT_LT(rel(decoded, ref("vae.decoded")), 1e-5);
  std::printf("AutoencoderKL vs diffusers: mean %.2e, logvar %.2e, decoded %.2e relative\n", rel(mean, ref("vae.mean")),
              rel(logvar, ref("vae.logvar")), rel(decoded, ref("vae.decoded")));
}

}  // namespace
}  // namespace flowrun
