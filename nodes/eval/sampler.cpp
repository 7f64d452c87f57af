// sampler: images from a diffusion model for a fixed list of prompts, written as a PNG grid.
// Schema: schemas/sampler.yaml. Test: tests/nodes/sampler_test.cpp.
//
// DDIM (eta 0, diffusers' "leading" timestep spacing) with classifier-free guidance: each
// denoising step runs the model once on [conditional rows; null-condition rows] and mixes
// out = uncond + guidance * (cond - uncond). The null condition is the one diffusion_loss trains
// with cond_drop (zero text states, all-ones masks: diffusion::null_condition). The schedule and
// the prediction type are the objective's (the `objective` input), so they are stated once. The starting noise is drawn from the
// node's own seed, so every grid of a run (and of the base and LoRA runs) starts from the same
// noise and differences between grids are the model's.
//
// Pixel space (channels 3): the sample in [-1, 1] is the image. Latents with `vae`: the sampler
// holds the decoder part of a diffusers AutoencoderKL (models/vae/vae.hpp; built once at setup) and
// decodes x / scaling_factor to RGB, one image at a time. Latents without a VAE decoder: the
// first three channels, stretched to [0, 255] per image, so a person still sees structure.
// The node also outputs the samples the grid shows and each one's prompt, so an evaluator of
// what they show (shapes_fidelity) scores exactly the grid.
#include "eval/sampler.hpp"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "common/batch_keys.hpp"
#include "common/seed.hpp"
#include "data/image_tensor.hpp"
#include "encode/text_encode.hpp"
#include "encode/tokenize.hpp"
#include "formats/files.hpp"
#include "formats/image_io.hpp"
#include "formats/tfevents.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"
#include "registry.hpp"
#include "train/fully_sharded.hpp"
#include "train/losses.hpp"
#include "train/precision.hpp"

namespace flowrun {

std::vector<int64_t> ddim_timesteps(int64_t train_timesteps, int64_t steps) {
  if (steps < 1 || steps > train_timesteps)
    throw std::runtime_error("sampler: steps must be in [1, " + std::to_string(train_timesteps) + "], got " +
                             std::to_string(steps));
  const int64_t ratio = train_timesteps / steps;
  std::vector<int64_t> ts;
  for (int64_t i = steps - 1; i >= 0; --i) ts.push_back(i * ratio);
  return ts;
}

torch::Tensor sample_ddim(ModelState& model, const TensorMap& cond, const SampleOptions& o) {
  torch::NoGradGuard no_grad;
  const c10::Device device = model_device(model);
  const int64_t n = o.noise.size(0);
  const torch::Tensor& emb = cond.at(batch_key::text_emb);
  if (emb.size(0) != n)
    throw std::runtime_error("sampler: " + std::to_string(emb.size(0)) + " prompt embeddings for " +
                             std::to_string(n) + " noise rows");
  // [cond; uncond] once: the text part of the model's input never changes between steps.
  // The unconditional rows are the null condition, the input cond_drop trains with.
  const TensorMap null = o.guidance == 1.0 ? TensorMap{} : diffusion::null_condition(cond);
  TensorMap in;
  for (const auto& [k, v] : cond) in[k] = o.guidance == 1.0 ? v.to(device) : torch::cat({v, null.at(k)}).to(device);
  torch::Tensor x = o.noise.to(device);
  const std::vector<int64_t> ts = ddim_timesteps(o.schedule.timesteps(), o.steps);
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t t = ts[i], t_prev = i + 1 < ts.size() ? ts[i + 1] : -1;
    torch::Tensor out;
    if (o.guidance == 1.0) {
      in[batch_key::noisy] = x;
      in[batch_key::timestep] = torch::full({n}, t, torch::TensorOptions().dtype(torch::kInt64).device(device));
      out = model.forward(in);
    } else {
      in[batch_key::noisy] = torch::cat({x, x});
      in[batch_key::timestep] = torch::full({2 * n}, t, torch::TensorOptions().dtype(torch::kInt64).device(device));
      const torch::Tensor both = model.forward(in);
      const torch::Tensor c = both.narrow(0, 0, n), u = both.narrow(0, n, n);
      out = u + o.guidance * (c - u);
    }
    x = diffusion::ddim_step(o.schedule, out.to(x.scalar_type()), torch::tensor(t), torch::tensor(t_prev), x,
                             o.prediction);
  }
  return x;
}

