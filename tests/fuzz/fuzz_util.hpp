// Shared by the fuzz targets: a per-process scratch folder, writing an input to a file in it for
// the readers that take a path (tar, .idx, manifests, graph files), the built-in schemas.
#pragma once
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "registry.hpp"

namespace flowrun::fuzz {

// $TMPDIR/flowrun-fuzz-PID/, or $FLOWRUN_FUZZ_SCRATCH (fuzz_ci.sh: a name that is the same in
// every run, for reproducible runs), made once, removed at exit (the string lives as long as
// the process: the exit handler runs after static objects are destroyed).
inline const std::string& scratch() {
  static const std::string* dir = [] {
    const char* fixed = std::getenv("FLOWRUN_FUZZ_SCRATCH");
    const char* t = std::getenv("TMPDIR");
    auto* d = new std::string(fixed && *fixed ? std::string(fixed)
                                              : std::string(t && *t ? t : "/tmp") + "/flowrun-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(*d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(scratch(), ec);
    });
    return d;
  }();
  return *dir;
}

inline std::string write(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

inline std::string write(const std::string& name, const std::string& bytes) {
  return write(name, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// A registry of every built-in node schema, without factories: enough to check graph files
// (checking never makes a node). Logging off: the fuzzers' output is libFuzzer's.
inline Registry& builtin_schemas() {
  static Registry* reg = [] {
    spdlog::set_level(spdlog::level::off);
    auto* r = new Registry;
    for (const std::string& t : builtin_types()) r->add(builtin_schema(t), nullptr, "built-in");
    return r;
  }();
  return *reg;
}

// A broken promise of the code under test: crash so libFuzzer keeps the input.
#define FUZZ_CHECK(cond) \
  do {                   \
    if (!(cond)) __builtin_trap(); \
  } while (0)

}  // namespace flowrun::fuzz
