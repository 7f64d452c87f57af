#include "common/safetensors.hpp"

#include "formats/files.hpp"
#include "formats/safetensors_header.hpp"

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
  torch::ScalarType type;  // bytes per element: dtype_size (safetensors_header.cpp)
};

const DtypeInfo kDtypes[] = {
    {"BOOL", torch::kBool}, {"U8", torch::kUInt8},    {"I8", torch::kInt8},
    {"I16", torch::kInt16}, {"F16", torch::kHalf},    {"BF16", torch::kBFloat16},
    {"I32", torch::kInt32}, {"F32", torch::kFloat32}, {"F64", torch::kFloat64},
    {"I64", torch::kInt64},
};

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

File load(const std::string& given) {
  const std::string path = resolve_latest(given);  // a path through a checkpoint's `latest`
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
  unsigned char n8[8] = {};
  in.read(reinterpret_cast<char*>(n8), 8);
  const uint64_t n = header_json_size(n8, file_size, path);
  std::string json(n, '\0');
  in.read(json.data(), static_cast<std::streamsize>(n));
  if (!in) bad(path, "header read failed");
  const Header h = parse_header(json, file_size - 8 - n, path);  // every check, before any allocation
  File f;
  f.metadata = h.metadata;
  for (const Entry& e : h.tensors) {
    torch::Tensor t = torch::empty(e.shape, torch::TensorOptions().dtype(dtype_from_name(e.dtype, e.name)));
    if (e.end > e.begin) {
      in.seekg(static_cast<std::streamoff>(8 + n + e.begin));
      in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(e.end - e.begin));
      if (!in) bad(path, "tensor '" + e.name + "': read failed");
    }
    f.tensors[e.name] = t;
  }
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
