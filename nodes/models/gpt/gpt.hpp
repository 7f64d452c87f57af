// GPT-2 as a libtorch module, laid out exactly like Hugging Face transformers' GPT2LMHeadModel
// so that its model.safetensors loads by name. Used by the gpt node (gpt.cpp) and directly by
// tests and benchmarks.
//
//   wte.weight [vocab, dim]          token embedding; also the LM head (tied, no lm_head.weight)
//   wpe.weight [context, dim]        learned position embedding
//   h.N.ln_1.weight/bias [dim]       pre-attention LayerNorm (eps 1e-5)
//   h.N.attn.c_attn.weight [dim, 3*dim], .bias [3*dim]   fused q|k|v projection
//   h.N.attn.c_proj.weight [dim, dim], .bias [dim]
//   h.N.ln_2.weight/bias [dim]
//   h.N.mlp.c_fc.weight [dim, 4*dim], .bias [4*dim]      GELU tanh approximation ("gelu_new")
//   h.N.mlp.c_proj.weight [4*dim, dim], .bias [dim]
//   ln_f.weight/bias [dim]
//
// Linear layers are HF's Conv1D: weight [in, out] and y = x @ W + b (the transpose of
// torch.nn.Linear; lora::Linear with fan_in_fan_out), so HF tensors are stored and loaded as
// they are, and LoRA adapters export as PEFT's for GPT-2. The module has no
// buffers: HF's h.N.attn.bias / masked_bias are a causal mask, kept here in a cache outside
// the state dict.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "models/activation_checkpoint.hpp"
#include "models/family.hpp"
#include "models/layers.hpp"
#include "models/generate.hpp"
#include "models/lora.hpp"
#include "models/model_state.hpp"

namespace flowrun::gpt {

struct Config {
  int64_t layers = 12, dim = 768, heads = 12, vocab = 50257, context = 1024;
  double dropout = 0.0;  // HF's embd_pdrop = attn_pdrop = resid_pdrop (see models/dropout.hpp)
  CheckpointPolicy checkpoint;  // blocks recomputed in backward (models/activation_checkpoint.hpp)
  // Tensor parallel (Megatron-LM's split, parallel/tensor_parallel.hpp): each rank of the group
  // holds heads/tp of each attention's heads (c_attn split by its q, k and v columns, c_proj by
  // its input rows), hidden/tp of each MLP's units (c_fc by columns, c_proj by rows) and vocab/tp
  // rows of the token table, so of the tied head's logits (forward gives [B, T, vocab/tp], which
  // parallel::vocab_parallel_cross_entropy scores); the position table, the LayerNorms and the
  // biases added after a sum are whole on every rank. A block costs one all-reduce forward and
  // one backward per sub-layer. Null or a group of one: the whole model (run.parallel.tp: gpt_node.cpp).
  std::shared_ptr<parallel::Group> tp;
  // Pipeline parallel (run.parallel.pp > 1, models/stages.hpp): the chunks this rank holds; the
  // module then has only their blocks (under their whole model's names), wpe with chunk 0, ln_f
  // with the last, and wte with either (the last chunk's is a copy of the tied table:
  // Stages::tied). Null: the whole model.
  std::shared_ptr<const Stages> stages;
  bool staged() const { return stages != nullptr; }
  bool holds_block(int64_t i) const { return !stages || stages->holds_block(static_cast<int>(i)); }
  bool holds_embedding() const { return !stages || stages->first(); }
  bool holds_head() const { return !stages || stages->last(); }
  void check() const;    // throws on dim % heads != 0, heads % tp != 0, non-positive sizes, dropout outside [0, 1)
};
// How whole tensor `name` (HF's name, "h.3.attn.c_attn.weight") is laid out over the tp group.
parallel::TpSplit tp_split(const std::string& name);
// GPT as its node's layout machinery reads it (models/family.hpp): the split above, blocks of
// 12 dim^2 products a token and the tied head's vocab x dim, the head tied to wte, logits split
// over the vocabulary under tp, init_parameter's init tensor by tensor.
Family family(const Config& c);
// The whole model's parameters of config `c` in init order, with their shapes on this rank.
ParamOrder whole_order(const Config& c);
// "layers=12 dim=768 heads=12 vocab=50257 context=1024", for messages.
std::string describe(const Config& c);

// ---- leaf modules (own their parameters; reset() only allocates, init is separate) ----

// HF Conv1D (weight [in, out], y = x @ W + b): lora::Linear in that layout, so that LoRA
// adapters (the gpt node's `lora`) apply to c_attn, c_proj, c_fc as PEFT applies them.
inline lora::Linear conv1d(int64_t in, int64_t out) { return lora::Linear(in, out, /*bias=*/true, /*fan_in_fan_out=*/true); }

using layers::LayerNorm;  // eps 1e-5, weight and bias (models/layers.hpp)

using layers::Embedding;  // wte, wpe (models/layers.hpp)
using layers::EmbeddingImpl;

// The causal masks the attention adds to its scores when attention dropout is on (otherwise
// self_attention masks by itself): [T, T], 0 on and below the diagonal,
// -inf above. One per (dtype, device), for the largest T asked so far; a smaller T takes its
// top-left corner (a view). Shared by a model and its clones; thread-safe, because two
// readers of one model (forward_backward, an evaluator) may run its forward at once.
class CausalMaskCache {
 public:
  torch::Tensor get(int64_t T, const torch::TensorOptions& opts);

