#include "common/safetensors.hpp"

#include "formats/crc32c.hpp"

#include "formats/files.hpp"
#include "formats/safetensors_header.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
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

// The path checks of load() and map(): through `latest`, not a folder, a regular file.
std::string checked_path(const std::string& given) {
  const std::string path = resolve_latest(given);  // a path through a checkpoint's `latest`
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    bad(path, "is a folder, not a .safetensors file; name the file in it (a checkpoint folder holds one per state, "
              "e.g. " + (std::filesystem::path(path) / "ema.params.safetensors").string() + ")");
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    bad(path, "is not a regular file (a device or a pipe?)");
  return path;
}

// map()'s mappings, by address range, while any of their tensors lives: what release_pages()
// may give back (and never memory of anything else).
struct Mapping {
  char* base = nullptr;
  size_t size = 0;
  ~Mapping();
};
std::mutex mappings_mutex;
std::map<uintptr_t, const Mapping*> live_mappings;  // begin -> mapping

Mapping::~Mapping() {
  if (!base) return;  // never mapped (map() fell back to load())
  {
    std::lock_guard<std::mutex> lock(mappings_mutex);
    live_mappings.erase(reinterpret_cast<uintptr_t>(base));
  }
  munmap(base, size);
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
  const std::string path = checked_path(given);
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

File map(const std::string& given) {
  const std::string path = checked_path(given);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad(path, std::filesystem::exists(path) ? "cannot be read" : "no such file");
  struct stat st {};
  auto mapping = std::make_shared<Mapping>();
  if (fstat(fd, &st) == 0 && st.st_size >= 8) {
    void* m = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (m != MAP_FAILED) {
      mapping->base = static_cast<char*>(m);
      mapping->size = static_cast<size_t>(st.st_size);
    }
  }
  ::close(fd);  // the mapping keeps the file
  if (!mapping->base) return load(path);  // empty, too short or not mappable: load() says what is wrong or reads it
  {
    std::lock_guard<std::mutex> lock(mappings_mutex);
    live_mappings[reinterpret_cast<uintptr_t>(mapping->base)] = mapping.get();
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(mapping->base);
  const uint64_t n = header_json_size(bytes, mapping->size, path);
  const Header h = parse_header(std::string(mapping->base + 8, n), mapping->size - 8 - n, path);
  File f;
  f.metadata = h.metadata;
  for (const Entry& e : h.tensors) {
    const auto options = torch::TensorOptions().dtype(dtype_from_name(e.dtype, e.name));
    char* at = mapping->base + 8 + n + e.begin;
    if (e.end == e.begin) {
      f.tensors[e.name] = torch::empty(e.shape, options);
    } else if (reinterpret_cast<uintptr_t>(at) % e.item_size != 0) {
      torch::Tensor t = torch::empty(e.shape, options);
      std::memcpy(t.data_ptr(), at, e.end - e.begin);
      f.tensors[e.name] = t;
    } else {
      f.tensors[e.name] = torch::from_blob(at, e.shape, [keep = mapping](void*) {}, options);
    }
  }
  return f;
}

void release_pages(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.device().type() != torch::kCPU) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.storage().data());
  const uintptr_t end = begin + t.storage().nbytes();
  {
    std::lock_guard<std::mutex> lock(mappings_mutex);
    auto it = live_mappings.upper_bound(begin);
    if (it == live_mappings.begin()) return;
    --it;
    if (end > it->first + it->second->size) return;  // not one of map()'s tensors
  }
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (begin + page - 1) / page * page, last = end / page * page;  // whole pages inside
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

void save(const std::string& path, const Tensors& tensors, const Metadata& metadata, Written* written) {
  nlohmann::json h = nlohmann::json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  // The data in the reference writer's order: by element size, largest first, then by name, so
  // every tensor starts aligned to its element size (map() can then view it where it lies).
  std::vector<std::pair<std::string, torch::Tensor>> order(tensors.begin(), tensors.end());
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.second.element_size() > b.second.element_size(); });
  std::vector<torch::Tensor> data;
  uint64_t off = 0;
  for (const auto& [name, t0] : order) {
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
    uint32_t crc = 0;
    if (written) {
      crc = crc32c(header.data(), header.size(), crc32c(n8, 8));
      written->tensor_crc32c.clear();
    }
    for (size_t i = 0; i < data.size(); ++i) {
      const torch::Tensor& t = data[i];
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      ok = ok && std::fwrite(t.data_ptr(), 1, bytes, fp) == bytes;
      if (written) {
        const uint32_t own = crc32c(t.data_ptr(), bytes);
        written->tensor_crc32c[order[i].first] = own;
        crc = crc32c(t.data_ptr(), bytes, crc);
      }
    }
    if (written) {
      written->bytes = 8 + header.size() + off;
      written->crc32c = crc;
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
