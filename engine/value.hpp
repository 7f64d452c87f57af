// Value: what travels on a port. Any C++ type (a torch::Tensor, a map of tensors, a double,
// a shared_ptr to a state object); producer and consumer agree on it through the schema's
// port `type`, and a mismatch at run time is an error naming both types.
#pragma once
#include <any>
#include <memory>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace flowrun {

std::string demangle(const char* mangled);

class Value {
 public:
  Value() = default;
  template <class T, class = std::enable_if_t<!std::is_same_v<std::decay_t<T>, Value>>>
  Value(T&& v) : a_(std::forward<T>(v)) {}  // NOLINT: implicit on purpose, ctx.out("x", tensor)

  bool empty() const { return !a_.has_value(); }
  std::string type_name() const { return empty() ? "nothing" : demangle(a_.type().name()); }

  template <class T>
  bool is() const { return a_.type() == typeid(T); }
  const std::type_info& type() const { return a_.type(); }

  // The held T, or an error saying what was expected and what is there; `what` names the
  // port for the message ("input 'batch' of node 'fb'").
  template <class T>
  const T& as(const std::string& what = "value") const {
    if (const T* p = std::any_cast<T>(&a_)) return *p;
    throw std::runtime_error(what + ": expected " + demangle(typeid(T).name()) + ", got " + type_name());
  }
  template <class T>
  T& as_mut(const std::string& what = "value") {
    if (T* p = std::any_cast<T>(&a_)) return *p;
    throw std::runtime_error(what + ": expected " + demangle(typeid(T).name()) + ", got " + type_name());
  }
  template <class T>
  const T* get_if() const { return std::any_cast<T>(&a_); }

 private:
  std::any a_;
};

}  // namespace flowrun
