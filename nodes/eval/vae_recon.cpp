// vae_recon: a VAE's reconstructions of held-out images, scored (l1, psnr, latent_std) and
// written as a PNG grid (originals above, reconstructions below), OUT_DIR/recon/step_NNNNNNN.png.
// Schema: schemas/vae_recon.yaml. Test: tests/nodes/vae_loss_test.cpp, graph_vae_test.cpp.
//
// Several ranks: each reconstructs its own shard of the split (Dataset::batch shards by rank),
// then one all-reduce of the sums (ReconSums) gives every rank the same figures; rank 0 writes
// the grid of its first batch.
#include "eval/vae_recon.hpp"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "comm.hpp"
#include "common/device.hpp"
#include "formats/files.hpp"
#include "formats/tfevents.hpp"
#include "data/dataset.hpp"
#include "formats/image_io.hpp"
#include "data/image_tensor.hpp"
#include "eval/evaluator.hpp"
#include "registry.hpp"

namespace flowrun {

double ReconSums::psnr() const { return 10.0 * std::log10(4.0 / (sq / pixels)); }

double ReconSums::latent_std() const {
  const double mu = z / latents;
  return std::sqrt(std::max(0.0, z2 / latents - mu * mu));
}

// An autoencoder state with both parts, or an error naming it (`who`: the caller).
static const ModelState::Autoencoder& both_parts(const ModelState& m, const std::string& who) {
  if (!m.autoencoder || !m.autoencoder->encode || !m.autoencoder->decode)
    throw std::runtime_error(who + ": its model is '" + m.kind +
                             "', not an AutoencoderKL with encoder and decoder (connect a vae node's params or their EMA)");
  return *m.autoencoder;
}

torch::Tensor reconstruct(ModelState& vae, const torch::Tensor& images, ReconSums& sums) {
  torch::NoGradGuard no_grad;
  const ModelState::Autoencoder& ae = both_parts(vae, "reconstruct");
  const torch::Tensor w = vae.module->parameters().front();
  const torch::Tensor mean = ae.encode(vae, images.to(w.device(), w.scalar_type())).first;
  const torch::Tensor rec = ae.decode(vae, mean).to(images.device(), torch::kFloat);
  const torch::Tensor err = (rec - images.to(torch::kFloat)).to(torch::kDouble);
  const torch::Tensor m = mean.to(torch::kDouble);
  // One read from the device for the four sums.
  const torch::Tensor s = torch::stack({err.abs().sum(), err.pow(2).sum(), m.sum(), m.pow(2).sum()}).cpu();
  const double* v = s.data_ptr<double>();
  sums.abs += v[0];
  sums.sq += v[1];
  sums.z += v[2];
  sums.z2 += v[3];
  sums.pixels += static_cast<double>(err.numel());
  sums.latents += static_cast<double>(m.numel());
  return rec;
}

namespace {

class VaeReconNode : public Node {
 public:
  void setup(SetupContext& ctx) override {
    const Params& p = ctx.params();
    opts_ = eval_options(ctx);
    grid_ = p.get<int64_t>("grid");
    zoom_ = p.get<int64_t>("zoom");
    if (grid_ > opts_.batch)
      throw std::runtime_error(ctx.who() + ": grid is " + std::to_string(grid_) + " images but a batch has " +
                               std::to_string(opts_.batch) + "; the grid shows the first batch, so lower grid or raise batch");
    both_parts(ctx.state_as<ModelState>("model"), ctx.who());
    if (p.get<bool>("tensorboard") && ctx.run().rank == 0) tb_ = tfevents::EventFile::open(ctx.run().out_dir + "/tb");
    ch_ = comm::Channel::create(ctx.name());  // collective: setup runs in file order on every rank
    check_eval_split(ctx.state_as<Dataset>("data"), opts_, ctx.who());
  }

  void run(StepContext& ctx) override {
    const auto t0 = std::chrono::steady_clock::now();
    ModelState& vae = ctx.state_as<ModelState>("model");
    const Dataset& data = ctx.state_as<Dataset>("data");
    const c10::Device device = model_device(vae);
    const int64_t n = std::min(opts_.batches, data.num_batches(opts_.split, opts_.batch, opts_.rank, opts_.world));
    ReconSums s;
    torch::Tensor shown;  // the first batch's first `grid` originals, then their reconstructions
    for (int64_t i = 0; i < n; ++i) {
      const TensorMap batch = data.batch(opts_.split, i, opts_.batch, opts_.rank, opts_.world);
      auto it = batch.find("image");
      if (it == batch.end())
        throw std::runtime_error(ctx.who() + ": the dataset's batches have no 'image' (an image data node's dataset)");
      const torch::Tensor x = it->second.to(device);
      const torch::Tensor rec = reconstruct(vae, x, s);
      if (i == 0 && grid_ > 0) shown = torch::cat({x.narrow(0, 0, grid_), rec.narrow(0, 0, grid_)}).to(torch::kCPU);
    }
    double sums[6] = {s.abs, s.sq, s.pixels, s.z, s.z2, s.latents};
    comm::allreduce(*ch_, sums, 6, comm::Op::sum, "reconstruction sums of step " + std::to_string(ctx.step()));
    const ReconSums all{sums[0], sums[1], sums[2], sums[3], sums[4], sums[5]};
    ctx.out("l1", all.l1());
    ctx.out("psnr", all.psnr());
    ctx.out("latent_std", all.latent_std());
    if (ctx.run().rank != 0) return;
    std::string wrote;
    if (shown.defined()) {
      char name[32];
      std::snprintf(name, sizeof name, "step_%07lld.png", static_cast<long long>(ctx.step()));
      const std::string dir = ctx.run().out_dir + "/recon";
      std::filesystem::create_directories(dir);
      const Image grid = zoom(image_grid(shown.clamp(-1, 1), static_cast<int>(grid_)), static_cast<int>(zoom_));
      const std::string png = encode_png(grid);
      write_file_atomic(dir + "/" + name, png);
      if (tb_) {
        tb_->image(ctx.step(), ctx.name(), png, grid.h, grid.w, grid.c);
        tb_->flush();
      }
      wrote = ", wrote " + dir + "/" + name;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    spdlog::info("{} step {}: {} l1 {:.4f} psnr {:.2f} dB, latent std {:.4g} (scaling_factor 1/std = {:.4g}; "
                 "{} images{}, {:.1f} s)", ctx.name(), ctx.step(), opts_.split, all.l1(), all.psnr(),
                 all.latent_std(), 1.0 / all.latent_std(), n * opts_.batch * opts_.world, wrote, secs);
  }

 private:
  EvalOptions opts_;  // split, batches, batch, rank, world: what the evaluator reads, read the same way
  int64_t grid_ = 0, zoom_ = 0;
  std::shared_ptr<comm::Channel> ch_;
  std::shared_ptr<tfevents::EventFile> tb_;  // rank 0 with tensorboard: true
};

}  // namespace
}  // namespace flowrun

FLOWRUN_NODE(vae_recon, flowrun::VaeReconNode)
