// A plugin whose static initializer (a global object's constructor) throws while dlopen loads
// it: the process stops (glibc does not pass the exception on), but the message names the file.
#include <stdexcept>

#include "plugin_api.hpp"

namespace {
struct ThrowsWhenLoaded {
  ThrowsWhenLoaded() { throw std::runtime_error("deliberate failure in a static initializer"); }
};
const ThrowsWhenLoaded throws_when_loaded;
}  // namespace

FLOWRUN_PLUGIN(reg) { (void)reg; }
