// The decoder-only family of today's language models — Llama 3 / 3.1 / 3.2, Qwen 2 / 2.5 / 3,
// Mistral — as a libtorch module laid out exactly like Hugging Face transformers'
// LlamaForCausalLM (Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM: the same names), so
// that their safetensors load by name:
//
//   model.embed_tokens.weight [vocab, dim]
//   model.layers.N.input_layernorm.weight [dim]                    RMSNorm (eps: norm_eps)
//   model.layers.N.self_attn.q_proj.weight [heads*head_dim, dim]   (+ .bias with qkv_bias)
//   model.layers.N.self_attn.k_proj.weight [kv_heads*head_dim, dim] (+ .bias)
//   model.layers.N.self_attn.v_proj.weight [kv_heads*head_dim, dim] (+ .bias)
//   model.layers.N.self_attn.o_proj.weight [dim, heads*head_dim]   (+ .bias with o_bias)
//   model.layers.N.self_attn.q_norm.weight [head_dim]              with qk_norm (Qwen 3): RMSNorm of each
//   model.layers.N.self_attn.k_norm.weight [head_dim]              query and key head, before the rotation
//   model.layers.N.post_attention_layernorm.weight [dim]
//   model.layers.N.mlp.gate_proj.weight [mlp_dim, dim]             SwiGLU: down(silu(gate x) * up x)
//   model.layers.N.mlp.up_proj.weight [mlp_dim, dim]
//   model.layers.N.mlp.down_proj.weight [dim, mlp_dim]
//   model.norm.weight [dim]
//   lm_head.weight [vocab, dim]                                    absent when tied to embed_tokens
//
// Mixtures of experts (Qwen 3 MoE, Mixtral; Config::moe, models/moe.hpp): a sparse layer's MLP is
// routed experts, under transformers 5's names (files saved per expert are fused as they load):
//   model.layers.N.mlp.gate.weight [experts, dim]                  the router
//   model.layers.N.mlp.experts.gate_up_proj [experts, 2*expert_dim, dim]
//   model.layers.N.mlp.experts.down_proj [experts, dim, expert_dim]
//
// Attention is causal and grouped-query: heads/kv_heads query heads share each key/value head
// (head h reads kv head h / (heads/kv_heads), transformers' repeat_kv), with rotary positions
// (models/rotary.hpp: rope_theta and rope_scaling). Linear layers are lora::Linear (torch's
// layout, weight [out, in]), so LoRA targets them by name (q_proj, v_proj, ...) as PEFT does.
//
// Tensor parallel (Megatron-LM's split, parallel/tensor_parallel.hpp; Config::tp): each rank holds
// heads/tp query heads (q_proj by its output rows, o_proj by its input columns), mlp_dim/tp of the
// MLP's units (gate and up by rows, down by columns) and vocab/tp rows of the token table and of
// the head, so the forward gives this rank's columns of the logits (scored by the
// vocabulary-parallel cross-entropy). The key/value heads split with the query heads when tp
// divides kv_heads; otherwise (tp > kv_heads, as Megatron and vLLM do) k_proj and v_proj are whole
// on every rank, each rank reads the kv heads its query heads use, and their gradients are summed
// over the group. Norms whole. Experts (a mixture of experts' expert tensors) split over the ep
// ranks by their dim 0 (Config::ep; parallel/expert_parallel.hpp). Pipeline parallel (Config::stages): a rank holds its chunks' blocks,
// the embedding with chunk 0, the final norm and the head with the last (and the tied table there
// as a copy). The family's declaration for the machinery that does the rest: family().
//
// Used by the llama node (llama_node.cpp) and by tests.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "models/activation_checkpoint.hpp"
#include "models/family.hpp"
#include "models/layers.hpp"
#include "models/generate.hpp"
#include "models/lm_batch.hpp"
#include "models/lora.hpp"
#include "models/model_state.hpp"
#include "models/moe.hpp"
#include "models/rotary.hpp"