Image sample_grid(const torch::Tensor& samples, int64_t cols) {
  if (samples.dim() != 4) throw std::runtime_error("sample_grid: expected [N, C, H, W]");
  const int64_t n = samples.size(0), C = samples.size(1), H = samples.size(2), W = samples.size(3);
  torch::Tensor s = samples.detach().to(torch::kCPU, torch::kFloat);
  if (C != 3) {
    // Latents (no decoder): the first three channels (or the first, as gray), each image
    // stretched to the full range.
    torch::Tensor v = C >= 3 ? s.narrow(1, 0, 3) : s.narrow(1, 0, 1).expand({n, 3, H, W});
    torch::Tensor flat = v.reshape({n, -1});
    torch::Tensor lo = std::get<0>(flat.min(1)).view({n, 1, 1, 1}), hi = std::get<0>(flat.max(1)).view({n, 1, 1, 1});
    s = (v - lo) / (hi - lo).clamp_min(1e-8) * 2 - 1;
  }
  return image_grid(s, static_cast<int>(cols));
}

torch::Tensor decode_latents(ModelState& vae, const torch::Tensor& latents) {
  torch::NoGradGuard no_grad;
  if (latents.dim() != 4) throw std::runtime_error("decode_latents: expected latents [N, C, h, w]");
  if (!vae.autoencoder || !vae.autoencoder->decode)
    throw std::runtime_error("decode_latents: model '" + vae.kind + "' is not an autoencoder with a decoder");
  const torch::Tensor w = vae.module->parameters().front();
  const double s = vae.autoencoder->scaling_factor;
  std::vector<torch::Tensor> images;
  for (int64_t i = 0; i < latents.size(0); ++i)
    images.push_back(
        vae.autoencoder->decode(vae, latents.narrow(0, i, 1).to(w.device(), w.scalar_type()) / s).to(torch::kFloat));
  return torch::cat(images);
}

