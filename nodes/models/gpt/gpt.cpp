// GPT-2 as a libtorch module (Hugging Face GPT2LMHeadModel layout): init, loading, the state.
// Names and math: gpt.hpp. The node type gpt: gpt_node.cpp. Test: tests/nodes/gpt_test.cpp.
#include "models/gpt/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <regex>
#include <sstream>

#include "common/safetensors.hpp"
#include "common/seed.hpp"
#include "models/attention.hpp"
#include "models/dropout.hpp"
#include "models/linear.hpp"
#include "models/lm_batch.hpp"
#include "models/load_by_name.hpp"

namespace flowrun::gpt {

std::string describe(const Config& c) {
  std::ostringstream s;
  s << "layers=" << c.layers << " dim=" << c.dim << " heads=" << c.heads << " vocab=" << c.vocab
    << " context=" << c.context;
  return s.str();
}

void Config::check() const {
  if (layers < 1 || dim < 1 || heads < 1 || vocab < 1 || context < 1)
    throw std::runtime_error("gpt: layers, dim, heads, vocab and context must be >= 1 (" + describe(*this) + ")");
  if (dim % heads != 0)
    throw std::runtime_error("gpt: dim " + std::to_string(dim) + " is not a multiple of heads " +
                             std::to_string(heads) + " (each head gets dim/heads channels)");
  if (!(dropout >= 0.0 && dropout < 1.0))
    throw std::runtime_error("gpt: dropout must be in [0, 1), got " + std::to_string(dropout));
  if (tp && heads % tp->size() != 0)
    throw std::runtime_error("gpt: heads " + std::to_string(heads) + " do not split into " +
                             std::to_string(tp->size()) + " tensor-parallel parts; choose run.parallel.tp dividing it");
  if (stages) stages->check(layers, "gpt");
  if (tp && vocab % tp->size() != 0)
    throw std::runtime_error("gpt: vocab " + std::to_string(vocab) + " does not split into " +
                             std::to_string(tp->size()) + " tensor-parallel parts; pad it (GPT-2's 50257 as 50304) or "
                             "choose run.parallel.tp dividing it");
}

parallel::TpSplit tp_split(const std::string& name) {
  if (lora::is_adapter(name)) return lora::adapter_tp_split(name, tp_split, /*fan_in_fan_out=*/true);
  auto ends_with = [&](const std::string& end) {
    return name.size() >= end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0;
  };
  if (ends_with("attn.c_attn.weight")) return {1, 3};  // Conv1D [dim, 3 dim]: q | k | v columns
  if (ends_with("attn.c_attn.bias")) return {0, 3};
  if (ends_with("attn.c_proj.weight") || ends_with("mlp.c_proj.weight")) return {0, 1};  // [in, out]: by input rows
  if (ends_with("mlp.c_fc.weight")) return {1, 1};
  if (ends_with("mlp.c_fc.bias")) return {0, 1};
  if (name == "wte.weight" || name == "transformer.wte.weight" || name == "lm_head.weight") return {0, 1};  // by vocabulary rows; the tied head too
  return {};  // wpe, LayerNorms, the row-split layers' biases: whole on every rank
}

Family family(const Config& c) {
  Family f;
  f.tp = c.tp, f.stages = c.stages;
  f.tp_split = tp_split;
  f.order = [c] { return whole_order(c); };
  const double d = static_cast<double>(c.dim);
  f.block_costs.assign(static_cast<size_t>(c.layers), 12 * d * d);  // q, k, v, proj: 4 d^2; the MLP's 8 d^2
  f.head_cost = static_cast<double>(c.vocab) * d;
  f.tied = {"wte.weight"};  // the head is the token table: on the first and the last stage
  f.vocab_split_logits = true;  // the tied head over this rank's rows of wte
  f.generator = init_generator;
  f.init_one = [c](const std::string& name, torch::Tensor& whole, at::Generator& g) { init_parameter(c, name, whole, g); };
  return f;
}

ParamOrder whole_order(const Config& c) {
  Config one = c;
  one.stages = nullptr;
  Block block(one.dim, one.heads, one.dropout, std::make_shared<CausalMaskCache>(), one.tp);
  const std::vector<int64_t> table{c.vocab / (c.tp ? c.tp->size() : 1), c.dim};
  ParamOrder order{{"wte.weight", table}, {"wpe.weight", {c.context, c.dim}}};
  for (int64_t i = 0; i < c.layers; ++i)
    for (const auto& p : block->named_parameters(true)) order.emplace_back("h." + std::to_string(i) + "." + p.key(), p.value().sizes().vec());
  order.emplace_back("ln_f.weight", std::vector<int64_t>{c.dim});
  order.emplace_back("ln_f.bias", std::vector<int64_t>{c.dim});
  return order;
}

// ---- leaf modules: reset() allocates without initialising (init_weights or a load fills
// them), so that clone() — which calls reset() on the copy — costs no random draws.


torch::Tensor CausalMaskCache::get(int64_t T, const torch::TensorOptions& opts) {
  const std::string key = std::string(c10::toString(opts.dtype())) + "/" + opts.device().str();
  std::lock_guard<std::mutex> lock(mu_);
  torch::Tensor& m = masks_[key];
  if (!m.defined() || m.size(0) < T) {
    torch::NoGradGuard no_grad;
    // -inf strictly above the diagonal (future positions), 0 elsewhere.
    m = torch::full({T, T}, -std::numeric_limits<double>::infinity(), opts.requires_grad(false)).triu_(1);
  }
  return m.narrow(0, 0, T).narrow(1, 0, T);
}

// ---- blocks

void AttentionImpl::reset() {
  const int64_t width = layers::tp_share(dim_, tp_, "gpt: the attention's width");  // this rank's heads' channels
  c_attn = register_module("c_attn", lora::split(conv1d(dim_, 3 * width), tp_, lora::TpRole::outputs));
  c_proj = register_module("c_proj", lora::split(conv1d(width, dim_), tp_, lora::TpRole::inputs));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& input, int64_t B, int64_t T) {
  // With tp this rank's heads only: its q, k, v columns in, its rows of c_proj out, summed.
  const int64_t H = heads_ / (tp_ ? tp_->size() : 1), D = dim_ / heads_, width = H * D;
  const torch::Tensor x = parallel::copy_to_tp(input, tp_);
  if (dropout_ == 0.0 || !TrainingScope::current()) {
    // The shared self-attention: SDPA on a GPU, the fused CPU kernel in float32 (both read q, k
    // and v out of the projection as they are).
    AttentionOptions causal;
    causal.causal = true;
    torch::Tensor y = self_attention(c_attn(x), B, T, H, causal);  // [B, T, width]
    return flowrun::dropout(layers::row_parallel(*c_proj, y.reshape({B * T, width}), tp_), dropout_);
  }
  // With attention dropout in training (drawn from the step's generator, which the shared
  // attention has not), written out: the fused projection's columns are q | k | v, each split
  // into heads. One copy turns [B*T, 3*dim] = [B, T, 3, H, D] into [3, B, H, T, D], so q, k and v
  // are each contiguous [B*H, T, D] for bmm (one copy instead of one per tensor; same in
  // backward: unbind's backward stacks the three gradients in one pass, where three selects
  // would each fill a zero tensor of the whole size).
  const std::vector<torch::Tensor> qkv = c_attn(x).view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4}).contiguous().unbind(0);
  torch::Tensor q = qkv[0].view({B * H, T, D});
  torch::Tensor k = qkv[1].view({B * H, T, D});
  torch::Tensor v = qkv[2].view({B * H, T, D});
  // scores = mask + (q @ k^T) / sqrt(D) in one call; the [T, T] mask broadcasts over B*H.
  torch::Tensor mask = masks_->get(T, q.options());
  torch::Tensor att = torch::baddbmm(mask, q, k.transpose(1, 2), /*beta=*/1.0, /*alpha=*/1.0 / std::sqrt(double(D)));
  att = torch::softmax(att, -1);
  if (tp_ && tp_->size() > 1)  // this rank's heads of the whole [B, heads, T, T] mask: as with tp 1
    att = flowrun::dropout_of_part(att.view({B, H, T, T}), dropout_, {B, heads_, T, T}, 1, tp_->rank() * H).view({B * H, T, T});
  else
    att = flowrun::dropout(att, dropout_);
  torch::Tensor y = torch::bmm(att, v);                                   // [B*H, T, D]
  y = y.view({B, H, T, D}).permute({0, 2, 1, 3}).reshape({B * T, width});  // heads side by side
  return flowrun::dropout(layers::row_parallel(*c_proj, y, tp_), dropout_);
}