 private:
  std::mutex mu_;
  std::map<std::string, torch::Tensor> masks_;  // key: dtype + device
};

// ---- blocks ----

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(int64_t dim, int64_t heads, double dropout, std::shared_ptr<CausalMaskCache> masks,
                std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), heads_(heads), dropout_(dropout), masks_(std::move(masks)), tp_(std::move(tp)) { reset(); }
  void reset() override;
  // x: [B*T, dim] (rows in batch-major order) -> [B*T, dim]
  torch::Tensor forward(const torch::Tensor& x, int64_t B, int64_t T);
  // Generation (models/generate.hpp): x [B*t, dim], its keys and values appended to `cache`, the
  // queries attending over all it holds as `mask` [B, 1, t, L] says. A whole model only.
  torch::Tensor decode(const torch::Tensor& x, int64_t B, int64_t t, const torch::Tensor& mask,
                       std::pair<torch::Tensor, torch::Tensor>& cache);
  lora::Linear c_attn{nullptr}, c_proj{nullptr};  // with tp: this rank's heads' columns / rows

 private:
  int64_t dim_, heads_;
  double dropout_;
  std::shared_ptr<CausalMaskCache> masks_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(Attention);

// c_fc (Conv1D [dim, 4*dim]) -> gelu_new -> c_proj (Conv1D [4*dim, dim]): the shared MLP.
inline layers::MlpOptions mlp_options(std::shared_ptr<parallel::Group> tp = nullptr) {
  return {"c_fc", "c_proj", layers::Act::gelu_tanh, "", true, /*fan_in_fan_out=*/true, 0, std::move(tp)};
}

class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  BlockImpl(int64_t dim, int64_t heads, double dropout, std::shared_ptr<CausalMaskCache> masks,
            std::shared_ptr<parallel::Group> tp = nullptr)
      : dim_(dim), heads_(heads), dropout_(dropout), masks_(std::move(masks)), tp_(std::move(tp)) { reset(); }
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x, int64_t B, int64_t T);
  torch::Tensor decode(const torch::Tensor& x, int64_t B, int64_t t, const torch::Tensor& mask,
                       std::pair<torch::Tensor, torch::Tensor>& cache);
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  layers::Mlp mlp{nullptr};  // mlp_options(); its output dropped out (resid_pdrop) by the block

 private:
  int64_t dim_, heads_;
  double dropout_;
  std::shared_ptr<CausalMaskCache> masks_;
  std::shared_ptr<parallel::Group> tp_;
};
TORCH_MODULE(Block);

