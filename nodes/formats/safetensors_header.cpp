#include "formats/safetensors_header.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace flowrun::safetensors {

namespace {

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::runtime_error("safetensors file " + path + ": " + what);
}

}  // namespace

size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"I16", 2}, {"F16", 2},
                                                      {"BF16", 2}, {"I32", 4}, {"F32", 4}, {"F64", 8}, {"I64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

uint64_t header_json_size(const unsigned char first8[8], uint64_t file_size, const std::string& path) {
  if (file_size < 8) bad(path, "truncated: " + std::to_string(file_size) + " bytes, not even the 8-byte header size");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | first8[i];
  if (n > kMaxHeaderBytes) bad(path, "header size " + std::to_string(n) + " is implausible (corrupt file?)");
  if (n > file_size - 8)
    bad(path, "truncated: header says " + std::to_string(n) + " bytes, the file has " + std::to_string(file_size - 8));
  return n;
}

Header parse_header(const std::string& json, uint64_t data_size, const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    bad(path, std::string("bad header JSON: ") + e.what());
  }
  if (!j.is_object()) bad(path, "bad header: not a JSON object");
  Header h;
  h.json_size = json.size();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad(path, "__metadata__." + m.key() + " is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad(path, what + ": needs dtype, shape and data_offsets");
    Entry e;
    e.name = name;
    if (!v["dtype"].is_string()) bad(path, what + ": dtype is not a string");
    e.dtype = v["dtype"].get<std::string>();
    e.item_size = dtype_size(e.dtype);
    if (e.item_size == 0) bad(path, what + ": unsupported dtype '" + e.dtype + "'");
    if (!v["shape"].is_array()) bad(path, what + ": shape is not a list");
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) bad(path, what + ": shape has a negative or non-integer size");
      if (s.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) bad(path, what + ": shape has a size above 2^63");
      e.shape.push_back(s.get<int64_t>());
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(path, what + ": data_offsets must be [begin, end]");
    e.begin = off[0].get<uint64_t>();
    e.end = off[1].get<uint64_t>();
    if (e.begin > e.end || e.end > data_size)
      bad(path, what + ": data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                    "] are outside the " + std::to_string(data_size) + " data bytes (truncated file?)");
    // shape x dtype size must be the range's size, multiplied without overflow.
    const uint64_t have = e.end - e.begin;
    uint64_t need = e.item_size;
    bool more = false;
    if (std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end())
      need = 0;
    else
      for (int64_t d : e.shape) {
        if (need > UINT64_MAX / static_cast<uint64_t>(d)) {  // 2^64 bytes or more
          more = true;
          break;
        }
        need *= static_cast<uint64_t>(d);
      }
    if (more || need != have)
      bad(path, what + ": " + std::to_string(have) + " bytes for a shape needing " +
                    (more ? "2^64 or more" : std::to_string(need)));
    h.tensors.push_back(std::move(e));
  }
  std::vector<const Entry*> by_begin;
  for (const Entry& e : h.tensors) by_begin.push_back(&e);
  // An empty tensor may start where another does (the reference writer puts it there): it sorts first.
  std::sort(by_begin.begin(), by_begin.end(),
            [](const Entry* a, const Entry* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  for (size_t i = 1; i < by_begin.size(); ++i)
    if (by_begin[i]->begin < by_begin[i - 1]->end)
      bad(path, "tensors '" + by_begin[i - 1]->name + "' and '" + by_begin[i]->name + "' overlap");
  return h;
}

}  // namespace flowrun::safetensors
