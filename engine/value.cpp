#include "value.hpp"

#include <cxxabi.h>

#include <cstdlib>

namespace flowrun {

std::string demangle(const char* mangled) {
  int status = 0;
  char* s = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = (status == 0 && s) ? s : mangled;
  std::free(s);
  return out;
}

}  // namespace flowrun
