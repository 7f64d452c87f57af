// Helpers for the end-to-end shell tests (tests/mpi/mpi_test.sh):
//   testtool tensor-diff A.safetensors B.safetensors TOL [SKIP_REGEX]
//       max |a - b| over the tensors both files hold (names must match; tensors whose name
//       matches SKIP_REGEX are left out of the max and listed); exit 1 if > TOL
//   testtool trace-overlap TRACE.json PRODUCER CONSUMER
//       how many steps have a CONSUMER mark span ("CONSUMER: bucket ...") that starts before
//       the PRODUCER node's span of the same step ends; prints it, exit 1 if none
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>

#include "common/safetensors.hpp"

namespace {

int tensor_diff(const std::string& a, const std::string& b, double tol, const std::string& skip) {
  auto fa = flowrun::safetensors::load(a), fb = flowrun::safetensors::load(b);
  double worst = 0;
  std::string where;
  const std::regex skipped(skip.empty() ? "$^" : skip);
  for (const auto& [name, ta] : fa.tensors) {
    auto it = fb.tensors.find(name);
    if (it == fb.tensors.end()) {
      std::printf("%s is missing from %s\n", name.c_str(), b.c_str());
      return 1;
    }
    const double d = (ta.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>();
    if (std::regex_search(name, skipped)) {
      std::printf("left out: %s (max abs diff %.3g)\n", name.c_str(), d);
      continue;
    }
    if (d > worst) worst = d, where = name;
  }
  if (fa.tensors.size() != fb.tensors.size()) {
    std::printf("%s has %zu tensors, %s %zu\n", a.c_str(), fa.tensors.size(), b.c_str(), fb.tensors.size());
    return 1;
  }
  std::printf("max abs diff %.3g (%s) over %zu tensors; tolerance %.3g\n", worst, where.c_str(), fa.tensors.size(), tol);
  return worst <= tol ? 0 : 1;
}

int trace_overlap(const std::string& file, const std::string& producer, const std::string& consumer) {
  std::ifstream in(file);
  nlohmann::json j = nlohmann::json::parse(in);
  std::map<int64_t, double> producer_end;
  std::map<int64_t, double> first_mark;
  for (const auto& e : j["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const std::string name = e.value("name", "");
    const int64_t step = e["args"].value("step", int64_t{-1});
    const double ts = e.value("ts", 0.0), dur = e.value("dur", 0.0);
    if (name == producer && e.value("cat", "") != "mark") producer_end[step] = ts + dur;
    if (name.rfind(consumer + ": bucket", 0) == 0) {
      auto it = first_mark.find(step);
      if (it == first_mark.end() || ts < it->second) first_mark[step] = ts;
    }
  }
  int overlapped = 0;
  for (const auto& [step, t] : first_mark) {
    auto it = producer_end.find(step);
    if (it != producer_end.end() && t < it->second) ++overlapped;
  }
  std::printf("%d of %zu steps: a '%s' bucket started before '%s' ended\n", overlapped, first_mark.size(),
              consumer.c_str(), producer.c_str());
  return overlapped > 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "tensor-diff" && (argc == 5 || argc == 6))
      return tensor_diff(argv[2], argv[3], std::stod(argv[4]), argc == 6 ? argv[5] : "");
    if (cmd == "trace-overlap" && argc == 5) return trace_overlap(argv[2], argv[3], argv[4]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "testtool: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: testtool tensor-diff A B TOL | trace-overlap TRACE PRODUCER CONSUMER\n");
  return 2;
}