void BlockImpl::reset() {
  ln_1 = register_module("ln_1", LayerNorm(dim_));
  attn = register_module("attn", Attention(dim_, heads_, dropout_, masks_, tp_));
  ln_2 = register_module("ln_2", LayerNorm(dim_));
  mlp = register_module("mlp", layers::Mlp(dim_, 4 * dim_, mlp_options(tp_)));
}

torch::Tensor AttentionImpl::decode(const torch::Tensor& x, int64_t B, int64_t t, const torch::Tensor& mask,
                                    std::pair<torch::Tensor, torch::Tensor>& cache) {
  // With tp this rank's heads only, as forward.
  const int64_t H = heads_ / (tp_ ? tp_->size() : 1), D = dim_ / heads_;
  const std::vector<torch::Tensor> qkv =
      c_attn(parallel::copy_to_tp(x, tp_)).view({B, t, 3, H, D}).permute({2, 0, 3, 1, 4}).unbind(0);  // [B, H, t, D] each
  torch::Tensor k = qkv[1], v = qkv[2];
  if (cache.first.defined()) k = torch::cat({cache.first, k}, 2), v = torch::cat({cache.second, v}, 2);
  cache = {k, v};
  AttentionOptions o;
  o.bias = mask;
  return layers::row_parallel(*c_proj, attention(qkv[0], k, v, o).reshape({B * t, H * D}), tp_);
}

