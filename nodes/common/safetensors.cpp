#include "common/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

namespace flowrun::safetensors {

namespace {

struct DtypeInfo {
  const char* name;
  torch::ScalarType type;
  size_t size;
};

const DtypeInfo kDtypes[] = {
    {"BOOL", torch::kBool, 1}, {"U8", torch::kUInt8, 1},    {"I8", torch::kInt8, 1},
    {"I16", torch::kInt16, 2}, {"F16", torch::kHalf, 2},    {"BF16", torch::kBFloat16, 2},
    {"I32", torch::kInt32, 4}, {"F32", torch::kFloat32, 4}, {"F64", torch::kFloat64, 8},
    {"I64", torch::kInt64, 8},
};

// The reference implementation refuses headers above 100 MB; so do we (a corrupt size field
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeader = 100u << 20;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw std::runtime_error("safetensors file " + path + ": " + what);
}

}  // namespace

std::string dtype_name(torch::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  throw std::runtime_error(std::string("safetensors has no dtype for torch ") + c10::toString(t));
}

torch::ScalarType dtype_from_name(const std::string& name, const std::string& what) {
  for (const auto& d : kDtypes)
    if (name == d.name) return d.type;
  throw std::runtime_error(what + ": unsupported dtype '" + name + "'");
}

File load(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    bad(path, "is a folder, not a .safetensors file; name the file in it (a checkpoint folder holds one per state, "
              "e.g. " + (std::filesystem::path(path) / "ema.params.safetensors").string() + ")");
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    bad(path, "is not a regular file (a device or a pipe?)");
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(path, std::filesystem::exists(path) ? "cannot be read" : "no such file");
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) bad(path, "truncated: " + std::to_string(file_size) + " bytes, not even the 8-byte header size");
  unsigned char n8[8];
  in.read(reinterpret_cast<char*>(n8), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | n8[i];
  if (n > kMaxHeader) bad(path, "header size " + std::to_string(n) + " is implausible (corrupt file?)");
  if (n > file_size - 8)
    bad(path, "truncated: header says " + std::to_string(n) + " bytes, the file has " + std::to_string(file_size - 8));
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    bad(path, std::string("bad header JSON: ") + e.what());
  }
  if (!j.is_object()) bad(path, "bad header: not a JSON object");
  const uint64_t data_size = file_size - 8 - n;
  File f;
  struct Span {
    uint64_t b, e;
    std::string name;
  };
  std::vector<Span> spans;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad(path, "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad(path, "__metadata__." + m.key() + " is not a string");
        f.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + name + "'";
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      bad(path, what + ": needs dtype, shape and data_offsets");
    if (!v["dtype"].is_string()) bad(path, what + ": dtype is not a string");
    torch::ScalarType dt;
    try {
      dt = dtype_from_name(v["dtype"].get<std::string>(), what);
    } catch (const std::exception& e) {
      bad(path, e.what());
    }
    size_t item = 0;
    for (const auto& d : kDtypes)
      if (d.type == dt) item = d.size;
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    if (!v["shape"].is_array()) bad(path, what + ": shape is not a list");
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned()) bad(path, what + ": shape has a negative or non-integer size");
      uint64_t d = s.get<uint64_t>();
      if (d != 0 && numel > (UINT64_C(1) << 62) / d) bad(path, what + ": shape is absurdly large");
      numel *= d;
      shape.push_back(static_cast<int64_t>(d));
    }
    const auto& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(path, what + ": data_offsets must be [begin, end]");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size)
      bad(path, what + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] are outside the " +
                    std::to_string(data_size) + " data bytes (truncated file?)");
    if (e - b != numel * item)
      bad(path, what + ": " + std::to_string(e - b) + " bytes for a shape needing " + std::to_string(numel * item));
    spans.push_back({b, e, name});
    torch::Tensor t = torch::empty(shape, torch::TensorOptions().dtype(dt));
    if (e > b) {
      in.seekg(static_cast<std::streamoff>(8 + n + b));
      in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e - b));
      if (!in) bad(path, what + ": read failed");
    }
    f.tensors[name] = t;
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.b < b.b; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].b < spans[i - 1].e) bad(path, "tensors '" + spans[i - 1].name + "' and '" + spans[i].name + "' overlap");
  return f;
}

void save(const std::string& path, const Tensors& tensors, const Metadata& metadata) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  uint64_t off = 0;
  for (const auto& [name, t0] : tensors) {  // std::map: sorted by name, like the reference writer
    torch::Tensor t = t0.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    h[name] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
    data.push_back(t);
  }
  std::string header = h.dump();
  while ((8 + header.size()) % 8) header += ' ';  // tensor data starts 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::FILE* fp = std::fopen(tmp.c_str(), "wb");
    if (!fp) throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(errno));
    unsigned char n8[8];
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) n8[i] = static_cast<unsigned char>(n >> (8 * i));
    bool ok = std::fwrite(n8, 1, 8, fp) == 8 && std::fwrite(header.data(), 1, header.size(), fp) == header.size();
    for (const auto& t : data) {
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      ok = ok && std::fwrite(t.data_ptr(), 1, bytes, fp) == bytes;
    }
    ok = ok && std::fflush(fp) == 0 && fsync(fileno(fp)) == 0;
    ok = (std::fclose(fp) == 0) && ok;
    if (!ok) {
      std::remove(tmp.c_str());
      throw std::runtime_error("writing " + tmp + " failed: " + std::strerror(errno));
    }
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace flowrun::safetensors
