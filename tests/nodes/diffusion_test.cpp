// diffusion: the noise schedule, add_noise / velocity / DDIM against their closed forms, the
// forward_backward objective (reproducible; a tiny DiT learns a tiny image set) and the `cond`
// input's merge.
#include <gtest/gtest.h>

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <set>

#include "common/seed.hpp"
#include "dit_test_helpers.hpp"
#include "models/dit/dit.hpp"
#include "models/dropout.hpp"
#include "train/diffusion.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"

namespace flowrun {
namespace {

using dit_test::tiny;

using diffusion::NoiseSchedule;

TEST(Diffusion, SchedulesMatchTheirClosedForms) {
  NoiseSchedule s = NoiseSchedule::make(diffusion::Schedule::scaled_linear, 0.00085, 0.012, 1000);
  ASSERT_EQ(s.timesteps(), 1000);
  EXPECT_NEAR(s.betas[0].item<double>(), 0.00085, 1e-12);
  EXPECT_NEAR(s.betas[999].item<double>(), 0.012, 1e-12);
  const double r = (std::sqrt(0.012) - std::sqrt(0.00085)) / 999.0;
  EXPECT_NEAR(s.betas[500].item<double>(), std::pow(std::sqrt(0.00085) + 500 * r, 2), 1e-12);
  double prod = 1.0;
  for (int i = 0; i < 1000; ++i) {
    prod *= 1.0 - s.betas[i].item<double>();
    if (i % 97 == 0 || i == 999) EXPECT_NEAR(s.alphas_cumprod[i].item<double>(), prod, 1e-12) << i;
  }
  // SD's well-known value: alphas_cumprod[999] ~ 0.00466 for scaled_linear 0.00085..0.012.
  EXPECT_NEAR(s.alphas_cumprod[999].item<double>(), 0.004660, 2e-5);
  NoiseSchedule l = NoiseSchedule::make(diffusion::Schedule::linear, 0.0001, 0.02, 1000);
  EXPECT_NEAR(l.betas[500].item<double>(), 0.0001 + 500 * (0.02 - 0.0001) / 999.0, 1e-12);
  EXPECT_THROW(NoiseSchedule::make(diffusion::Schedule::linear, 0.0, 0.02, 10), std::runtime_error);
  EXPECT_THROW(diffusion::parse_schedule("cosine"), std::runtime_error);
}

TEST(Diffusion, AddNoiseVelocityAndDdimMatchClosedForms) {
  NoiseSchedule s = NoiseSchedule::make(diffusion::Schedule::scaled_linear, 0.00085, 0.012, 1000);
  at::Generator g = make_cpu_generator(3);
  torch::Tensor x0 = torch::randn({3, 2, 4, 4}, g), eps = torch::randn({3, 2, 4, 4}, g);
  torch::Tensor t = torch::tensor({0, 421, 999}, torch::kLong);
  torch::Tensor xt = diffusion::add_noise(s, x0, eps, t);
  torch::Tensor v = diffusion::velocity(s, x0, eps, t);
  for (int i = 0; i < 3; ++i) {
    const double ab = s.alphas_cumprod[t[i].item<int64_t>()].item<double>();
    torch::Tensor exp_xt = std::sqrt(ab) * x0[i] + std::sqrt(1 - ab) * eps[i];
    torch::Tensor exp_v = std::sqrt(ab) * eps[i] - std::sqrt(1 - ab) * x0[i];
    EXPECT_LT((xt[i] - exp_xt).abs().max().item<double>(), 1e-6) << i;
    EXPECT_LT((v[i] - exp_v).abs().max().item<double>(), 1e-6) << i;
  }
  EXPECT_TRUE(torch::equal(diffusion::target(s, diffusion::Prediction::eps, x0, eps, t), eps));
  // With the true eps / v, x0^ is x0 and a DDIM step lands on add_noise(x0, eps, t_prev).
  for (auto p : {diffusion::Prediction::eps, diffusion::Prediction::v}) {
    torch::Tensor out = p == diffusion::Prediction::eps ? eps : v;
    EXPECT_LT((diffusion::predict_x0(s, p, out, xt, t) - x0).abs().max().item<double>(), 2e-3);
    torch::Tensor tp = torch::tensor({-1, 300, 500}, torch::kLong);
    torch::Tensor prev = diffusion::ddim_step(s, out, t, tp, xt, p);
    EXPECT_LT((prev[0] - x0[0]).abs().max().item<double>(), 1e-4);  // t_prev -1: the clean sample
    torch::Tensor expect = diffusion::add_noise(s, x0, eps, tp.clamp_min(0));
    EXPECT_LT((prev.narrow(0, 1, 2) - expect.narrow(0, 1, 2)).abs().max().item<double>(), 2e-3);
  }
  EXPECT_THROW(diffusion::add_noise(s, x0, eps, torch::tensor({0, 1, 1000})), std::runtime_error);
}

// Four 8x8 RGB images (flat colours with a bright square at a different place each) and their
// text embeddings.
TensorMap tiny_dataset() {
  torch::Tensor img = torch::zeros({4, 3, 8, 8});
  for (int i = 0; i < 4; ++i) {
    img[i].select(0, i % 3).fill_(0.5);
    img[i].narrow(1, 2 * i, 2).narrow(2, 2 * i, 2).fill_(1.0);
  }
  at::Generator g = make_cpu_generator(1);
  return {{"image", img * 2 - 1}, {"text_emb", torch::randn({4, dit_test::tiny().text_len, 8}, g)}};
}

std::vector<double> train_losses(int steps, uint64_t seed) {
  dit::Dit m(tiny());
  dit::init_weights(*m, 1);
  auto state = dit::make_state(m);
  diffusion::Options opts;
  opts.x_key = "image";
  const DiffusionLoss objective(opts);
  torch::optim::AdamW opt(state->trainable_parameters(), torch::optim::AdamWOptions(2e-3).weight_decay(0));
  const TensorMap data = tiny_dataset();
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    FwdBwdOptions o;
    o.dropout_seed = mix_seed({seed, static_cast<uint64_t>(s)});  // as the node: (seed, step, ...)
    losses.push_back(forward_backward(*state, data, objective, o).loss.item<double>());
    opt.step();
  }
  return losses;
}

TEST(Diffusion, SameSeedGivesTheSameLossSequence) {
  auto a = train_losses(6, 5), b = train_losses(6, 5), c = train_losses(6, 6);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Diffusion, LossOfATinyDitDropsOnATinyImageSet) {
  auto l = train_losses(100, 5);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += l[i] / 10;
  for (int i = 90; i < 100; ++i) last += l[i] / 10;
  std::printf("tiny dit: mean loss steps 1-10 %.4f, steps 91-100 %.4f\n", first, last);
  // The zero-initialised output predicts eps = 0, so the first losses are E[eps^2] = 1. Four
  // images are memorised quickly; measured 2026-11-23 (seed 5): first-10 mean 0.937, last-10 mean 0.181.
  // A random t per row makes single losses noisy, so compare 10-step means; half the start is
  // well above what training reaches and far below what an untrained model gives.
  EXPECT_NEAR(first, 1.0, 0.15);
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
}

TEST(ForwardBackwardCond, MergesIntoTheBatchAndRefusesDuplicateKeys) {
  TensorMap batch{{"image", torch::zeros({2, 3, 4, 4})}};
  TensorMap cond{{"text_emb", torch::ones({2, 3, 8})}};
  TensorMap m = merge_batches(batch, cond);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_TRUE(m.count("text_emb") && m.count("image"));
  try {
    merge_batches(m, cond);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'text_emb'"), std::string::npos) << e.what();
  }
}

// Classifier-free guidance dropout is the objective's: with cond_drop 1, every row trains on
// the null condition (text states zeroed, masks all ones), drawn after t and the noise, so the
// loss equals that of the null-condition batch without dropping; outside training (an
// evaluator: no TrainingScope) nothing is dropped.
TEST(Diffusion, CondDropReplacesTheConditionByTheNullOneInTrainingOnly) {
  dit::Dit m(tiny());
  dit_test::randomize(*m, 1);  // the DiT init zeroes the output path: every condition would score alike
  auto state = dit::make_state(m);
  TensorMap batch = tiny_dataset();
  batch["text_mask"] = torch::tensor({{1, 1, 0, 0, 0}, {1, 0, 0, 0, 0}, {1, 1, 1, 1, 1}, {1, 1, 0, 1, 0}}, torch::kLong);
  const TensorMap null = diffusion::null_condition(batch);
  EXPECT_TRUE(torch::equal(null.at("text_emb"), torch::zeros_like(batch.at("text_emb"))));
  EXPECT_TRUE(torch::equal(null.at("text_mask"), torch::ones_like(batch.at("text_mask"))));
  EXPECT_TRUE(torch::equal(null.at("image"), batch.at("image")));

  diffusion::Options keep, drop;
  keep.x_key = drop.x_key = "image";
  drop.cond_drop = 1.0;
  torch::NoGradGuard no_grad;
  auto loss = [&](const diffusion::Options& o, const TensorMap& b, bool training) {
    std::optional<TrainingScope> scope;
    if (training) scope.emplace(42);
    return DiffusionLoss(o).loss(*state, b).item<double>();
  };
  EXPECT_EQ(loss(drop, batch, true), loss(keep, null, true));
  EXPECT_NE(loss(keep, batch, true), loss(keep, null, true));  // the condition matters
  EXPECT_EQ(loss(drop, batch, false), loss(keep, batch, false));
}

// Per-stream dropout (cond_drop for text_emb/text_mask, cond_drop_t5 for t5_emb/t5_mask, as
// HunyuanDiT's uncond_p and uncond_p_t5): each stream's rate over many rows within 0.02 of its
// setting, drawn apart (both dropped about p x q of the time); without cond_drop_t5 one draw drops
// both together (the rows are the same), as before. A model that records what it was given.
TEST(Diffusion, EachStreamIsDroppedWithItsOwnProbability) {
  const int64_t n = 20000;
  TensorMap seen;
  auto probe = std::make_shared<ModelState>(torch::nn::Linear(1, 1).ptr(), [&](torch::nn::Module&, const TensorMap& b) {
    seen = b;
    return torch::zeros_like(b.at("x"));
  }, "probe");
  const TensorMap batch = {{"image", torch::ones({n, 1, 2, 2})},
                           {"text_emb", torch::ones({n, 2, 3})}, {"text_mask", torch::zeros({n, 2}, torch::kLong)},
                           {"t5_emb", torch::ones({n, 4, 3})}, {"t5_mask", torch::zeros({n, 4}, torch::kLong)}};
  // Rows whose stream was replaced by the null condition (zero states, all-ones mask).
  auto dropped = [&](const char* emb, const char* mask) {
    const torch::Tensor z = seen.at(emb).abs().sum({1, 2}) == 0, m = seen.at(mask).eq(1).all(1);
    EXPECT_TRUE(torch::equal(z, m)) << emb << " and " << mask << " dropped apart";
    return z;
  };
  auto run = [&](double text, std::optional<double> t5) {
    diffusion::Options o;
    o.x_key = "image";
    o.cond_drop = text;
    o.cond_drop_t5 = t5;
    TrainingScope scope(7);
    torch::NoGradGuard no_grad;
    DiffusionLoss(o).loss(*probe, batch);
  };
  auto rate = [&](const torch::Tensor& rows) { return rows.to(torch::kDouble).mean().item<double>(); };

  run(0.1, 0.05);
  const torch::Tensor text = dropped("text_emb", "text_mask"), t5 = dropped("t5_emb", "t5_mask");
  EXPECT_NEAR(rate(text), 0.1, 0.02);
  EXPECT_NEAR(rate(t5), 0.05, 0.02);
  EXPECT_NEAR(rate(text & t5), 0.1 * 0.05, 0.003);  // independent draws

  run(0.0, 0.2);  // the T5 stream alone
  EXPECT_EQ(rate(dropped("text_emb", "text_mask")), 0.0);
  EXPECT_NEAR(rate(dropped("t5_emb", "t5_mask")), 0.2, 0.02);

  run(0.1, std::nullopt);  // one draw for both streams
  const torch::Tensor both = dropped("text_emb", "text_mask");
  EXPECT_NEAR(rate(both), 0.1, 0.02);
  EXPECT_TRUE(torch::equal(both, dropped("t5_emb", "t5_mask")));
}

}  // namespace
}  // namespace flowrun

// Every use of a seed has its own tag (common/seed.hpp lists them all in one place): no two
// streams drawn from one seed can coincide by sharing a tag.
TEST(Seed, EveryTagIsDistinct) {
  std::set<uint64_t> seen(std::begin(flowrun::kSeedTags), std::end(flowrun::kSeedTags));
  EXPECT_EQ(seen.size(), std::size(flowrun::kSeedTags));
}