torch::Tensor BlockImpl::decode(const torch::Tensor& x, int64_t B, int64_t t, const torch::Tensor& mask,
                                std::pair<torch::Tensor, torch::Tensor>& cache) {
  const torch::Tensor r = x + attn->decode(ln_1(x), B, t, mask, cache);
  return r + mlp(ln_2(r));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, int64_t B, int64_t T) {
  torch::Tensor r = x + attn(ln_1(x), B, T);
  return r + flowrun::dropout(mlp(ln_2(r)), dropout_);
}

// ---- the model


GptImpl::GptImpl(Config cfg) : cfg_(cfg), masks_(std::make_shared<CausalMaskCache>()) {
  cfg_.check();
  reset();
}

void GptImpl::reset() {
  // Staged (pipeline parallel): this rank's blocks only, an empty placeholder in the others'
  // places so that every parameter keeps its whole model's name.
  if (cfg_.holds_embedding() || cfg_.holds_head())
    wte = register_module("wte", Embedding(layers::tp_share(cfg_.vocab, cfg_.tp, "gpt: the vocabulary"), cfg_.dim));
  if (cfg_.holds_embedding()) wpe = register_module("wpe", Embedding(cfg_.context, cfg_.dim));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg_.layers; ++i) {
    if (cfg_.holds_block(i)) h->push_back(Block(cfg_.dim, cfg_.heads, cfg_.dropout, masks_, cfg_.tp));
    else h->push_back(torch::nn::Identity());
  }
  if (cfg_.holds_head()) ln_f = register_module("ln_f", LayerNorm(cfg_.dim));
}

torch::Tensor GptImpl::embed(const torch::Tensor& idx) {
  check_token_ids(idx, cfg_.context, cfg_.vocab, "gpt");
  const int64_t B = idx.size(0), T = idx.size(1), C = cfg_.dim;
  // The residual stream is kept as [B*T, C] so every projection is one addmm.
  torch::Tensor x = parallel::vocab_parallel_embedding(idx, wte->weight, cfg_.tp) + wpe->weight.narrow(0, 0, T);
  return flowrun::dropout(x, cfg_.dropout).view({B * T, C});
}

torch::Tensor GptImpl::blocks(torch::Tensor x, int64_t first, int64_t last, int64_t B, int64_t T) {
  // The ModuleList itself, never a cached vector of blocks: clone() replaces its items.
  for (int64_t i = first; i < last; ++i) {
    BlockImpl* block = (*h)[static_cast<size_t>(i)]->as<BlockImpl>();
    if (!block) throw std::logic_error("gpt: block " + std::to_string(i) + " is another pipeline stage's");
    x = run_block(cfg_.checkpoint, i, *block, {x}, [block, B, T](const std::vector<torch::Tensor>& in) { return block->forward(in[0], B, T); });
  }
  return x;
}

