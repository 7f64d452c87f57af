// Helpers for the end-to-end shell tests (tests/mpi/mpi_test.sh):
//   testtool tensor-diff A.safetensors B.safetensors TOL [SKIP_REGEX]
//       max |a - b| over the tensors both files hold (names must match; tensors whose name
//       matches SKIP_REGEX are left out of the max and listed); exit 1 if > TOL
//   testtool trace-overlap TRACE.json PRODUCER CONSUMER
//       how many steps have a CONSUMER mark span ("CONSUMER: bucket ...") that starts before
//       the PRODUCER node's span of the same step ends; prints it, exit 1 if none
//   mpirun -np N testtool mesh-groups TP PP
//       the mesh of N processes (nodes/parallel/mesh.hpp) as MPI channels, one per dimension
//       (comm::Channel::create_split): each channel's rank and size are the rank's coordinate and
//       the dimension's size, and an all-reduce, a reduce-scatter and an all-gather of uneven
//       blocks on it reach exactly the group's members; prints one line per dimension on rank 0,
//       exit 1 on the first mismatch (naming rank, dimension and values)
//   mpirun -np N testtool mesh-hang TP PP
//       rank 1 never joins its tp group's all-reduce (alive, silent); its partner's wait ends after
//       the collective timeout (2 s) and ends the whole job, every group's ranks included
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>

#include "comm.hpp"
#include "common/safetensors.hpp"
#include "parallel/collectives.hpp"
#include "parallel/mesh.hpp"

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

// Rank r's value in element i of its block for q: distinct for every (r, q, i).
double value(int r, int q, size_t i) { return 1000.0 * r + 10.0 * q + static_cast<double>(i); }

int mesh_groups(int tp, int pp) {
  namespace comm = flowrun::comm;
  using flowrun::parallel::Dim;
  const flowrun::parallel::Mesh mesh(comm::size(), tp, pp);
  const int me = comm::rank();
  auto fail = [&](Dim d, const std::string& what) {
    std::fprintf(stderr, "rank %d, %s group: %s\n", me, flowrun::parallel::name(d), what.c_str());
    return 1;
  };
  for (Dim d : {Dim::tp, Dim::pp, Dim::dp}) {
    const std::vector<int> group = mesh.group(d, me);
    const int n = static_cast<int>(group.size());
    auto ch = comm::Channel::create_split(flowrun::parallel::name(d), mesh.color(d, me), mesh.coord(me).at(d));
    if (ch->rank() != mesh.coord(me).at(d) || ch->size() != n)
      return fail(d, "channel rank " + std::to_string(ch->rank()) + " of " + std::to_string(ch->size()) +
                         ", expected " + std::to_string(mesh.coord(me).at(d)) + " of " + std::to_string(n));
    // All-reduce: the sum of the members' world ranks.
    double sum = me, want = 0;
    for (int r : group) want += r;
    ch->allreduce(&sum, 1, comm::DType::f64, comm::Op::sum, "sum of ranks").wait();
    if (sum != want) return fail(d, "all-reduce gave " + std::to_string(sum) + ", expected " + std::to_string(want));
    // Uneven blocks: member q's block holds q + 1 elements.
    std::vector<size_t> counts;
    size_t total = 0;
    for (int q = 0; q < n; ++q) counts.push_back(static_cast<size_t>(q + 1)), total += static_cast<size_t>(q + 1);
    std::vector<double> send(total), mine(counts[static_cast<size_t>(ch->rank())]);
    for (int q = 0, at = 0; q < n; ++q)
      for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i) send[static_cast<size_t>(at++)] = value(me, q, i);
    ch->reduce_scatter(send.data(), mine.data(), counts, comm::DType::f64, comm::Op::sum, "reduce-scatter").wait();
    for (size_t i = 0; i < mine.size(); ++i) {
      double expect = 0;
      for (int r : group) expect += value(r, ch->rank(), i);
      if (mine[i] != expect)
        return fail(d, "reduce-scatter element " + std::to_string(i) + " is " + std::to_string(mine[i]) +
                           ", expected " + std::to_string(expect));
    }
    std::vector<double> all(total, -1.0);
    size_t at = 0;
    for (int q = 0; q < ch->rank(); ++q) at += counts[static_cast<size_t>(q)];
    for (size_t i = 0; i < counts[static_cast<size_t>(ch->rank())]; ++i) all[at + i] = value(me, ch->rank(), i);
    ch->allgather_blocks(all.data(), counts, sizeof(double), "all-gather").wait();
    at = 0;
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < counts[static_cast<size_t>(q)]; ++i, ++at)
        if (all[at] != value(group[static_cast<size_t>(q)], q, i))
          return fail(d, "all-gather block " + std::to_string(q) + " element " + std::to_string(i) + " is " +
                             std::to_string(all[at]) + ", expected rank " + std::to_string(group[static_cast<size_t>(q)]) + "'s");
    // The same through the one collective interface (parallel/collectives.hpp), on tensors.
    auto tensors = flowrun::parallel::Group::along("tensors", mesh, d, me);
    torch::Tensor t = torch::full({3}, static_cast<double>(me), torch::kDouble);
    tensors->all_reduce(t, comm::Op::sum, "sum of ranks").wait();
    torch::Tensor b = torch::full({2}, -1.0, torch::kFloat);
    if (tensors->rank() == 0) b.fill_(static_cast<float>(me));
    tensors->broadcast(b, 0, "the first member's rank").wait();
    if (t[2].item<double>() != want || b[1].item<float>() != static_cast<float>(group.front()))
      return fail(d, "the group's all-reduce gave " + std::to_string(t[2].item<double>()) + " (expected " +
                         std::to_string(want) + "), its broadcast " + std::to_string(b[1].item<float>()));
    if (me == 0)
      std::printf("%s: %d groups of %d, all-reduce, reduce-scatter and all-gather within each\n",
                  flowrun::parallel::name(d), comm::size() / n, n);
  }
  return 0;
}

