// The header of a safetensors file, parsed and checked without torch (so the sanitizer and
// fuzzing builds test exactly the code every weight and checkpoint load runs; safetensors.hpp
// turns it into tensors). Layout: an 8-byte little-endian header size N, N bytes of JSON
// {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then
// the tensor bytes, offsets relative to where they start.
//
// Every check is here, before a byte of tensor data is read or allocated: header size within the
// file and at most 100 MB (the reference implementation's limit), a JSON object, entries with a
// known dtype, a shape of non-negative integers, offsets inside the data, a byte count equal to
// shape × dtype size (multiplied without overflow), no two tensors overlapping. Errors throw
// std::runtime_error("safetensors file PATH: ...") naming the tensor.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flowrun::safetensors {

struct Entry {
  std::string name;
  std::string dtype;           // "F32", "BF16", ...
  size_t item_size = 0;        // bytes per element
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
};

struct Header {
  uint64_t json_size = 0;                     // N: the data section starts at 8 + N
  std::vector<Entry> tensors;                 // sorted by name
  std::map<std::string, std::string> metadata;
};

constexpr uint64_t kMaxHeaderBytes = 100u << 20;

// Bytes per element of a safetensors dtype name; 0 if safetensors has no such dtype.
size_t dtype_size(const std::string& dtype);

// N from the first 8 bytes, checked against the file's size.
uint64_t header_json_size(const unsigned char first8[8], uint64_t file_size, const std::string& path);

// The JSON (N bytes) parsed and checked against a data section of `data_size` bytes.
Header parse_header(const std::string& json, uint64_t data_size, const std::string& path);

}  // namespace flowrun::safetensors