namespace flowrun::llama {

// A mixture of experts in place of the MLP in the sparse layers (experts > 0), as transformers'
// Qwen3MoeConfig and MixtralConfig say it.
struct MoeConfig {
  int64_t experts = 0;      // num_experts (Mixtral: num_local_experts); 0: every layer dense
  int64_t top_k = 2;        // num_experts_per_tok
  int64_t expert_dim = 0;   // moe_intermediate_size (Mixtral: intermediate_size)
  bool norm_topk_prob = true;  // the top_k probabilities renormalised to sum to 1 (Mixtral: always)
  int64_t sparse_step = 1;  // decoder_sparse_step: layer i sparse when (i + 1) % sparse_step == 0
  std::vector<int64_t> mlp_only_layers;  // dense (mlp_dim) whatever sparse_step says
  bool aux_loss = false;       // output_router_logits: the load-balancing loss joins the objective's
  double aux_loss_coef = 0.001;  // router_aux_loss_coef, its weight
  double z_loss_coef = 0;        // the router's z-loss weight (the node's router_z_loss; 0: off)
  // A loss of the routers joins the objective's (the load-balancing loss, the z-loss).
  bool router_loss() const { return aux_loss || z_loss_coef > 0; }
  bool on() const { return experts > 0; }
  bool sparse(int64_t layer) const;
};

struct Config {
  int64_t layers = 16, dim = 2048, heads = 32, kv_heads = 8, head_dim = 0, mlp_dim = 8192, vocab = 128256,
          context = 131072;
  double rope_theta = 500000.0;
  RopeScaling rope_scaling;
  double norm_eps = 1e-5;
  bool tie_embeddings = true;
  bool qkv_bias = false;  // q, k and v projections with a bias (Qwen 2; Llama's attention_bias)
  bool o_bias = false;    // the output projection with one (Llama's attention_bias)
  bool mlp_bias = false;  // the MLP's projections with one (Llama's mlp_bias)
  bool qk_norm = false;   // RMSNorm over each query and key head before the rotary positions (Qwen 3)
  MoeConfig moe;          // routed experts in the sparse layers (Qwen 3 MoE, Mixtral)
  CheckpointPolicy checkpoint;  // blocks recomputed in backward (models/activation_checkpoint.hpp)
  // transformers' model_type a saved folder names (llama, qwen2, mistral): the folder's it was
  // read from; "" for a model from its sizes (hf_config picks the class the biases allow).
  std::string model_type;
  // The layout (the node's run.parallel; null: whole, one stage): this rank's place among the tp
  // ranks, and its pipeline chunks (models/stages.hpp).
  std::shared_ptr<parallel::Group> tp;
  std::shared_ptr<const Stages> stages;
  // Expert parallel (run.parallel.ep > 1, a mixture of experts only): this rank's place among the ep
  // ranks, which split each sparse layer's experts (models/moe.hpp).
  std::shared_ptr<parallel::Group> ep;
  // Each head's width: head_dim, or dim / heads when 0 (transformers' default).
  int64_t head_size() const { return head_dim > 0 ? head_dim : dim / heads; }
  int64_t tp_size() const { return tp ? tp->size() : 1; }
  // Whether the key/value heads split over tp (tp divides kv_heads) or are whole on every rank.
  bool kv_split() const { return kv_heads % tp_size() == 0; }
  bool staged() const { return stages != nullptr; }
  bool holds_block(int64_t i) const { return !stages || stages->holds_block(static_cast<int>(i)); }
  bool holds_embedding() const { return !stages || stages->first() || (tie_embeddings && stages->last()); }
  bool holds_head() const { return !stages || stages->last(); }
  // Throws naming the setting: heads % kv_heads, dim % heads without head_dim, odd head size, heads,
  // mlp_dim or vocab that tp does not divide, stages that do not cover the layers, ...
  void check() const;
  double parameter_count() const;
};
// "layers=16 dim=2048 heads=32 kv_heads=8 head_dim=64 mlp_dim=8192 vocab=128256 rope llama3 (...)", for messages.
std::string describe(const Config& c);
// How whole tensor `name` (HF's) of a model of config `c` lies over its tp group (above).
parallel::TpSplit tp_split(const Config& c, const std::string& name);
// The family's declaration (models/family.hpp): tp_split; blocks costing their products per
// token, the head's vocab x dim; the tied table; logits split over the vocabulary under tp;
// init_parameter's init tensor by tensor.
Family family(const Config& c);
// The whole model's parameters of config `c` in init order, with their shapes on this rank.
ParamOrder whole_order(const Config& c);
// What a block keeps for backward a token, in units of dim 2-byte values (Korthikanti et al.'s
// count for this shape; activation_checkpoint.hpp): whole on every tp rank, the two norms' inputs
// and the attention's and MLP's (8); split, q and the kv heads expanded to the query heads, the
// output projection's input (8 q_width/dim), and the SwiGLU's gate, up, silu and product
// (8 mlp_dim/dim). No dropout.
BlockUnits block_units(const Config& c);

// ---- blocks ----

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  explicit AttentionImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  // x [B*T, dim] (rows batch-major), cos and sin [T, head_dim] (or [B, 1, T, head_dim]: a packed
  // batch's positions) -> [B*T, dim]; `mask` [B, 1, T, T], additive: 0 where a query may attend
  // within its document, -inf elsewhere (a packed batch), on top of the causal mask; or undefined.
  // With `cache` (generation, models/generate.hpp): these T positions' keys and values are appended
  // to it and the queries attend over all it holds, `mask` [B, 1, T, L] alone saying which (no
  // causal mask of its own).
  torch::Tensor forward(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {}, std::pair<torch::Tensor, torch::Tensor>* cache = nullptr);
  lora::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};  // with tp: this rank's heads
  layers::RmsNorm q_norm{nullptr}, k_norm{nullptr};  // with qk_norm; whole on every tp rank

 private:
  Config c_;
  torch::Tensor kv_of_head_;  // tp > kv_heads: the kv head each of this rank's query heads reads
};
TORCH_MODULE(Attention);

