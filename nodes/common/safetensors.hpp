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

// The same tensors without reading them: views of the file mapped into memory (private and
// copy-on-write, so nothing ever writes the file), each page read from disk when something
// first touches it. A pretrained folder's weights load this way (pretrained.hpp), so a model
// copies its tensors from the file with no second copy of the file in memory, and a tensor-
// parallel rank that copies only its part of a tensor reads only the pages of that part. The
// mapping lives as long as any of its tensors. Checked as load() checks; a tensor whose offset
// is not a multiple of its element size (a writer that did not pad the header) is read instead.
File map(const std::string& path);
// Gives back the memory that reading a tensor of map() took (the pages entirely inside its
// bytes; the file still holds them, a later touch reads them again); nothing for any other
// tensor. What keeps a load's peak near the model plus one tensor (load_by_name.cpp).
void release_pages(const torch::Tensor& t);

// Writes CPU copies of `tensors` (contiguous) to PATH.tmp, fsyncs, then renames to PATH, so a
// crash never leaves a half-written PATH. The data lies as the reference writer lays it: larger
// elements first, so each tensor starts aligned to its element size.
// `written`, when given, gets what a checkpoint's manifest records, computed from the bytes as
// they are written (never read back): the file's size and CRC32C, and each tensor's bytes' CRC32C.
struct Written {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  std::map<std::string, uint32_t> tensor_crc32c;
};
void save(const std::string& path, const Tensors& tensors, const Metadata& metadata = {}, Written* written = nullptr);

// "F32", "BF16", ... for a torch dtype, and back; throws for dtypes safetensors lacks.
std::string dtype_name(torch::ScalarType t);
torch::ScalarType dtype_from_name(const std::string& name, const std::string& what);

}  // namespace flowrun::safetensors
