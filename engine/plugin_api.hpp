// Writing a plugin: a shared library with more node types.
//
//   #include <flowrun/plugin_api.hpp>   (engine/plugin_api.hpp)
//   class Lion : public flowrun::Node { ... };
//   static const char* kSchema = R"(type: lion ...)";
//   FLOWRUN_PLUGIN(reg) {
//     reg.add(kSchema, [] { return std::make_unique<Lion>(); }, FLOWRUN_PLUGIN_FILE);
//   }
//
// A type whose name is already registered (a built-in, another plugin's) is refused by
// reg.add; reg.replace(...) (same arguments) replaces it on purpose, with a warning.
//
// The macro defines the one C entry point the engine looks for. It compares the engine's ABI
// version with the one this plugin was compiled against and registers nothing on a mismatch
// (the engine then reports both numbers and the file).
#pragma once
#include "registry.hpp"

// Bump when Node, the contexts, Value or Registry change layout or meaning, or an interface a
// plugin implements does (Objective, UpdateRule): a plugin built before is then refused by name
// instead of calling into a vtable it does not have.
//   2: Objective::denoising() and captioning(); optimizer rules as UpdateRule (add_update_rule).
//   3: UpdateRule::own_moment_dim() and Step::part (a tensor-parallel part of a parameter).
#define FLOWRUN_ABI_VERSION 3

// Tests build a plugin with another number to prove the check works.
#ifndef FLOWRUN_PLUGIN_ABI
#define FLOWRUN_PLUGIN_ABI FLOWRUN_ABI_VERSION
#endif

#define FLOWRUN_PLUGIN_ENTRY "flowrun_plugin_register"
// Filled by the engine while the entry point runs: the plugin file's path, for schemas' origin.
#define FLOWRUN_PLUGIN_FILE (::flowrun::current_plugin_file())

namespace flowrun {
const std::string& current_plugin_file();
}

// Returns 0 on success; 1 on an ABI mismatch (plugin_abi tells the plugin's version).
extern "C" typedef int (*flowrun_plugin_fn)(int engine_abi, int* plugin_abi, flowrun::Registry* reg);

#define FLOWRUN_PLUGIN(REG)                                                                        \
  static void flowrun_plugin_body(::flowrun::Registry& REG);                                       \
  extern "C" __attribute__((visibility("default"))) int flowrun_plugin_register(                  \
      int engine_abi, int* plugin_abi, ::flowrun::Registry* reg) {                                 \
    *plugin_abi = FLOWRUN_PLUGIN_ABI;                                                              \
    if (engine_abi != FLOWRUN_PLUGIN_ABI) return 1;                                                \
    flowrun_plugin_body(*reg);                                                                     \
    return 0;                                                                                      \
  }                                                                                                \
  static void flowrun_plugin_body(::flowrun::Registry& REG)
