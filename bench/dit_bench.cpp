// The DiT graph (image_text_shards -> tokenize -> bert_encode -> dit forward_backward ->
// optimizer) against the same work as a hand-written serial loop (read and decode the batch,
// tokenize, encode the captions, then the training step), in one process, alternating rounds
// (median of 3). In the graph the data, tokenizer and frozen encoder are value-only nodes, so
// the executor runs them up to `prefetch` steps ahead, beside the training step; the loop pays
// for them every step. Images/s = steps * batch / seconds.
// Two encoder sizes: the demo's (BERT 2 x 64, graphs/dit_base.yaml) and a heavier one (BERT
// 4 x 256, 32 tokens), where encoding is a larger share of the step, as HunyuanDiT's frozen
// CLIP-BERT + mT5 are next to its DiT. Each with all cores in torch's intra-op pool and with
// one thread per op. Data: the shapes set of scripts/data.sh. Usage:
//   ./build/bench/dit_bench [--steps 20] [--data data/shapes/base] [--vocab data/shapes/vocab.txt]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>

#include "bench_graph.hpp"
#include "data/image_text_shards.hpp"
#include "encode/text_encode.hpp"
#include "encode/tokenize.hpp"
#include "formats/wordpiece.hpp"
#include "models/bert.hpp"
#include "models/dit/dit.hpp"
#include "registry.hpp"
#include "spec.hpp"
#include "train/forward_backward.hpp"
#include "train/losses.hpp"
#include "train/optimizer.hpp"

using namespace flowrun;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kBatch = 32, kSize = 32;
constexpr double kLr = 1e-3;
constexpr uint64_t kSeed = 1;

struct Enc {
  const char* name;
  int64_t dim, layers, heads, ffn, max_length;
};

dit::Config dit_config(const Enc& e) {  // the graph's model (its other settings the schema's defaults)
  dit::Config c;
  c.patch = 4, c.in_channels = 3, c.hidden = 128, c.depth = 4, c.heads = 4, c.mlp_ratio = 4.0;
  c.text_dim = e.dim, c.t5_dim = 0, c.text_len = e.max_length;
  return c;
}

// The hand-written loop: what a user writes without flowrun, over the same code.
double hand_loop(const std::string& data, const std::string& vocab, const Enc& e, int steps) {
  auto shards = std::make_shared<const ImageTextShards>(data, "train", OnBad::Skip, false);
  ImageTextDataset ds({{"train", shards}}, static_cast<int>(kSize));
  auto tok = WordPieceTokenizer::load(vocab, e.max_length);
  bert::Config bc;
  bc.vocab = 128, bc.dim = e.dim, bc.layers = e.layers, bc.heads = e.heads, bc.ffn = e.ffn, bc.max_positions = 64;
  bert::Bert b(bc);
  bert::init_weights(*b, kSeed);
  auto enc = make_text_encoder_state(b.ptr(), "bert");
  dit::Dit m(dit_config(e));
  dit::init_weights(*m, kSeed);
  auto model = dit::make_state(m);
  diffusion::Options objective_options;
  objective_options.x_key = "image";
  objective_options.prediction = diffusion::Prediction::v;
  objective_options.cond_drop = 0.1;
  const DiffusionLoss objective(objective_options);
  OptimizerState st;
  OptimConfig cfg;
  const int64_t per_epoch = ds.num_batches("train", kBatch, 0, 1);
  auto t0 = Clock::now();
  for (int s = 1; s <= steps; ++s) {
    const int64_t i = (s - 1) % per_epoch;
    TensorMap batch = ds.batch("train", i, kBatch, 0, 1);
    const TensorMap cond = encode_text(*enc, encode_texts(*tok, ds.captions("train", i, kBatch, 0, 1)));
    FwdBwdOptions o;
    o.dropout_seed = static_cast<uint64_t>(s);
    FwdBwdResult r = forward_backward(*model, merge_batches(batch, cond), objective, o);
    optimizer_update(st, model->named_parameters(true), r.grads, cfg, kLr);
  }
  return steps * kBatch / std::chrono::duration<double>(Clock::now() - t0).count();
}