class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  // Block `index` of the model (a mixture of experts' sparse layers are some of them).
  BlockImpl(const Config& c, int64_t index) : c_(c), index_(index) { reset(); }
  void reset() override;
  // `routing`, in a sparse layer, gets what its router decided.
  torch::Tensor forward(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask = {}, std::pair<torch::Tensor, torch::Tensor>* cache = nullptr,
                        moe::Routing* routing = nullptr);
  layers::RmsNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  Attention self_attn{nullptr};
  layers::Mlp mlp{nullptr};  // gate_proj, up_proj, down_proj (layers::Mlp's fc1, gate, fc2); null in a sparse layer
  moe::Moe experts{nullptr};  // a sparse layer's, registered as "mlp"

 private:
  Config c_;
  int64_t index_;
};
TORCH_MODULE(Block);

// transformers' LlamaModel: the embedding, the blocks and the final norm (the "model." prefix).
class BodyImpl : public torch::nn::Cloneable<BodyImpl> {
 public:
  explicit BodyImpl(const Config& c) : c_(c) { reset(); }
  void reset() override;
  layers::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  layers::RmsNorm norm{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Body);

// ---- the model ----

class LlamaImpl : public torch::nn::Cloneable<LlamaImpl> {
 public:
  explicit LlamaImpl(Config cfg);
  void reset() override;
  // idx: integer token ids [B, T], T <= context -> logits [B, T, vocab] (under tp this rank's
  // vocab/tp columns), positions 0..T-1. The whole model only.
  // `rows` (lm_loss_rows): the logits of those positions only, [M, vocab].
  torch::Tensor forward(const torch::Tensor& idx, const LmPacking& packing = {}, const torch::Tensor& rows = {});
  // Pipeline chunk k (Config::stages) on idx [B, T]: from chunk k - 1's {"x": [B*T, dim]} (chunk 0:
  // the embedding of idx) to chunk k + 1's {"x"}, or the last chunk's {"output": logits}.
  TensorMap chunk(int k, const torch::Tensor& idx, const TensorMap& in, const LmPacking& packing = {});
  // Generation (ModelState::CausalLm): ids [B, t] at positions [B, t] over the cache and themselves
  // (`mask` [B, 1, t, L]), the cache grown by t -> logits [B, t, vocab]. The whole model only.
  torch::Tensor decode(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask, KvCache& cache);
  const Config& config() const { return cfg_; }
  // A mixture of experts with a router loss: aux_loss_coef x the load-balancing loss of the last
  // forward with grad (transformers' over every sparse layer's router) plus z_loss_coef x its
  // router z-loss, for forward_backward to add (ModelState::extra_loss); undefined otherwise. The experts' token counts of that forward,
  // [sparse layers, experts]. (No-grad forwards, an evaluator's, change neither.)
  torch::Tensor aux_loss() const { return aux_loss_; }
  torch::Tensor expert_counts() const { return counts_; }
  // The counts of every forward with grad since the last call, summed, as moe::load_metrics
  // names them (ModelState::take_routing_metrics); they start again.
  std::vector<std::pair<std::string, double>> take_routing_metrics();