torch::Tensor GptImpl::head(const torch::Tensor& input, int64_t B, int64_t T) {
  const torch::Tensor x = ln_f(input);
  // Tied head: logits = x @ wte^T (BLAS reads the transpose in place); with tp this rank's
  // vocabulary columns (parallel::vocab_parallel_cross_entropy scores them).
  return flowrun::linear(parallel::copy_to_tp(x, cfg_.tp), wte->weight).view({B, T, wte->weight.size(0)});
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) {
  if (cfg_.staged())
    throw std::runtime_error("gpt: this rank holds pipeline chunks of the model only (run.parallel.pp); it runs chunk by "
                             "chunk in forward_backward's schedule, not as a whole");
  return head(blocks(embed(idx), 0, cfg_.layers, idx.size(0), idx.size(1)), idx.size(0), idx.size(1));
}

torch::Tensor GptImpl::decode(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask,
                              KvCache& cache) {
  if (cfg_.staged()) throw std::runtime_error("gpt: generation runs on the whole model, not on pipeline stages");
  check_token_ids(ids, cfg_.context, cfg_.vocab, "gpt");
  const int64_t B = ids.size(0), t = ids.size(1);
  torch::Tensor x = parallel::vocab_parallel_embedding(ids.reshape({B * t}), wte->weight, cfg_.tp) +
                    wpe->weight.index_select(0, positions.to(wpe->weight.device()).reshape({B * t}));
  cache.layers.resize(static_cast<size_t>(cfg_.layers));
  for (int64_t i = 0; i < cfg_.layers; ++i)
    x = (*h)[static_cast<size_t>(i)]->as<BlockImpl>()->decode(x, B, t, mask, cache.layers[static_cast<size_t>(i)]);
  return parallel::gather_vocab_logits(head(x, B, t), cfg_.tp);  // under tp: every rank the whole row
}

TensorMap GptImpl::chunk(int k, const torch::Tensor& idx, const TensorMap& in) {
  if (!cfg_.stages || !cfg_.stages->holds(k)) throw std::logic_error("gpt: pipeline chunk " + std::to_string(k) + " is another rank's");
  const int64_t B = idx.size(0), T = idx.size(1);
  const auto [first, last] = cfg_.stages->blocks.at(static_cast<size_t>(k));
  torch::Tensor x = k == 0 ? embed(idx) : in.at("x");
  x = blocks(x, first, last, B, T);
  if (k + 1 == cfg_.stages->chunks()) return {{"output", head(x, B, T)}};
  return {{"x", x}};
}

at::Generator init_generator(uint64_t seed) { return make_cpu_generator(mix_seed({seed, kSeedTagInit})); }

void init_parameter(const Config& c, const std::string& name, torch::Tensor& p, at::Generator& g) {
  torch::NoGradGuard no_grad;
  const double std = 0.02;
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(2*layers), so
  // the stream's variance does not grow with depth (2 such writes per block).
  const double std_resid = std / std::sqrt(2.0 * static_cast<double>(c.layers));
  auto ends_with = [&](const std::string& end) {
    return name.size() >= end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0;
  };
  if (ends_with(".bias")) {
    p.zero_();
  } else if (name.find("ln_") != std::string::npos) {
    p.fill_(1.0);
  } else if (ends_with("attn.c_proj.weight") || ends_with("mlp.c_proj.weight")) {
    p.normal_(0.0, std_resid, g);
  } else {
    p.normal_(0.0, std, g);
  }
}

void init_weights(GptImpl& model, uint64_t seed) {
  at::Generator g = init_generator(seed);
  for (auto& item : model.named_parameters(true))
    if (!lora::is_adapter(item.key())) init_parameter(model.config(), item.key(), item.value(), g);  // adapters: apply_lora's init
}

