// safetensors files (https://github.com/huggingface/safetensors): the field's tensor format,
// used for model weights (load by name) and checkpoints. Layout: an 8-byte little-endian
// header size N, N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {str: str}}, then the tensor bytes.
//
// Loading validates everything before touching tensor bytes: a truncated file, a bad header,
// an unknown dtype, offsets out of range or overlapping, or a size that does not match the
// shape is an error naming the file and the tensor — never an out-of-bounds read.
#pragma once
#include <torch/torch.h>

#include <map>
#include <string>

namespace flowrun::safetensors {

using Tensors = std::map<std::string, torch::Tensor>;
using Metadata = std::map<std::string, std::string>;

struct File {
  Tensors tensors;  // CPU tensors that own their memory
  Metadata metadata;
};

// PATH may go through a checkpoint's `latest` file (formats/files.hpp: resolve_latest).
File load(const std::string& path);

// Writes CPU copies of `tensors` (contiguous) to PATH.tmp, fsyncs, then renames to PATH, so a
// crash never leaves a half-written PATH.
void save(const std::string& path, const Tensors& tensors, const Metadata& metadata = {});

// "F32", "BF16", ... for a torch dtype, and back; throws for dtypes safetensors lacks.
std::string dtype_name(torch::ScalarType t);
torch::ScalarType dtype_from_name(const std::string& name, const std::string& what);

}  // namespace flowrun::safetensors