  Body model{nullptr};
  lora::Linear lm_head{nullptr};  // null when tied (the logits use model.embed_tokens.weight) and on a stage before the last

 private:
  torch::Tensor embed(const torch::Tensor& idx);  // -> x [B*T, dim]
  torch::Tensor blocks(torch::Tensor x, int64_t first, int64_t last, int64_t B, int64_t T, const LmPacking& packing);
  torch::Tensor head(const torch::Tensor& x, int64_t B, int64_t T, const torch::Tensor& rows = {});  // -> logits
  Config cfg_;
  Rope rope_;
  torch::Tensor aux_loss_, counts_;
  std::map<int64_t, torch::Tensor> counts_since_;  // sparse layer -> its tokens per expert since the last take
};
TORCH_MODULE(Llama);

// transformers' _init_weights for these families, one whole parameter by name (the family's
// init_one, drawn in parameter order: init_declared): every linear and embedding weight ~ N(0,
// 0.02) (initializer_range), biases 0, RMSNorm gains 1, from `g`, the generator init_generator
// makes from the seed alone. LoRA adapters keep apply_lora's init.
void init_parameter(const std::string& name, torch::Tensor& p, at::Generator& g);
at::Generator init_generator(uint64_t seed);

// A Hugging Face state dict into the model (names as above; the "model." prefix as transformers
// saves it). Ignored: the rotary inv_freq buffers older files carry; with a tied head, an
// lm_head.weight equal to the embedding. Every parameter must be given with its shape (any float
// dtype; converted); with `lora`, the adapters are optional. All problems in one error that starts
// with `source`. Split or staged, each rank takes its parts of the tensors its stage holds.
void load_hf_state_dict(LlamaImpl& model, const std::map<std::string, torch::Tensor>& tensors, const std::string& source);

// The config.json of a folder transformers loads this model from (its from_pretrained): the sizes,
// rotary positions in transformers 4's form (rope_theta, rope_scaling; transformers 5 reads it
// too), the biases as the class has them. LlamaForCausalLM unless the config says qwen2, qwen3 or
// mistral; q/k/v biases without an o bias are Qwen2ForCausalLM's, q/k norms Qwen3ForCausalLM's. Biases no class has (o without
// q/k/v, or q/k/v and the MLP's without o) are refused.
nlohmann::json hf_config(const Config& c);
// How the model type's files name the experts one by one (Mixtral's block_sparse_moe.experts.E.w1,
// Qwen 3 MoE's mlp.experts.E.gate_proj): what loading fuses and saving writes.
moe::PerExpertNames expert_file_names(const Config& c);
// The ModelState of the llama node: forward(batch) reads batch["tokens"], integer [B, T+1], and
// returns the logits [B, T, vocab] of the inputs tokens[:, :-1] (the lm objective scores them
// against tokens[:, 1:]), as the gpt node's.
std::shared_ptr<ModelState> make_state(Llama model);

}  // namespace flowrun::llama
