// Batch keys that files in different layers must agree on, named once: a misspelt key is a
// compile error here instead of "the batch has no 'tex_emb'" at run time. Keys that one file
// writes and a graph names (a data node's out_key, an objective's x_key) are parameters in
// their schemas instead; these are the fixed ones:
//   - what a denoiser reads (models/dit/dit.cpp) and what the diffusion objective and the sampler
//     hand it (train/diffusion.cpp, eval/sampler.cpp): the noisy sample, the timestep, the
//     text streams and the size/style conditioning (data/image_text_shards.cpp writes those);
//   - the regression pair (data/synthetic_regression.cpp writes, models/mlp.cpp and
//     train/mse_loss.cpp read).
#pragma once

namespace flowrun::batch_key {

// A denoiser's input.
inline constexpr const char* noisy = "x";      // x_t [B, C, H, W]
inline constexpr const char* timestep = "t";   // [B] or 0-d
inline constexpr const char* text_emb = "text_emb", *text_mask = "text_mask";  // the first text stream (CLIP/BERT)
inline constexpr const char* t5_emb = "t5_emb", *t5_mask = "t5_mask";          // the second (T5)
inline constexpr const char* image_meta_size = "image_meta_size";  // [B, 6] (HunyuanDiT's size conditioning)
inline constexpr const char* style = "style";                      // [B] int
// The text streams, as (states, mask) pairs: classifier-free guidance drops and nulls each pair.
struct TextStream {
  const char* emb;
  const char* mask;
};
inline constexpr TextStream text_streams[] = {{text_emb, text_mask}, {t5_emb, t5_mask}};

// The regression pair.
inline constexpr const char* features = "x";
inline constexpr const char* targets = "y";

}  // namespace flowrun::batch_key
