// Diffusion schedule, noising, DDIM and the training loss: see diffusion.hpp.
#include "train/diffusion.hpp"

#include <cmath>

#include "common/batch_keys.hpp"
#include "common/seed.hpp"
#include "common/tensor_map.hpp"
#include "models/dropout.hpp"

namespace flowrun::diffusion {

Schedule parse_schedule(const std::string& s) {
  if (s == "linear") return Schedule::linear;
  if (s == "scaled_linear") return Schedule::scaled_linear;
  throw std::runtime_error("diffusion: unknown schedule '" + s + "' (linear, scaled_linear)");
}

Prediction parse_prediction(const std::string& s) {
  if (s == "eps" || s == "epsilon") return Prediction::eps;
  if (s == "v" || s == "v_prediction") return Prediction::v;
  throw std::runtime_error("diffusion: unknown prediction '" + s + "' (eps, v)");
}

NoiseSchedule NoiseSchedule::make(Schedule kind, double beta_start, double beta_end, int64_t T, const torch::Device& device) {
  if (T < 1) throw std::runtime_error("diffusion: timesteps must be >= 1");
  if (!(beta_start > 0 && beta_end > 0 && beta_start < 1 && beta_end < 1))
    throw std::runtime_error("diffusion: beta_start and beta_end must be in (0, 1)");
  auto f64 = torch::TensorOptions().dtype(torch::kDouble).device(device);
  NoiseSchedule s;
  if (kind == Schedule::linear)
    s.betas = torch::linspace(beta_start, beta_end, T, f64);
  else
    s.betas = torch::linspace(std::sqrt(beta_start), std::sqrt(beta_end), T, f64).pow(2);
  s.alphas_cumprod = torch::cumprod(1.0 - s.betas, 0);
  return s;
}

torch::Tensor NoiseSchedule::ab(const torch::Tensor& t, const torch::Tensor& x) const {
  // Where the schedule lives; the range is checked on the host only where reading costs no
  // device sync (training draws t below T itself).
  torch::Tensor ti = t.to(alphas_cumprod.device()).to(torch::kLong).reshape({-1});
  const int64_t T = timesteps();
  if (ti.is_cpu() && ti.numel() > 0 && ti.max().item<int64_t>() >= T)
    throw std::runtime_error("diffusion: timestep " + std::to_string(ti.max().item<int64_t>()) +
                             " is outside the schedule's [0, " + std::to_string(T) + ")");
  torch::Tensor neg = ti < 0;
  torch::Tensor v = torch::where(neg, torch::ones({ti.numel()}, alphas_cumprod.options()),
                                 alphas_cumprod.index_select(0, ti.clamp_min(0)));
  std::vector<int64_t> shape(static_cast<size_t>(std::max<int64_t>(x.dim(), 1)), 1);
  shape[0] = ti.numel();
  return v.view(shape).to(x.device(), x.scalar_type());
}

torch::Tensor add_noise(const NoiseSchedule& s, const torch::Tensor& x0, const torch::Tensor& noise,
                        const torch::Tensor& t) {
  torch::Tensor a = s.ab(t, x0);
  return a.sqrt() * x0 + (1 - a).sqrt() * noise;
}

torch::Tensor velocity(const NoiseSchedule& s, const torch::Tensor& x0, const torch::Tensor& noise,
                       const torch::Tensor& t) {
  torch::Tensor a = s.ab(t, x0);
  return a.sqrt() * noise - (1 - a).sqrt() * x0;
}

torch::Tensor target(const NoiseSchedule& s, Prediction p, const torch::Tensor& x0, const torch::Tensor& noise,
                     const torch::Tensor& t) {
  return p == Prediction::eps ? noise : velocity(s, x0, noise, t);
}

torch::Tensor predict_x0(const NoiseSchedule& s, Prediction p, const torch::Tensor& out, const torch::Tensor& x_t,
                         const torch::Tensor& t) {
  torch::Tensor a = s.ab(t, x_t);
  if (p == Prediction::eps) return (x_t - (1 - a).sqrt() * out) / a.sqrt();
  return a.sqrt() * x_t - (1 - a).sqrt() * out;
}

torch::Tensor ddim_step(const NoiseSchedule& s, const torch::Tensor& out, const torch::Tensor& t,
                        const torch::Tensor& t_prev, const torch::Tensor& x_t, Prediction p) {
  torch::Tensor a = s.ab(t, x_t), a_prev = s.ab(t_prev, x_t);
  torch::Tensor x0, eps;
  if (p == Prediction::eps) {
    eps = out;
    x0 = (x_t - (1 - a).sqrt() * out) / a.sqrt();
  } else {
    x0 = a.sqrt() * x_t - (1 - a).sqrt() * out;
    eps = a.sqrt() * out + (1 - a).sqrt() * x_t;
  }
  return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps;
}

torch::Tensor loss(ModelState& model, const TensorMap& batch, const Options& o) {
  auto it = batch.find(o.x_key);
  if (it == batch.end()) {
    std::string have;
    for (const auto& [k, _] : batch) have += (have.empty() ? "" : ", ") + k;
    throw std::runtime_error("objective diffusion_loss needs the batch's '" + o.x_key + "' (the clean sample, x_key); it has {" +
                             have + "}");
  }
  const torch::Tensor& x0 = it->second;
  if (x0.dim() < 2 || !x0.is_floating_point())
    throw std::runtime_error("objective diffusion_loss: batch '" + o.x_key + "' must be a float [batch, C, ...] tensor, got " +
                             shape_str(x0));
  // One schedule per option set is cheap to make (T float64 values); made per call, where the
  // batch is, to stay stateless.
  const NoiseSchedule sched = NoiseSchedule::make(o.schedule, o.beta_start, o.beta_end, o.timesteps, x0.device());
  const int64_t B = x0.size(0);
  // Draws are made where the batch is (training: the scope's generator for that device; on the
  // CPU the scope's own), so no step copies noise from the host. An evaluation (no scope) draws
  // from a fixed CPU generator.
  at::Generator fallback;
  at::Generator* g = TrainingScope::current_on(x0.device());
  if (!g) {
    fallback = make_cpu_generator(mix_seed({kSeedTagDiffusion}));
    g = &fallback;
  }
  const auto on_g = torch::TensorOptions().device(g->device());
  torch::Tensor t, noise;
  {
    torch::NoGradGuard no_grad;
    t = torch::randint(o.timesteps, {B}, *g, on_g.dtype(torch::kLong));
    noise = torch::randn(x0.sizes(), *g, on_g.dtype(torch::kFloat));
    if (o.noise_offset != 0.0) {
      std::vector<int64_t> shape(static_cast<size_t>(x0.dim()), 1);
      shape[0] = B;
      shape[1] = x0.size(1);
      noise = noise + o.noise_offset * torch::randn(shape, *g, on_g.dtype(torch::kFloat));
    }
    noise = noise.to(x0.device(), x0.scalar_type());
    t = t.to(x0.device());
  }
  torch::Tensor xt = add_noise(sched, x0, noise, t);
  torch::Tensor tgt = target(sched, o.prediction, x0, noise, t);
  TensorMap in = batch;
  // Classifier-free guidance training: each row's condition becomes the null condition with
  // P = cond_drop (each stream apart with cond_drop_t5). Training only (inside a TrainingScope),
  // drawn after t and the noise: the first stream's rows, then the T5 stream's.
  const torch::Tensor* cond = nullptr;  // a condition tensor: its rows and device
  for (const auto& stream : batch_key::text_streams)
    if (auto c = batch.find(stream.emb); !cond && c != batch.end() && c->second.defined() && c->second.dim() >= 1) cond = &c->second;
  // A setting that would do nothing is refused, not ignored (issue 47): cond_drop_t5 with no T5 stream.
  if (o.cond_drop_t5 && *o.cond_drop_t5 > 0.0 && batch.find(batch_key::t5_emb) == batch.end())
    throw std::runtime_error("objective diffusion_loss: cond_drop_t5 is " + std::to_string(*o.cond_drop_t5) +
                             ", but the batch has no " + batch_key::t5_emb +
                             " (a graph with one text stream): drop cond_drop_t5, or add a T5 encoder (out_prefix: t5)");
  at::Generator* training = cond ? TrainingScope::current_on(cond->device()) : nullptr;
  if (training) {
    const int64_t rows = cond->size(0);
    auto draw = [&](double p) {
      torch::NoGradGuard no_grad;
      return torch::empty({rows}, cond->options().dtype(torch::kFloat)).bernoulli_(p, *training).to(torch::kBool);
    };
    torch::Tensor drop_text, drop_t5;
    if (o.cond_drop > 0.0) drop_text = draw(o.cond_drop);
    if (!o.cond_drop_t5)
      drop_t5 = drop_text;  // one draw for both streams
    else if (*o.cond_drop_t5 > 0.0)
      drop_t5 = draw(*o.cond_drop_t5);
    const TensorMap null = null_condition(batch);
    auto replace = [&](const torch::Tensor& drop, std::initializer_list<const char*> keys) {
      if (!drop.defined()) return;
      for (const char* k : keys) {
        auto it = in.find(k);
        if (it == in.end() || !it->second.defined()) continue;
        std::vector<int64_t> shape(static_cast<size_t>(it->second.dim()), 1);
        shape[0] = rows;
        it->second = torch::where(drop.view(shape), null.at(k), it->second);
      }
    };
    replace(drop_text, {batch_key::text_emb, batch_key::text_mask});
    replace(drop_t5, {batch_key::t5_emb, batch_key::t5_mask});
  }
  in[batch_key::noisy] = xt;
  in[batch_key::timestep] = t;
  torch::Tensor pred = model.forward(in);
  if (!pred.sizes().equals(x0.sizes()))
    throw std::runtime_error("objective diffusion_loss: model output " + shape_str(pred) +
                             " and the sample '" + o.x_key + "' " + shape_str(x0) +
                             " differ in shape");
  return torch::mse_loss(pred.to(torch::kFloat), tgt.to(torch::kFloat));
}

TensorMap null_condition(const TensorMap& batch) {
  TensorMap out = batch;
  for (const auto& stream : batch_key::text_streams) {
    if (auto it = out.find(stream.emb); it != out.end() && it->second.defined()) it->second = torch::zeros_like(it->second);
    if (auto it = out.find(stream.mask); it != out.end() && it->second.defined()) it->second = torch::ones_like(it->second);
  }
  return out;
}

}  // namespace flowrun::diffusion
