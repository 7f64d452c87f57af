// The trainable VAE: vae_loss (reconstruction + KL, train/losses.hpp) written out by hand on a
// tiny AutoencoderKL, in evaluation (the posterior mean) and in training (a sample drawn from
// the TrainingScope's generator); vae_recon's figures (ReconSums, reconstruct); the trainable
// VaeState and its copies. graphs/vae.yaml end to end: graph_vae_test.cpp.
#include <gtest/gtest.h>

#include <cmath>

#include "common/seed.hpp"
#include "eval/vae_recon.hpp"
#include "models/dropout.hpp"
#include "models/vae/vae.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace {

vae::Config tiny_vae() {
  vae::Config c;
  c.block_out_channels = {8, 16};  // factor 2
  c.layers_per_block = 1;
  c.norm_num_groups = 4;
  c.latent_channels = 2;
  return c;
}

std::shared_ptr<vae::VaeState> trainable(uint64_t seed) {
  return vae::make_vae_state(vae::make_autoencoder(tiny_vae(), vae::Part::both, "", seed), /*frozen=*/false);
}

torch::Tensor images(int64_t b, uint64_t seed) {
  at::Generator g = make_cpu_generator(seed);
  return torch::rand({b, 3, 8, 8}, g) * 2 - 1;
}

// loss = mean |x - decode(z)| (or squared) + w * mean_b 0.5 sum(mean^2 + exp(logvar) - 1 - logvar) / (C H W)
double by_hand(vae::AutoencoderKLImpl& m, const torch::Tensor& x, const torch::Tensor& eps, double w, bool l1) {
  torch::NoGradGuard no_grad;
  auto [mean, logvar] = m.encode(x);
  const torch::Tensor z = eps.defined() ? mean + torch::exp(0.5 * logvar) * eps : mean;
  const torch::Tensor d = m.decode(z) - x;
  const double rec = l1 ? d.abs().mean().item<double>() : d.pow(2).mean().item<double>();
  double kl = 0;
  for (int64_t b = 0; b < x.size(0); ++b)
    kl += 0.5 * (mean[b].pow(2) + logvar[b].exp() - 1 - logvar[b]).sum().item<double>() / static_cast<double>(x.size(0));
  return rec + w * kl / (3.0 * 8 * 8);
}

TEST(VaeLoss, OutsideTrainingIsTheMeansReconstructionErrorPlusKlWeightTimesKlPerPixel) {
  auto s = trainable(1);
  const torch::Tensor x = images(3, 2);
  for (bool l1 : {true, false}) {
    VaeLoss::Options o;
    o.kl_weight = 0.5;  // large, so the KL term shows
    o.l1 = l1;
    const VaeLoss loss(o);
    const double got = loss.loss(*s, {{"image", x}}).item<double>();
    EXPECT_NEAR(got, by_hand(s->vae(), x, {}, 0.5, l1), 1e-5) << (l1 ? "l1" : "mse");
    EXPECT_EQ(loss.loss(*s, {{"image", x}}).item<double>(), got);  // no draw: deterministic
  }
  const VaeLoss loss(VaeLoss::Options{});
  EXPECT_EQ(loss.targets({{"image", x}}), 3);
  EXPECT_EQ(loss.needs(), std::vector<std::string>{"image"});
  EXPECT_EQ(loss.type, "vae_loss");
}

TEST(VaeLoss, InTrainingDecodesAPosteriorSampleDrawnFromTheScopesGeneratorAndTrainsEveryParameter) {
  auto s = trainable(3);
  const torch::Tensor x = images(2, 4);
  VaeLoss::Options o;
  o.kl_weight = 0.5;
  const VaeLoss loss(o);
  torch::Tensor got;
  {
    TrainingScope scope(77);
    got = loss.loss(*s, {{"image", x}});
  }
  // eps: the first draw of a generator seeded as the scope's, shaped as the latents [2, 2, 4, 4].
  at::Generator g = make_cpu_generator(77);
  const torch::Tensor eps = torch::randn({2, 2, 4, 4}, g);
  EXPECT_NEAR(got.item<double>(), by_hand(s->vae(), x, eps, 0.5, true), 1e-5);
  EXPECT_GT(std::abs(got.item<double>() - by_hand(s->vae(), x, {}, 0.5, true)), 1e-4);  // not the mean's

  got.backward();
  for (const auto& [name, p] : s->named_parameters()) {
    ASSERT_TRUE(p.requires_grad()) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
  }
  // sample: false decodes the mean, in training too.
  o.sample = false;
  TrainingScope scope(77);
  EXPECT_NEAR(VaeLoss(o).loss(*s, {{"image", x}}).item<double>(), by_hand(s->vae(), x, {}, 0.5, true), 1e-5);
}

