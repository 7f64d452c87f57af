// Text generation from a causal language model (ModelState::causal_lm: llama), as transformers'
// generate() does it: a batch of prompts left-padded to one length, positions counted from each
// prompt's first token, the prompt run once to fill a KV cache, then one token per step from the
// last position's logits. Greedy, or sampling with temperature, top-k and top-p (applied in
// transformers' order: temperature, top-k, top-p), from a seeded generator; a row stops at a stop
// id (EOS) or when `stop` says so (stop strings: the caller decodes), the others go on.
//
//   GenerateOptions o;  o.max_new_tokens = 64;  o.stop_ids = {151645};
//   GenerateResult r = generate(model, {{1, 2, 3}, {4, 5}}, o);   // r.tokens[i]: prompt i's new ids
//
// Under tensor parallel every rank of the model's tp group calls it alike (the generate node does,
// in its TpChannel); pipeline stages and ZeRO-3's sharded parameters are refused.
//
// use_cache false recomputes the whole sequence every step (the reference the cache is checked
// against, and slower: GenerateResult reports tokens/s).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/model_state.hpp"

namespace flowrun {

// Each block's keys and values so far, [B, kv_heads, L, head_dim].
struct KvCache {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> layers;
  int64_t length() const { return layers.empty() || !layers[0].first.defined() ? 0 : layers[0].first.size(2); }
};

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: all
  double top_p = 1.0;        // 1: all
  std::vector<int64_t> stop_ids;
  uint64_t seed = 0;
  bool use_cache = true;
};

struct GenerateResult {
  std::vector<std::vector<int64_t>> tokens;  // per prompt: the new ids (through the stop id, if one came)
  int64_t new_tokens = 0;                    // all rows' together
  double seconds = 0;                        // the decoding loop, prompts included
};

// `stop(row, new_ids)`: true when row's text is complete (a stop string); may be empty.
GenerateResult generate(ModelState& model, const std::vector<std::vector<int64_t>>& prompts, const GenerateOptions& options,
                        const std::function<bool(size_t row, const std::vector<int64_t>& new_ids)>& stop = {});

}  // namespace flowrun
