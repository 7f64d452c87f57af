// The built-in node types of nodes/: registered from their schemas/TYPE.yaml, constructible,
// and documented (every port and parameter has a doc line, `flowrun nodes TYPE` prints them).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "executor.hpp"
#include "models/bert.hpp"
#include "models/cappa/cappa.hpp"
#include "models/dit/dit.hpp"
#include "models/gpt/gpt.hpp"
#include "models/t5_encoder.hpp"
#include "models/vae/vae.hpp"
#include "registry.hpp"
#include "schema.hpp"
#include "train/losses.hpp"
#include "train/optimizer.hpp"

namespace flowrun {
namespace {

// Every schemas/TYPE.yaml but graph.yaml is a built-in node type: read the list from the folder
// so a new node cannot be left out of this test.
std::vector<std::string> builtin_types() {
  std::vector<std::string> types;
  for (const auto& e : std::filesystem::directory_iterator(FLOWRUN_SOURCE_DIR "/schemas"))
    if (e.path().extension() == ".yaml" && e.path().stem() != "graph") types.push_back(e.path().stem().string());
  return types;
}

void expect_documented(const std::string& type, const std::vector<ParamSchema>& params, const std::string& path) {
  for (const auto& p : params) {
    EXPECT_FALSE(p.doc.empty()) << type << ": parameter " << path << p.name << " has no doc";
    expect_documented(type, p.fields, path + p.name + ".");
  }
}

TEST(BuiltinSchemas, EveryTypeIsRegisteredAndDocumented) {
  const auto types = builtin_types();
  EXPECT_GE(types.size(), 11u);
  for (const std::string& type : types) {
    const NodeType* t = Registry::global().find(type);
    ASSERT_NE(t, nullptr) << type << " is not registered";
    EXPECT_EQ(t->schema.type, type);
    EXPECT_EQ(t->schema.origin, "built-in");
    EXPECT_FALSE(t->schema.doc.empty()) << type;
    for (const auto* ports : {&t->schema.inputs, &t->schema.outputs})
      for (const auto& p : *ports) EXPECT_FALSE(p.doc.empty()) << type << ": port " << p.name << " has no doc";
    expect_documented(type, t->schema.params, "");
    // A map with fields and no default is filled from its fields' defaults (check_params), so
    // those fields must have defaults.
    for (const auto& p : t->schema.params) {
      const bool from_fields = p.type == ParamType::Map && !p.fields.empty() &&
                               std::all_of(p.fields.begin(), p.fields.end(), [](const ParamSchema& f) { return f.has_default; });
      EXPECT_TRUE(p.has_default || p.required || from_fields)
          << type << ": parameter " << p.name << " has neither default nor required";
    }
    ASSERT_TRUE(builtin_type_loaded(type)) << type << " has a schema but no FLOWRUN_NODE in the node library";
    EXPECT_NE(t->factory(), nullptr) << type;
    EXPECT_NE(describe(t->schema).find(type), std::string::npos);
  }
}

TEST(BuiltinSchemas, StateAndValuePortsAsDocumented) {
  auto* fb = Registry::global().find("forward_backward");
  ASSERT_NE(fb, nullptr);
  const PortSchema* model = fb->schema.input("model");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->kind, PortKind::State);
  EXPECT_EQ(model->access, Access::Read);  // forward_backward never writes parameters
  auto* opt = Registry::global().find("optimizer");
  ASSERT_NE(opt, nullptr);
  EXPECT_EQ(opt->schema.input("model")->access, Access::Write);
  EXPECT_EQ(opt->schema.output("state")->access, Access::Write);
  auto* ema = Registry::global().find("ema");
  ASSERT_NE(ema, nullptr);
  EXPECT_EQ(ema->schema.input("model")->access, Access::Read);
  auto* metrics = Registry::global().find("metrics");
  ASSERT_NE(metrics, nullptr);
  const PortSchema* any = metrics->schema.input("whatever_name");
  ASSERT_NE(any, nullptr);
  EXPECT_TRUE(any->optional);
  EXPECT_EQ(any->kind, PortKind::Value);
}

// The schema is where a default lives (`flowrun nodes TYPE` prints it, the checker fills it
// in); the C++ structs a node fills from its parameters start from the same values, so code
// that makes one directly (tests, benchmarks, a plugin) gets what a graph file gets. `param`'s
// default in `type`'s schema (a dotted path for a map's field), as T.
template <class T>
T schema_default(const std::string& type, const std::string& param) {
  const ParamSchema* p = nullptr;
  if (type == "run") {
    p = graph_schema().run()->field(param);
  } else {
    const NodeType* t = Registry::global().find(type);
    if (!t) throw std::runtime_error("no node type " + type);
    p = t->schema.param(param);
  }
  if (!p || !p->has_default) throw std::runtime_error(type + "." + param + " has no default in its schema");
  return p->default_value.as<T>();
}
#define EXPECT_SCHEMA_DEFAULT(value, type, param) \
  EXPECT_EQ(value, schema_default<std::decay_t<decltype(value)>>(type, param)) << type << "." << param

TEST(BuiltinSchemas, ConfigStructsStartAtTheSchemaDefaults) {
  const dit::Config dit;
  EXPECT_SCHEMA_DEFAULT(dit.patch, "dit", "patch");
  EXPECT_SCHEMA_DEFAULT(dit.in_channels, "dit", "in_channels");
  EXPECT_SCHEMA_DEFAULT(dit.hidden, "dit", "hidden");
  EXPECT_SCHEMA_DEFAULT(dit.depth, "dit", "depth");
  EXPECT_SCHEMA_DEFAULT(dit.heads, "dit", "heads");
  EXPECT_SCHEMA_DEFAULT(dit.mlp_ratio, "dit", "mlp_ratio");
  EXPECT_SCHEMA_DEFAULT(dit.text_dim, "dit", "text_dim");
  EXPECT_SCHEMA_DEFAULT(dit.t5_dim, "dit", "t5_dim");
  EXPECT_SCHEMA_DEFAULT(dit.pooled_projection_dim, "dit", "pooled_projection_dim");
  EXPECT_SCHEMA_DEFAULT(dit.use_style_cond_and_image_meta_size, "dit", "use_style_cond_and_image_meta_size");
  EXPECT_SCHEMA_DEFAULT(dit.learn_sigma, "dit", "learn_sigma");
  EXPECT_SCHEMA_DEFAULT(dit.rope_base_grid, "dit", "rope_base_grid");
  EXPECT_EQ(dit.checkpoint.str(), schema_default<std::string>("dit", "checkpoint"));

  const gpt::Config gpt;
  EXPECT_SCHEMA_DEFAULT(gpt.layers, "gpt", "layers");
  EXPECT_SCHEMA_DEFAULT(gpt.dim, "gpt", "dim");
  EXPECT_SCHEMA_DEFAULT(gpt.heads, "gpt", "heads");
  EXPECT_SCHEMA_DEFAULT(gpt.vocab, "gpt", "vocab");
  EXPECT_SCHEMA_DEFAULT(gpt.context, "gpt", "context");
  EXPECT_SCHEMA_DEFAULT(gpt.dropout, "gpt", "dropout");
  EXPECT_EQ(gpt.checkpoint.str(), schema_default<std::string>("gpt", "checkpoint"));

  const cappa::Config cappa;
  for (const auto& [value, name] : std::vector<std::pair<int64_t, const char*>>{
           {cappa.image_size, "image_size"}, {cappa.patch, "patch"}, {cappa.channels, "channels"},
           {cappa.width, "width"}, {cappa.depth, "depth"}, {cappa.heads, "heads"}, {cappa.mlp_dim, "mlp_dim"},
           {cappa.dec_width, "dec_width"}, {cappa.dec_depth, "dec_depth"}, {cappa.dec_heads, "dec_heads"},
           {cappa.dec_mlp_dim, "dec_mlp_dim"}})
    EXPECT_SCHEMA_DEFAULT(value, "cappa", name);
  EXPECT_SCHEMA_DEFAULT(cappa.decoder_bias, "cappa", "decoder_bias");
  EXPECT_SCHEMA_DEFAULT(cappa.posemb, "cappa", "posemb");

  const bert::Config bert;
  EXPECT_SCHEMA_DEFAULT(bert.vocab, "bert_encode", "vocab");
  EXPECT_SCHEMA_DEFAULT(bert.dim, "bert_encode", "dim");
  EXPECT_SCHEMA_DEFAULT(bert.layers, "bert_encode", "layers");
  EXPECT_SCHEMA_DEFAULT(bert.heads, "bert_encode", "heads");
  EXPECT_SCHEMA_DEFAULT(bert.ffn, "bert_encode", "ffn");
  EXPECT_SCHEMA_DEFAULT(bert.max_positions, "bert_encode", "max_positions");
  EXPECT_SCHEMA_DEFAULT(bert.type_vocab, "bert_encode", "type_vocab");
  EXPECT_SCHEMA_DEFAULT(bert.eps, "bert_encode", "eps");

  const t5::Config t5;
  EXPECT_SCHEMA_DEFAULT(t5.vocab, "t5_encode", "vocab");
  EXPECT_SCHEMA_DEFAULT(t5.dim, "t5_encode", "dim");
  EXPECT_SCHEMA_DEFAULT(t5.layers, "t5_encode", "layers");
  EXPECT_SCHEMA_DEFAULT(t5.heads, "t5_encode", "heads");
  EXPECT_SCHEMA_DEFAULT(t5.ffn, "t5_encode", "ffn");
  EXPECT_SCHEMA_DEFAULT(t5.d_kv, "t5_encode", "d_kv");
  EXPECT_SCHEMA_DEFAULT(t5.buckets, "t5_encode", "relative_attention_num_buckets");
  EXPECT_SCHEMA_DEFAULT(t5.max_distance, "t5_encode", "relative_attention_max_distance");
  EXPECT_SCHEMA_DEFAULT(t5.eps, "t5_encode", "eps");
  EXPECT_EQ(t5.gated ? "gated-gelu" : "relu", schema_default<std::string>("t5_encode", "feed_forward_proj"));

  const vae::Config vae;
  EXPECT_SCHEMA_DEFAULT(vae.block_out_channels, "vae", "block_out_channels");
  EXPECT_SCHEMA_DEFAULT(vae.layers_per_block, "vae", "layers_per_block");
  EXPECT_SCHEMA_DEFAULT(vae.latent_channels, "vae", "latent_channels");
  EXPECT_SCHEMA_DEFAULT(vae.norm_num_groups, "vae", "norm_num_groups");
  EXPECT_SCHEMA_DEFAULT(vae.scaling_factor, "vae", "scaling_factor");

  const CaptionLoss::Options caption;
  EXPECT_SCHEMA_DEFAULT(caption.masked_pred_prob, "caption_loss", "masked_pred_prob");
  EXPECT_SCHEMA_DEFAULT(caption.masking_ratio, "caption_loss", "masking_ratio");
  EXPECT_SCHEMA_DEFAULT(caption.label_smoothing, "caption_loss", "label_smoothing");
  EXPECT_SCHEMA_DEFAULT(caption.image_key, "caption_loss", "image_key");

  const VaeLoss::Options vae_loss;
  EXPECT_SCHEMA_DEFAULT(vae_loss.kl_weight, "vae_loss", "kl_weight");
  EXPECT_EQ(vae_loss.l1 ? "l1" : "mse", schema_default<std::string>("vae_loss", "recon"));
  EXPECT_SCHEMA_DEFAULT(vae_loss.sample, "vae_loss", "sample");
  EXPECT_SCHEMA_DEFAULT(vae_loss.image_key, "vae_loss", "image_key");

  const OptimConfig opt;
  EXPECT_EQ(opt.rule->kind, schema_default<std::string>("optimizer", "kind"));
  EXPECT_SCHEMA_DEFAULT(opt.weight_decay, "optimizer", "weight_decay");
  EXPECT_SCHEMA_DEFAULT(opt.clip, "optimizer", "clip");
  EXPECT_SCHEMA_DEFAULT(opt.skip_nonfinite, "optimizer", "skip_nonfinite");

  EXPECT_SCHEMA_DEFAULT(RunOptions{}.prefetch, "run", "prefetch");
}

}  // namespace
}  // namespace flowrun