TEST(VaeLoss, RefusesAModelThatIsNotAWholeAutoencoderAndImagesOfTheWrongShape) {
  const VaeLoss loss(VaeLoss::Options{});
  auto encoder_only = vae::make_vae_state(vae::make_autoencoder(tiny_vae(), vae::Part::encoder, "", 1));
  try {
    loss.loss(*encoder_only, {{"image", images(1, 1)}});
    FAIL() << "an encoder-only VAE trained";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not an AutoencoderKL with encoder and decoder"), std::string::npos) << e.what();
  }
  auto s = trainable(1);
  try {
    loss.loss(*s, {{"image", torch::zeros({1, 3, 7, 8})}});
    FAIL() << "7 rows are not a multiple of the factor 2";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[1, 3, 7, 8]"), std::string::npos) << e.what();
  }
}

TEST(VaeState, ATrainableCopyKeepsEveryParameterTrainableAndAFrozenOneNone) {
  auto s = trainable(5);
  auto copy = std::dynamic_pointer_cast<vae::VaeState>(s->clone());
  ASSERT_TRUE(copy);  // still a VaeState: config and part travel with it
  EXPECT_FALSE(copy->frozen);
  EXPECT_EQ(copy->trainable_parameters().size(), s->trainable_parameters().size());
  EXPECT_EQ(copy->config.block_out_channels, tiny_vae().block_out_channels);
  const auto a = s->named_parameters(), b = copy->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
    EXPECT_NE(a[i].second.data_ptr(), b[i].second.data_ptr()) << a[i].first;  // its own tensors
  }
  auto frozen = vae::make_vae_state(vae::make_autoencoder(tiny_vae(), vae::Part::both, "", 5));
  EXPECT_TRUE(frozen->clone()->trainable_parameters().empty());
}

TEST(VaeRecon, ReconstructsThePosteriorMeanAndSumsItsErrorsAndLatentMoments) {
  auto s = trainable(2);
  const torch::Tensor x = images(2, 9);
  ReconSums sums;
  const torch::Tensor rec = reconstruct(*s, x, sums);
  torch::NoGradGuard no_grad;
  const torch::Tensor mean = s->vae().encode(x).first;
  EXPECT_TRUE(torch::allclose(rec, s->vae().decode(mean), 1e-6, 1e-6));
  const torch::Tensor d = rec - x;
  EXPECT_EQ(sums.pixels, 2.0 * 3 * 8 * 8);
  EXPECT_EQ(sums.latents, 2.0 * 2 * 4 * 4);
  EXPECT_NEAR(sums.l1(), d.abs().mean().item<double>(), 1e-6);
  EXPECT_NEAR(sums.psnr(), 10 * std::log10(4.0 / d.pow(2).mean().item<double>()), 1e-4);
  EXPECT_NEAR(sums.latent_std(), mean.std(/*unbiased=*/false).item<double>(), 1e-5);

  // The figures are of the sums: a second pass adds to them.
  ReconSums two = sums;
  reconstruct(*s, x, two);
  EXPECT_EQ(two.pixels, 2 * sums.pixels);
  EXPECT_NEAR(two.l1(), sums.l1(), 1e-9);
  // PSNR of a known error: every value off by 0.2 -> mse 0.04 -> 10 log10(4 / 0.04) = 20 dB.
  const ReconSums known{0.2 * 100, 0.04 * 100, 100, 0, 1, 1};
  EXPECT_NEAR(known.psnr(), 20.0, 1e-9);
  EXPECT_NEAR(known.l1(), 0.2, 1e-12);
  EXPECT_NEAR(known.latent_std(), 1.0, 1e-12);
}

}  // namespace
}  // namespace flowrun