namespace {

class SamplerNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    prompts_ = p.get<std::vector<std::string>>("prompts");
    if (prompts_.empty()) throw std::runtime_error(ctx.who() + ": `prompts` is empty; give at least one prompt");
    per_prompt_ = p.get<int64_t>("per_prompt");
    zoom_ = p.get<int64_t>("zoom");
    steps_ = p.get<int64_t>("steps");
    guidance_ = p.get<double>("guidance");
    height_ = p.get<int64_t>("height");
    width_ = p.get<int64_t>("width");
    channels_ = p.get<int64_t>("channels");
    seed_ = p.get<int64_t>("seed");
    if (p.get<bool>("tensorboard") && ctx.run().rank == 0)
      tb_ = tfevents::EventFile::open(ctx.run().out_dir + "/tb");
    const Objective& objective = ctx.state_as<Objective>("objective");
    const Denoising* denoiser = objective.denoising();
    if (!denoiser)
      throw std::runtime_error(ctx.who() + ": its objective is " + objective.type +
                               ", which trains no denoiser; sampling needs the objective the model trains with to "
                               "offer its noise schedule and prediction (Objective::denoising), as diffusion_loss does");
    // A model split over tp ranks samples on every rank of the first replica (each holds a part),
    // over a channel of this node's own (parallel/tensor_parallel.hpp TpChannel).
    tp_group_ = parallel::own_tp_group(ctx.name(), ctx.run());  // collective: setup runs in file order
    if (ctx.state_as<ModelState>("model").stages)  // pipeline parallel: each denoising step through the stages
      pp_group_ = parallel::own_pp_group(ctx.name() + " pipeline", ctx.run());
    dp_group_ = parallel::own_dp_group(ctx.name() + " gathers", ctx.run());  // a ZeRO-3 model's gathers
    first_replica_ = parallel::replica_of(ctx.run()).index == 0;
    schedule_ = denoiser->noise_schedule();
    prediction_ = denoiser->prediction();
    ddim_timesteps(schedule_.timesteps(), steps_);  // a bad `steps` is a setup error, not a step-500 one
    check_text_pairs(ctx);
    if (p.has("vae"))
      throw std::runtime_error(ctx.who() + ": the sampler's vae settings moved: it decodes with the graph's own VAE, "
                               "an input. Drop with: vae, give the vae_encode node decoder: true, and wire it: "
                               "in: { ..., vae: VAE_NODE.params }");
    if (ctx.connected("vae")) {
      const ModelState& v = ctx.state_as<ModelState>("vae");
      if (!v.autoencoder || !v.autoencoder->decode)
        throw std::runtime_error(ctx.who() + ": its vae input (" + ctx.refs("vae").front() + ", '" + v.kind +
                                 "') has no decoder: give that vae_encode node decoder: true");
      if (channels_ != v.autoencoder->latent_channels)
        throw std::runtime_error(ctx.who() + ": channels is " + std::to_string(channels_) + " but the vae's latent channels are " +
                                 std::to_string(v.autoencoder->latent_channels) + "; with a vae the samples are latents, so set "
                                 "channels to the VAE's latent channels (and height/width in latent rows/columns)");
      if (ctx.run().rank == 0) {
        const int64_t f = v.autoencoder->downsample;
        spdlog::info("{}: decodes with {}'s decoder: {}x{} latents -> {}x{} images", ctx.who(), ctx.refs("vae").front(),
                     height_, width_, height_ * f, width_ * f);
      }
    }
  }

  void run(StepContext& ctx) override {
    TextBatch texts;  // per_prompt copies of each prompt: one grid row per prompt
    for (const auto& pr : prompts_)
      for (int64_t i = 0; i < per_prompt_; ++i) texts.push_back(pr);
    ctx.out("captions", texts);
    // The grid is the same on every rank (same seed, same weights): only rank 0 makes it (with its
    // tp partners, under tensor parallel; with every rank, each holding a slice, under ZeRO-3); the
    // others output no samples (what shapes_fidelity expects of them).
    if (!first_replica_ && !ctx.state_as<ModelState>("model").shards) {
      ctx.out("samples", TensorMap{});
      return;
    }
    const parallel::TpChannel tp_channel(tp_group_.get());
    const StageChannel stage_channel(pp_group_.get());
    const auto t0 = std::chrono::steady_clock::now();
    ShardedReader reader(ctx.state_as<ModelState>("model"), dp_group_.get(), ctx.who() + " of step " + std::to_string(ctx.step()));
    ModelState& model = reader.model();
    TensorMap cond = text_conditioner(ctx).encode(texts);
    // Size and style conditioning (models that have it read these; others ignore them): as
    // HunyuanDiT's pipeline, the image size as both original and target size, no crop, style 0.
    ModelState* vae = ctx.connected("vae") ? &ctx.state_as<ModelState>("vae") : nullptr;
    const int64_t n = static_cast<int64_t>(texts.size()), f = vae ? vae->autoencoder->downsample : 1;
    cond[batch_key::image_meta_size] = torch::tensor({static_cast<float>(height_ * f), static_cast<float>(width_ * f),
                                             static_cast<float>(height_ * f), static_cast<float>(width_ * f), 0.f, 0.f})
                                  .repeat({n, 1});
    cond[batch_key::style] = torch::zeros({n}, torch::kLong);

    SampleOptions o;
    o.schedule = schedule_;
    o.prediction = prediction_;
    o.steps = steps_;
    o.guidance = guidance_;
    torch::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed_));
    o.noise = torch::randn({n, channels_, height_, width_}, gen);
    const torch::Tensor x = sample_ddim(model, cond, o);
    if (ctx.run().rank != 0) {  // a tp partner of rank 0: its part of the work is done
      ctx.out("samples", TensorMap{});
      return;
    }
    if (!torch::isfinite(x).all().item<bool>())
      throw std::runtime_error(ctx.who() + ": step " + std::to_string(ctx.step()) +
                               ": the samples are not finite (the model diverged?)");
    torch::Tensor img = x;
    if (vae) img = decode_latents(*vae, x).to(x.device());
    ctx.out("samples", TensorMap{{img.size(1) == 3 ? "image" : "latents", img}});

    char name[32];
    std::snprintf(name, sizeof name, "step_%07lld.png", static_cast<long long>(ctx.step()));
    const std::string dir = ctx.run().out_dir + "/samples";
    std::filesystem::create_directories(dir);
    const Image grid = zoom(sample_grid(img, per_prompt_), static_cast<int>(zoom_));
    const std::string png = encode_png(grid);  // once: the file and the TensorBoard image
    write_file_atomic(dir + "/" + name, png);
    if (tb_) {  // tagged by the node's name
      tb_->image(ctx.step(), ctx.name(), png, grid.h, grid.w, grid.c);
      tb_->flush();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spdlog::info("{} step {}: wrote {}/{} ({} prompts x {}, {} DDIM steps, guidance {}, {:.1f} s)", ctx.name(),
                 ctx.step(), dir, name, prompts_.size(), per_prompt_, steps_, guidance_, s);
  }

 private:
  std::vector<std::string> prompts_;
  int64_t per_prompt_ = 0, zoom_ = 0, steps_ = 0, height_ = 0, width_ = 0, channels_ = 0, seed_ = 0;  // setup: the schema's
  double guidance_ = 0;
  std::shared_ptr<parallel::Group> tp_group_;  // run.parallel.tp > 1: the split model's collectives
  std::shared_ptr<parallel::Group> pp_group_;  // run.parallel.pp > 1: the stages' activations (StageChannel)
  std::shared_ptr<parallel::Group> dp_group_;  // dp > 1: a ZeRO-3 model's gathers (train/fully_sharded.hpp)
  bool first_replica_ = true;                  // rank 0's replica: its tp ranks sample
  diffusion::NoiseSchedule schedule_;
  diffusion::Prediction prediction_ = diffusion::Prediction::eps;
  std::shared_ptr<tfevents::EventFile> tb_;  // rank 0 with tensorboard: true
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(sampler, flowrun::SamplerNode)
