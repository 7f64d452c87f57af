// tensordiff A.safetensors B.safetensors TOL [SKIP_REGEX]
//   The largest |a - b| over the tensors both files hold (the same names in both; the tensors whose
//   name matches SKIP_REGEX are left out of the largest and listed); exit 1 if it is over TOL. TOL
//   written with "rel" after it ("1e-5rel"): |a - b| relative to each tensor's largest |a|.
//
// The end-to-end tests compare checkpoints with it hundreds of times (tests/mpi/mpi_test.sh), so
// it reads the files itself (safetensors: 8 bytes of header length, a JSON header naming each
// tensor's dtype, shape and byte range, the bytes) and links no torch, whose start-up alone takes
// half a second a call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct File {
  std::string path;
  std::vector<char> bytes;
  size_t data = 0;  // where the tensors' bytes start
  nlohmann::json header;
};

File load(const std::string& path) {
  File f{path, {}, 0, {}};
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  f.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  if (f.bytes.size() < 8) throw std::runtime_error(path + ": not a safetensors file (shorter than its header length)");
  std::memcpy(&n, f.bytes.data(), 8);  // little-endian, as the machines this runs on
  if (n > f.bytes.size() - 8) throw std::runtime_error(path + ": its header runs past the end of the file");
  f.header = nlohmann::json::parse(f.bytes.begin() + 8, f.bytes.begin() + 8 + static_cast<long>(n));
  f.data = 8 + n;
  f.header.erase("__metadata__");
  return f;
}

// A tensor's elements as doubles.
std::vector<double> values(const File& f, const std::string& name) {
  const nlohmann::json& t = f.header.at(name);
  const std::string dtype = t.at("dtype");
  const size_t begin = t.at("data_offsets")[0], end = t.at("data_offsets")[1];
  if (end < begin || f.data + end > f.bytes.size()) throw std::runtime_error(f.path + ": " + name + "'s bytes run past the end");
  const char* p = f.bytes.data() + f.data + begin;
  const size_t size = end - begin;
  std::vector<double> out;
  auto read = [&](auto zero, auto convert) {
    using T = decltype(zero);
    out.resize(size / sizeof(T));
    for (size_t i = 0; i < out.size(); ++i) {
      T v;
      std::memcpy(&v, p + i * sizeof(T), sizeof(T));
      out[i] = convert(v);
    }
  };
  auto same = [](auto v) { return static_cast<double>(v); };
  auto half = [](uint16_t h) {  // IEEE binary16
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * std::ldexp(m, -24);
    if (e == 31) return m ? std::nan("") : s * INFINITY;
    return s * std::ldexp(m + 1024, e - 25);
  };
  auto bf16 = [](uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    return static_cast<double>(v);
  };
  if (dtype == "F64") read(double{}, same);
  else if (dtype == "F32") read(float{}, same);
  else if (dtype == "F16") read(uint16_t{}, half);
  else if (dtype == "BF16") read(uint16_t{}, bf16);
  else if (dtype == "I64") read(int64_t{}, same);
  else if (dtype == "I32") read(int32_t{}, same);
  else if (dtype == "I16") read(int16_t{}, same);
  else if (dtype == "I8") read(int8_t{}, same);
  else if (dtype == "U8" || dtype == "BOOL") read(uint8_t{}, same);
  else throw std::runtime_error(f.path + ": " + name + " has dtype " + dtype + ", which tensordiff does not read");
  return out;
}

int diff(const std::string& a, const std::string& b, const std::string& tol_arg, const std::string& skip) {
  const bool relative = tol_arg.size() > 3 && tol_arg.compare(tol_arg.size() - 3, 3, "rel") == 0;
  const double tol = std::stod(relative ? tol_arg.substr(0, tol_arg.size() - 3) : tol_arg);
  const File fa = load(a), fb = load(b);
  const std::regex skipped(skip.empty() ? "$^" : skip);
  double worst = 0;
  std::string where;
  for (const auto& [name, t] : fa.header.items()) {
    if (!fb.header.contains(name)) {
      std::printf("%s is missing from %s\n", name.c_str(), b.c_str());
      return 1;
    }
    if (t.at("shape") != fb.header.at(name).at("shape")) {
      std::printf("%s: shape %s in %s, %s in %s\n", name.c_str(), t.at("shape").dump().c_str(), a.c_str(),
                  fb.header.at(name).at("shape").dump().c_str(), b.c_str());
      return 1;
    }
    const std::vector<double> va = values(fa, name), vb = values(fb, name);
    double d = 0, largest = 0;
    for (size_t i = 0; i < va.size(); ++i) {
      if (std::isnan(va[i]) && std::isnan(vb[i])) continue;  // alike
      const double x = std::abs(va[i] - vb[i]);
      d = std::isnan(x) ? INFINITY : std::max(d, x);  // one of them NaN: they differ
      largest = std::max(largest, std::abs(va[i]));
    }
    if (relative && !va.empty()) d /= std::max(largest, 1e-30);
    if (std::regex_search(name, skipped)) {
      std::printf("left out: %s (max abs diff %.3g)\n", name.c_str(), d);
      continue;
    }
    if (d > worst) worst = d, where = name;
  }
  if (fa.header.size() != fb.header.size()) {
    std::printf("%s has %zu tensors, %s %zu\n", a.c_str(), fa.header.size(), b.c_str(), fb.header.size());
    return 1;
  }
  std::printf("max %s diff %.3g (%s) over %zu tensors; tolerance %.3g\n", relative ? "relative" : "abs", worst,
              where.c_str(), fa.header.size(), tol);
  return worst <= tol ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: tensordiff A.safetensors B.safetensors TOL[rel] [SKIP_REGEX]\n");
    return 2;
  }
  try {
    return diff(argv[1], argv[2], argv[3], argc == 5 ? argv[4] : "");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tensordiff: %s\n", e.what());
    return 2;
  }
}
