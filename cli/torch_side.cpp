// Opening the torch side of the flowrun command (torch_side.hpp).
#include "torch_side.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <stdexcept>

namespace flowrun::cli {

namespace {

constexpr const char* kLibrary = "libflowrun_cli_torch.so";

// The library next to the running binary (build/engine/ in a build folder), opened once.
void* torch_side() {
  static void* handle = [] {
    std::error_code ec;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    const std::string path = ec ? std::string(kLibrary) : (self.parent_path() / kLibrary).string();
    // RTLD_GLOBAL: its libraries (libtorch among them) join the global scope, where they were when
    // the binary linked them, so libraries opened later (plugins, OpenBLAS) resolve as before.
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) throw std::runtime_error("cannot load " + path + ", the part of flowrun that runs graphs, plans and prep " +
                                     "(with libtorch): " + dlerror() + "; it must sit beside the flowrun binary: build " +
                                     "both (cmake --build BUILD_DIR --target flowrun) and keep them in one folder");
    return h;
  }();
  return handle;
}

template <typename F>
F entry(const char* name) {
  void* sym = dlsym(torch_side(), name);
  if (!sym) throw std::runtime_error(std::string("libflowrun_cli_torch.so has no ") + name + "; rebuild flowrun");
  return reinterpret_cast<F>(sym);
}

}  // namespace

int run_graph(const GraphSpec* g) {
  try {
    return entry<int (*)(const GraphSpec*)>("flowrun_cli_torch_run")(g);
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "flowrun: %s\n", e.what());
    return 2;
  }
}

int torch_command(const std::string& name, const std::vector<std::string>& args) {
  try {
    return entry<int (*)(const char*, const std::vector<std::string>*)>("flowrun_cli_torch_command")(name.c_str(), &args);
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "flowrun: %s\n", e.what());
    return 2;
  }
}

}  // namespace flowrun::cli
