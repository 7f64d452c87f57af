// sampler: DDIM timesteps as diffusers' leading spacing, DDIM with classifier-free guidance
// recovering the data point exactly from a perfect denoiser (eps and v), the grid layout, and
// the node in a small shapes graph: the PNG is written at the right step, has the grid's size
// and is not a constant image; a diverged model is an error naming the node and step.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <fstream>
#include <sstream>

#include "formats/image_io.hpp"
#include "data/image_tensor.hpp"
#include "prep/prep_images.hpp"
#include "common/safetensors.hpp"
#include "models/vae/vae.hpp"
#include "data/shapes.hpp"
#include "eval/sampler.hpp"
#include "train/losses.hpp"
#include "data_test_helpers.hpp"
#include "node_test_helpers.hpp"

namespace flowrun {
namespace {

TEST(Sampler, DdimTimestepsUseLeadingSpacing) {
  EXPECT_EQ(ddim_timesteps(1000, 4), (std::vector<int64_t>{750, 500, 250, 0}));
  EXPECT_EQ(ddim_timesteps(1000, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(ddim_timesteps(10, 3), (std::vector<int64_t>{6, 3, 0}));
  EXPECT_THROW(ddim_timesteps(10, 11), std::runtime_error);
  EXPECT_THROW(ddim_timesteps(10, 0), std::runtime_error);
}

// A denoiser that knows the answer: x0_c for conditional rows (text_emb nonzero) and x0_u for
// null-condition rows; its output is the exact eps (or v) of x_t for that x0.
struct Oracle {
  diffusion::NoiseSchedule schedule;
  diffusion::Prediction prediction;
  torch::Tensor x0_c, x0_u;
  int64_t calls = 0, null_rows = 0;

  std::shared_ptr<ModelState> state() {
    auto fn = [this](torch::nn::Module&, const TensorMap& b) {
      ++calls;
      const torch::Tensor& x = b.at("x");
      const torch::Tensor& t = b.at("t");
      const int64_t n = x.size(0);
      // A row is the null condition when its text states are all zero and its mask all ones.
      torch::Tensor is_null = b.at("text_emb").reshape({n, -1}).abs().sum(1).eq(0) &
                              b.at("text_mask").reshape({n, -1}).eq(1).all(1);
      null_rows += is_null.sum().item<int64_t>();
      torch::Tensor x0 = torch::where(is_null.view({n, 1, 1, 1}), x0_u.expand_as(x), x0_c.expand_as(x));
      torch::Tensor ab = schedule.ab(t, x);
      torch::Tensor eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt();
      return prediction == diffusion::Prediction::eps ? eps : diffusion::velocity(schedule, x0, eps, t);
    };
    return std::make_shared<ModelState>(std::make_shared<torch::nn::Module>(), fn, "oracle");
  }
};

TEST(Sampler, DdimRecoversTheDataPointOfAPerfectDenoiser) {
  for (auto pred : {diffusion::Prediction::eps, diffusion::Prediction::v}) {
    Oracle o{diffusion::NoiseSchedule::make(diffusion::Schedule::scaled_linear, 0.00085, 0.012, 1000), pred,
             torch::rand({1, 3, 4, 4}) * 2 - 1, torch::zeros({1, 3, 4, 4})};
    auto model = o.state();
    TensorMap cond{{"text_emb", torch::ones({2, 5, 8})}, {"text_mask", torch::ones({2, 5}, torch::kInt64)}};
    SampleOptions so;
    so.schedule = o.schedule;
    so.prediction = pred;
    so.steps = 10;
    so.guidance = 1.0;  // conditional only: one call a step, no null rows
    so.noise = torch::randn({2, 3, 4, 4});
    torch::Tensor x = sample_ddim(*model, cond, so);
    EXPECT_LT((x - o.x0_c).abs().max().item<double>(), 1e-4);
    EXPECT_EQ(o.calls, 10);
    EXPECT_EQ(o.null_rows, 0);

    // Guidance g: out = u + g (c - u). For eps, x0^ mixes linearly too: x0_u + g (x0_c - x0_u).
    so.guidance = 3.0;
    o.calls = 0;
    x = sample_ddim(*model, cond, so);
    EXPECT_EQ(o.calls, 10);
    EXPECT_EQ(o.null_rows, 10 * 2);  // the second half of every call
    EXPECT_LT((x - 3.0 * o.x0_c).abs().max().item<double>(), 1e-3) << "prediction " << static_cast<int>(pred);
  }
}

TEST(Sampler, GridLaysOutRowsOfPerPromptImages) {
  torch::Tensor s = torch::full({6, 3, 4, 5}, -1.0);  // black tiles
  s[4].fill_(1.0);                                     // one white
  const Image g = sample_grid(s, 3);
  EXPECT_EQ(g.w, 3 * 5 + 4 * 2);
  EXPECT_EQ(g.h, 2 * 4 + 3 * 2);
  EXPECT_EQ(g.at(2, 2)[0], 0);                  // first tile
  EXPECT_EQ(g.at(2 + 7, 2 + 6)[0], 255);        // row 1, column 1: tile 4
  EXPECT_EQ(g.at(0, 0)[0], 255);                // the gap
  // Latents (4 channels): stretched per image, so a constant-free latent fills 0..255.
  const Image l = sample_grid(torch::linspace(-3, 5, 4 * 16).view({1, 4, 4, 4}), 1);
  EXPECT_EQ(l.at(2, 2)[0], 0);
  EXPECT_EQ(l.at(5, 5)[2], 255);  // the largest of the first three channels: channel 2, last pixel
}

// A shapes set (16x16) packed into shards, with its vocab.txt.
std::string make_shapes(const std::string& dir) {
  ShapesOptions so;
  so.out_dir = dir + "/png";
  so.count = 48;
  so.size = 16;
  write_shapes(so);
  PrepImagesOptions po;
  po.dir = so.out_dir;
  po.out = dir + "/shapes";
  po.val_fraction = 0;
  po.quiet = true;
  prep_images(po);
  return dir;
}

std::string shapes_graph(const std::string& data, int steps, const std::string& extra = "") {
  std::ostringstream g;
  g << R"(
flowrun: 1
run: { steps: )" << steps << R"(, seed: 2, log_every: 1 }
nodes:
  data:  { type: image_text_shards, with: { path: )" << data << R"(/shapes, size: 16, batch: 8 } }
  tok:   { type: wordpiece_tokenize, in: { text: data.captions }, with: { vocab: )" << data << R"(/png/vocab.txt, max_length: 12 } }
  text:  { type: bert_encode, in: { tokens: tok.tokens }, with: { vocab: 90, dim: 16, layers: 1, heads: 2, ffn: 32, max_positions: 16, seed: 7 } }
  model: { type: dit, in: { tokenizer: tok.tokenizer }, with: { patch: 4, in_channels: 3, hidden: 32, depth: 2, heads: 2, mlp_ratio: 2.0, text_dim: 16, t5_dim: 0 } }
  loss:  { type: diffusion_loss, with: { x_key: image, prediction: v, cond_drop: 0.1 } }
  fb:    { type: forward_backward, in: { batch: data.batch, cond: text.emb, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 2.0e-3 } }
)" << extra << R"(
  sample: { type: sampler, at: [end], in: { objective: loss.objective, model: model.params, tokenizer: tok.tokenizer, encoder: text.params },
            with: { prompts: ["a large red circle in the center on a white background", "a small blue square at the top left on a black background"],
                    per_prompt: 3, steps: 8, guidance: 2.0, height: 16, width: 16 } }
)";
  return g.str();
}

TEST(SamplerNode, WritesANonConstantGridAtTheEnd) {
  const std::string data = make_shapes(test::temp_dir("sampler"));
  auto run = test::load_graph_text(shapes_graph(data, 12));
  run->run();
  const std::string png = run->out_dir + "/samples/step_0000012.png";
  ASSERT_TRUE(std::filesystem::exists(png));
  std::ifstream f(png, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const Image img = decode_image(bytes, png);
  EXPECT_EQ(img.w, 3 * 16 + 4 * 2);
  EXPECT_EQ(img.h, 2 * 16 + 3 * 2);
  // Not one flat color: the tiles' pixels spread (a collapsed or constant model gives ~0).
  std::vector<torch::Tensor> rows;
  for (int y = 2; y < 2 + 16; ++y)
    rows.push_back(torch::from_blob(const_cast<uint8_t*>(img.at(2, y)), {16, 3}, torch::kUInt8).to(torch::kFloat));
  EXPECT_GT(torch::cat(rows).std().item<double>(), 5.0);
}

// The sampler's outputs: the samples the grid shows (image, in grid order) and each one's
// prompt, which shapes_fidelity scores into metrics (one figure per prompt, and their mean).
TEST(SamplerNode, OutputsTheGridsSamplesAndTheirPromptsForAnEvaluator) {
  const std::string data = make_shapes(test::temp_dir("sampler_out"));
  auto run = test::load_graph_text(shapes_graph(data, 3) + R"(
  probe: { type: t_batch_probe, at: [end], in: { batch: sample.samples } }
  fid:   { type: shapes_fidelity, at: [end], in: { images: sample.samples, captions: sample.captions } }
  evlog: { type: metrics, at: [end], in: { fidelity: fid.fidelity, per_prompt: fid.per_prompt } }
)");
  const TensorMap samples = test::run_and_probe(*run).at(3);
  ASSERT_TRUE(samples.count("image"));
  const torch::Tensor x = samples.at("image");
  EXPECT_EQ(x.sizes().vec(), (std::vector<int64_t>{6, 3, 16, 16}));
  // Tile (row 1, column 2) of the PNG is sample 1 * 3 + 2.
  const std::string png = run->out_dir + "/samples/step_0000003.png";
  const Image grid = decode_image(test::read_text(png), png);
  const Image tile = tensor_to_image(x[5]);
  for (int y = 0; y < 16; ++y)
    for (int xx = 0; xx < 16; ++xx)
      for (int k = 0; k < 3; ++k)
        ASSERT_EQ(grid.at(2 + 2 * 18 + xx, 2 + 18 + y)[k], tile.at(xx, y)[k]) << xx << "," << y;
  const std::vector<nlohmann::json> m = run->metrics();
  ASSERT_EQ(m.size(), 1u);
  const double a = m[0]["per_prompt/a large red circle in the center on a white background"].get<double>();
  const double b = m[0]["per_prompt/a small blue square at the top left on a black background"].get<double>();
  EXPECT_DOUBLE_EQ(m[0]["fidelity"].get<double>(), (a + b) / 2);
  for (double v : {a, b}) {  // 3 images x 3 checks: a multiple of 100/9
    EXPECT_GE(v, 0);
    EXPECT_LE(v, 100);
    EXPECT_NEAR(v * 9 / 100, std::round(v * 9 / 100), 1e-9);
  }
}

// An objective the sampler has never heard of (registered at run time, as a plugin registers
// one) drives it through the Denoising interface: the sampler asks it for the noise schedule and
// the prediction, and samples. Here it wraps a diffusion_loss's math without being one.
class PluginDenoiser : public Objective, public Denoising {
 public:
  explicit PluginDenoiser(SetupContext&) : math_(options()) {}
  std::vector<std::string> needs() const override { return math_.needs(); }
  torch::Tensor loss(ModelState& m, const TensorMap& b) const override { return math_.loss(m, b); }
  int64_t targets(const TensorMap& b) const override { return math_.targets(b); }
  const Denoising* denoising() const override { return this; }
  const diffusion::NoiseSchedule& noise_schedule() const override {
    ++asked();
    return math_.noise_schedule();
  }
  diffusion::Prediction prediction() const override {
    ++asked();
    return diffusion::Prediction::v;
  }
  static std::atomic<int>& asked() {
    static std::atomic<int> n{0};
    return n;
  }

 private:
  static diffusion::Options options() {
    diffusion::Options o;
    o.x_key = "image";
    o.prediction = diffusion::Prediction::v;
    return o;
  }
  DiffusionLoss math_;
};

TEST(SamplerNode, APluginsDenoisingObjectiveDrivesIt) {
  static std::once_flag once;
  std::call_once(once, [] {
    Registry::global().add(R"(type: t_plugin_denoiser
doc: a denoising objective from outside the built-ins (a test)
stateless: true
outputs: { objective: { kind: state, type: objective, doc: the objective } })",
                           objective_factory<PluginDenoiser>(), "tests");
  });
  const std::string data = make_shapes(test::temp_dir("sampler_plugin"));
  std::string graph = shapes_graph(data, 2);
  const std::string builtin = "loss:  { type: diffusion_loss, with: { x_key: image, prediction: v, cond_drop: 0.1 } }";
  ASSERT_NE(graph.find(builtin), std::string::npos);
  graph.replace(graph.find(builtin), builtin.size(), "loss:  { type: t_plugin_denoiser }");
  auto run = test::load_graph_text(graph);
  run->run();
  EXPECT_GE(PluginDenoiser::asked().load(), 2);  // its schedule and its prediction
  EXPECT_TRUE(std::filesystem::exists(run->out_dir + "/samples/step_0000002.png"));

  // An objective that trains no denoiser is refused at setup, naming it and what is missing.
  std::string on_mse = shapes_graph(data, 1, "  mse: { type: mse_loss }");
  const std::string sampler_reads = "sample: { type: sampler, at: [end], in: { objective: loss.objective";
  ASSERT_NE(on_mse.find(sampler_reads), std::string::npos);
  on_mse.replace(on_mse.find(sampler_reads), sampler_reads.size(),
                 "sample: { type: sampler, at: [end], in: { objective: mse.objective");
  try {
    test::load_graph_text(on_mse)->run();
    FAIL() << "a sampler on mse_loss ran";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("its objective is mse_loss, which trains no denoiser"), std::string::npos)
        << e.what();
  }
}

TEST(SamplerNode, ADivergedModelIsAnErrorNamingTheStep) {
  const std::string data = make_shapes(test::temp_dir("sampler_nan"));
  // The poison node writes 1e30 into every weight after the step's optimizer update: the
  // forward overflows to inf/NaN.
  const std::string poison = "  poison: { type: t_set_params, in: { model: model.params }, with: { value: 1.0e30 } }";
  try {
    test::load_graph_text(shapes_graph(data, 1, poison))->run();  // one step: the optimizer never sees it
    FAIL() << "expected the sampler to refuse NaN samples";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("sample"), std::string::npos) << msg;
    EXPECT_NE(msg.find("not finite"), std::string::npos) << msg;
  }
}

// Latent diffusion end to end: images -> vae_encode (with its decoder) -> a 4-channel dit; the
// sampler decodes its 8x8 latents with that VAE (its vae input) into 16x16 tiles.
TEST(SamplerNode, DecodesLatentsWithTheVaeDecoder) {
  const std::string data = make_shapes(test::temp_dir("sampler_vae"));
  vae::Config vc;
  vc.block_out_channels = {8, 16};
  vc.layers_per_block = 1;
  vc.norm_num_groups = 4;
  vae::AutoencoderKL full(vc);
  vae::init_weights(*full, 3);
  safetensors::Tensors t;
  for (const auto& item : full->named_parameters(true)) t[item.key()] = item.value().detach();
  const std::string weights = data + "/vae.safetensors";
  safetensors::save(weights, t);
  const std::string vae_with = "block_out_channels: [8, 16], layers_per_block: 1, norm_num_groups: 4, weights: " + weights;
  auto graph = [&](const std::string& channels) {
    return R"(
flowrun: 1
run: { steps: 2, seed: 2 }
nodes:
  data:  { type: image_text_shards, with: { path: )" + data + R"(/shapes, size: 16, batch: 4 } }
  tok:   { type: wordpiece_tokenize, in: { text: data.captions }, with: { vocab: )" + data + R"(/png/vocab.txt, max_length: 12 } }
  text:  { type: bert_encode, in: { tokens: tok.tokens }, with: { vocab: 90, dim: 16, layers: 1, heads: 2, ffn: 32, max_positions: 16, seed: 7 } }
  enc:   { type: vae_encode, in: { batch: data.batch }, with: { decoder: true, )" + vae_with + R"( } }
  model: { type: dit, in: { tokenizer: tok.tokenizer }, with: { patch: 2, in_channels: 4, hidden: 32, depth: 2, heads: 2, mlp_ratio: 2.0, text_dim: 16, t5_dim: 0 } }
  loss:  { type: diffusion_loss, with: { x_key: latents } }
  fb:    { type: forward_backward, in: { batch: enc.latents, cond: text.emb, objective: loss.objective, model: model.params } }
  opt:   { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: 1.0e-3 } }
  sample: { type: sampler, at: [end], in: { objective: loss.objective, model: model.params, tokenizer: tok.tokenizer, encoder: text.params,
                                            vae: enc.params },
            with: { prompts: ["a large red circle", "a small blue square"], per_prompt: 3, steps: 3,
                    height: 8, width: 8, channels: )" + channels + R"( } }
)";
  };
  auto run = test::load_graph_text(graph("4"));
  run->run();
  const std::string png = run->out_dir + "/samples/step_0000002.png";
  ASSERT_TRUE(std::filesystem::exists(png));
  std::ifstream f(png, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const Image img = decode_image(bytes, png);
  EXPECT_EQ(img.w, 3 * 16 + 4 * 2);  // 8x8 latents decoded to 16x16 tiles
  EXPECT_EQ(img.h, 2 * 16 + 3 * 2);

  // decode_latents is decode(z / scaling_factor), row by row.
  vae::AutoencoderKL dec(vc, vae::Part::decoder);
  vae::load_safetensors(*dec, weights);
  const torch::Tensor z = torch::randn({2, 4, 8, 8});
  torch::NoGradGuard no_grad;
  const torch::Tensor x = decode_latents(*vae::make_vae_state(dec), z);
  EXPECT_EQ(x.sizes().vec(), (std::vector<int64_t>{2, 3, 16, 16}));
  EXPECT_TRUE(torch::allclose(x, full->decode(z / 0.18215), 1e-5, 1e-5));

  // channels must be the VAE's latent channels: a setup error naming the node.
  try {
    test::load_graph_text(graph("3"));
    FAIL() << "no error";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'sample'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("channels is 3 but the vae's latent channels are 4"), std::string::npos) << msg;
  }
  // Issue 47: a VAE of its own (the old `vae:` settings) is refused, saying how to wire the graph's.
  std::string old_way = graph("4");
  old_way.replace(old_way.rfind("channels: 4"), 11, "channels: 4, vae: { weights: null }");  // the sampler's
  try {
    test::load_graph_text(old_way);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the sampler's vae settings moved"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flowrun
