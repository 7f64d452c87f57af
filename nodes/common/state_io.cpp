#include "common/state_io.hpp"

#include <mutex>

namespace flowrun {

namespace {
std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::map<std::type_index, StateIO>& table() {
  static std::map<std::type_index, StateIO> t;
  return t;
}
}  // namespace

void register_state_io(std::type_index type, StateIO io) {
  std::lock_guard<std::mutex> l(mu());
  table()[type] = std::move(io);
}

const StateIO* find_state_io(const Value& v) {
  std::lock_guard<std::mutex> l(mu());
  auto it = table().find(std::type_index(v.type()));
  return it == table().end() ? nullptr : &it->second;
}

}  // namespace flowrun