// The same work as a flowrun graph.
double graph_run(const std::string& data, const std::string& vocab, const Enc& e, int steps, int prefetch) {
  std::ostringstream y;
  y << "flowrun: 1\nrun: { steps: " << steps << ", seed: " << kSeed << ", prefetch: " << prefetch
                      << ", progress: off }\nnodes:\n"
                      << "  data: { type: image_text_shards, with: { path: " << data << ", size: " << kSize
                      << ", batch: " << kBatch << " } }\n"
                      << "  tok: { type: wordpiece_tokenize, in: { text: data.captions }, with: { vocab: " << vocab
                      << ", max_length: " << e.max_length << " } }\n"
                      << "  text: { type: bert_encode, in: { tokens: tok.tokens }, with: { vocab: 128, dim: " << e.dim
                      << ", layers: " << e.layers << ", heads: " << e.heads << ", ffn: " << e.ffn << ", max_positions: 64 } }\n"
                      << "  model: { type: dit, in: { tokenizer: tok.tokenizer }, with: { patch: 4, in_channels: 3, hidden: 128, depth: 4, heads: 4, "
                         "mlp_ratio: 4.0, text_dim: "
                      << e.dim << ", t5_dim: 0 } }\n"
                      << "  loss: { type: diffusion_loss, with: { x_key: image, prediction: v, cond_drop: 0.1 } }\n"
                      << "  fb: { type: forward_backward, in: { batch: data.batch, cond: text.emb, objective: loss.objective, "
                         "model: model.params } }\n"
                      << "  opt: { type: optimizer, in: { grads: fb.grads, model: model.params }, with: { lr: " << kLr
                      << " } }\n";
  return steps * kBatch / bench::time_graph("dit_bench", y.str(), steps, kSeed, prefetch);
}

void compare(const std::string& data, const std::string& vocab, const Enc& e, int steps, int threads) {
  at::set_num_threads(threads);
  std::vector<double> loop, graph;
  hand_loop(data, vocab, e, 2);  // warm up allocators and code paths
  for (int round = 0; round < 3; ++round) {
    loop.push_back(hand_loop(data, vocab, e, steps));
    graph.push_back(graph_run(data, vocab, e, steps, 4));
  }
  const double l = bench::median(loop), gr = bench::median(graph);
  std::printf("%-14s BERT %lldx%-4lld %2lld tokens  torch threads %d   serial loop %6.1f images/s   flowrun prefetch 4 %6.1f images/s   ratio %.3f\n",
              e.name, (long long)e.layers, (long long)e.dim, (long long)e.max_length, threads, l, gr, gr / l);
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 20;
  std::string data = "data/shapes/base", vocab = "data/shapes/vocab.txt";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--steps") steps = std::stoi(argv[i + 1]);
    else if (a == "--data") data = argv[i + 1];
    else if (a == "--vocab") vocab = argv[i + 1];
    else return std::fprintf(stderr, "unknown option %s\n", a.c_str()), 2;
  }
  if (!ImageTextShards::exists(data, "train") || !std::filesystem::exists(vocab))
    return std::fprintf(stderr, "%s.train-*.tar or %s is missing: run scripts/data.sh\n", data.c_str(), vocab.c_str()), 2;
  std::printf("DiT 4 x 128, patch 4, %lldx%lld pixels, batch %lld, v-prediction; %d steps per round, median of 3 rounds\n",
              (long long)kSize, (long long)kSize, (long long)kBatch, steps);
  // Every core to torch's intra-op pool (the default), then one thread per op: the serial
  // loop then leaves the other core idle, which the graph fills with the next steps' reading
  // and encoding (as a GPU's copy and encoder streams would be filled).
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int threads : {cores, 1}) {
    compare(data, vocab, {"demo encoder", 64, 2, 4, 128, 16}, steps, threads);
    compare(data, vocab, {"heavy encoder", 256, 4, 4, 1024, 32}, steps, threads);
  }
  return 0;
}