void load_hf_state_dict(GptImpl& model, const std::map<std::string, torch::Tensor>& tensors,
                        const std::string& source) {
  LoadByNameOptions o;
  o.model = "gpt (" + describe(model.config()) + ")";
  o.prefixes = {"transformer."};
  o.optional = lora::is_adapter;  // a base file loads into a LoRA-adapted model; the adapters keep their init
  // HF's non-parameter buffers (the causal mask h.N.attn.bias and its fill value), and the LM
  // head, which this model ties to wte (checked below).
  static const std::regex kHfBuffer(R"(h\.\d+\.attn\.(bias|masked_bias))");
  o.ignore = [](const std::string& n) { return n == "lm_head.weight" || std::regex_match(n, kHfBuffer); };
  auto find = [](const std::map<std::string, torch::Tensor>& file, const std::string& n) {
    auto it = file.find(n);
    if (it == file.end()) it = file.find("transformer." + n);
    return it == file.end() ? torch::Tensor() : it->second;
  };
  o.check = [find](const std::map<std::string, torch::Tensor>& file) {
    std::vector<std::string> problems;
    const torch::Tensor head = find(file, "lm_head.weight"), wte = find(file, "wte.weight");
    if (head.defined() && wte.defined() && wte.is_floating_point() &&
        !(head.sizes().equals(wte.sizes()) && torch::equal(head.to(wte.dtype()), wte)))
      problems.push_back("lm_head.weight " + shape_str(head) +
                         ": differs from wte.weight, but this model ties its LM head to wte (an untied head "
                         "cannot be loaded)");
    return problems;
  };
  o.describe_file = [find](const std::map<std::string, torch::Tensor>& file) -> std::string {
    const torch::Tensor wte = find(file, "wte.weight"), wpe = find(file, "wpe.weight");
    if (!(wte.defined() && wte.dim() == 2 && wpe.defined() && wpe.dim() == 2)) return "";
    int64_t layers = 0;
    static const std::regex kLayer(R"((?:transformer\.)?h\.(\d+)\..*)");
    for (const auto& [raw, _] : file) {
      std::smatch m;
      if (std::regex_match(raw, m, kLayer)) layers = std::max<int64_t>(layers, std::stoll(m[1].str()) + 1);
    }
    return "the file looks like layers=" + std::to_string(layers) + " dim=" + std::to_string(wte.size(1)) +
           " vocab=" + std::to_string(wte.size(0)) + " context=" + std::to_string(wpe.size(0));
  };
  load_declared(model, family(model.config()), tensors, source, o);  // a stage's tensors, a tp rank's parts
}

void load_hf_safetensors(GptImpl& model, const std::string& path) {
  safetensors::File f = safetensors::load(path);
  load_hf_state_dict(model, f.tensors, path);
}

nlohmann::json hf_config(const Config& c) {
  return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"n_layer", c.layers}, {"n_embd", c.dim},
          {"n_head", c.heads}, {"vocab_size", c.vocab}, {"n_positions", c.context}, {"n_inner", nullptr},
          {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5}, {"attn_pdrop", c.dropout},
          {"embd_pdrop", c.dropout}, {"resid_pdrop", c.dropout}, {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false}, {"reorder_and_upcast_attn", false}, {"tie_word_embeddings", true}};
}

std::shared_ptr<ModelState> make_state(Gpt model) {
  ModelState::ForwardFn fwd = [](torch::nn::Module& m, const TensorMap& batch) {
    const torch::Tensor inputs = lm_inputs(batch, "gpt");
    if (lm_packing(batch, inputs, "gpt").packed())
      throw std::runtime_error("gpt: packed batches (packed_shards: positions and segments) are not supported; the llama family "
                               "reads them (packing: none gives a document per row, which gpt reads)");
    auto* gpt = m.as<GptImpl>();
    if (!gpt) throw std::runtime_error("gpt: the model's module is not a GPT");
    if (const auto& stages = gpt->config().stages)  // pipeline parallel: this rank's chunks (models/stages.hpp)
      return staged_forward(*stages, inputs.device(), [&](int k, const TensorMap& in) { return gpt->chunk(k, inputs, in); });
    return gpt->forward(inputs);
  };
  auto state = std::make_shared<ModelState>(std::static_pointer_cast<torch::nn::Module>(model.ptr()), fwd, "gpt");
  state->stages = model->config().stages;
  auto lm = std::make_shared<ModelState::CausalLm>();
  lm->context = model->config().context;
  lm->decode = [](ModelState& self, const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& mask,
                  KvCache& cache) { return self.module->as<GptImpl>()->decode(ids, positions, mask, cache); };
  state->causal_lm = lm;
  return state;
}

}  // namespace flowrun::gpt