// ---- the model ----

class GptImpl : public torch::nn::Cloneable<GptImpl> {
 public:
  explicit GptImpl(Config cfg);
  void reset() override;
  // idx: integer token ids [B, T] with T <= context -> logits [B, T, vocab]. The whole model only.
  torch::Tensor forward(const torch::Tensor& idx);
  // Generation (ModelState::CausalLm): ids [B, t] at positions [B, t] over the cache and themselves
  // (`mask` [B, 1, t, L]), the cache grown by t -> logits [B, t, vocab]. The whole model only.
  torch::Tensor decode(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask, KvCache& cache);
  // Pipeline chunk k (Config::stages) on idx [B, T]: from chunk k - 1's {"x": [B*T, dim]} (chunk
  // 0: the embedding of idx) to chunk k + 1's {"x"}, or the last chunk's {"output": logits}.
  TensorMap chunk(int k, const torch::Tensor& idx, const TensorMap& in);
  const Config& config() const { return cfg_; }

  Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  LayerNorm ln_f{nullptr};

 private:
  torch::Tensor embed(const torch::Tensor& idx);                              // -> x [B*T, dim]
  torch::Tensor blocks(torch::Tensor x, int64_t first, int64_t last, int64_t B, int64_t T);
  torch::Tensor head(const torch::Tensor& x, int64_t B, int64_t T);           // -> logits
  Config cfg_;
  std::shared_ptr<CausalMaskCache> masks_;
};
TORCH_MODULE(Gpt);

// GPT-2's initialisation (HF GPT2PreTrainedModel._init_weights): every weight ~ N(0, 0.02),
// the residual projections (attn.c_proj.weight, mlp.c_proj.weight) ~ N(0, 0.02/sqrt(2*layers)),
// biases 0, LayerNorm gains 1. Drawn in parameter order from a generator seeded by `seed`
// alone (never torch's global one).
void init_weights(GptImpl& model, uint64_t seed);
// What init_weights does to one parameter, by its name (whole tensors of a model of config
// `c`), drawing from `g`: a split or staged model inits tensor by tensor (family.hpp init_declared).
void init_parameter(const Config& c, const std::string& name, torch::Tensor& p, at::Generator& g);
at::Generator init_generator(uint64_t seed);  // init_weights' generator

// Copy a Hugging Face GPT-2 state dict into the model (with tp: each rank's part of the whole
// tensors, tp_split). Names may carry the "transformer."
// prefix or not; HF's buffers (h.N.attn.bias, h.N.attn.masked_bias) are ignored; lm_head.weight,
// if present, must equal wte.weight (the head is tied). Every parameter must be given with
// its exact shape (any float dtype; converted). All problems — missing, unexpected and
// mis-shaped tensors — are reported in one error that starts with `source` (the file name).
void load_hf_state_dict(GptImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source);
// Reads a model.safetensors file (nodes/common/safetensors.hpp) and loads it as above.
void load_hf_safetensors(GptImpl& model, const std::string& path);
// The config.json of GPT2LMHeadModel for config `c` (the reverse of the node's `pretrained`): its
// sizes, gelu_new, LayerNorm eps 1e-5, the tied head, the dropout as attn/embd/resid_pdrop. The
// weights go with it under "transformer." + this module's names (HF's, Conv1D layout as they are).
nlohmann::json hf_config(const Config& c);

// The ModelState of the gpt node: forward(batch) reads batch["tokens"], integer [B, T+1],
// and returns the logits [B, T, vocab] for the inputs tokens[:, :-1] (the targets are
// tokens[:, 1:]: see the lm objective in train/forward_backward.cpp). A staged model (pipeline
// parallel) gets its ModelState::stages, and its forward is staged_forward (models/stages.hpp).
std::shared_ptr<ModelState> make_state(Gpt model);

}  // namespace flowrun::gpt