int mesh_hang(int tp, int pp) {
  namespace comm = flowrun::comm;
  using flowrun::parallel::Dim;
  const flowrun::parallel::Mesh mesh(comm::size(), tp, pp);
  const int me = comm::rank();
  comm::set_timeout(2.0);
  auto group = flowrun::parallel::Group::along("hang", mesh, Dim::tp, me);
  if (me == 1) std::this_thread::sleep_for(std::chrono::seconds(120));  // alive, silent
  torch::Tensor t = torch::ones({4});
  try {
    group->all_reduce(t, comm::Op::sum, "an all-reduce rank 1 never joins").wait();
  } catch (const std::exception& e) {
    comm::abort_job(comm::where() + ": " + e.what(), 3);
  }
  // The ranks of other groups finish theirs, then wait here for the job's end (the abort).
  std::this_thread::sleep_for(std::chrono::seconds(120));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "tensor-diff" && (argc == 5 || argc == 6))
      return tensor_diff(argv[2], argv[3], std::stod(argv[4]), argc == 6 ? argv[5] : "");
    if (cmd == "trace-overlap" && argc == 5) return trace_overlap(argv[2], argv[3], argv[4]);
    if (cmd == "mesh-hang" && argc == 4) {
      flowrun::comm::init(&argc, &argv);
      return mesh_hang(std::stoi(argv[2]), std::stoi(argv[3]));
    }
    if (cmd == "mesh-groups" && argc == 4) {
      flowrun::comm::init(&argc, &argv);
      const int rc = mesh_groups(std::stoi(argv[2]), std::stoi(argv[3]));
      if (rc != 0) flowrun::comm::abort_job("testtool mesh-groups failed", rc);
      flowrun::comm::finalize();
      return rc;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "testtool: %s\n", e.what());
    return 2;
  }
  std::fprintf(stderr, "usage: testtool tensor-diff A B TOL | trace-overlap TRACE PRODUCER CONSUMER | mesh-groups TP PP | mesh-hang TP PP\n");
  return 2;
}
