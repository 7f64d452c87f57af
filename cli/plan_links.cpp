// flowrun plan, 0. the links (plan.hpp): each collective the steps use, timed under mpirun over
// groups of 2, 4, ... ranks and buffers of 4 KiB to 16 MiB, fitted to a line (latency and
// bandwidth) per collective and group size, written as a file `--links` reads.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "plan.hpp"
#include "comm.hpp"
#include "parallel/collectives.hpp"
#include "parallel/mesh.hpp"

namespace flowrun::cli::plan {

namespace cost = parallel::cost;
using nlohmann::json;

// Under mpirun: every collective the steps use (all-reduce: data and tensor parallel; all-gather,
// whose reduce-scatter twin moves as much: ZeRO; a send between two ranks: pipeline stages),
// timed over the world cut into groups of g consecutive ranks (each group at once, as a mesh's
// tp groups run), for g = 2, 4, ... dividing the world, and the world. Each size: one warm-up,
// then repetitions back to back; a rank's mean, the slowest rank's kept.
int measure_links(const std::string& out_file) {
  const int world = comm::size(), rank = comm::rank();
  if (world < 2) {
    std::fprintf(stderr, "flowrun plan --measure-links: runs under mpirun with 2 or more ranks (mpirun -np 2 flowrun plan "
                         "--measure-links --out links.json); this is a single process\n");
    return 2;
  }
  std::vector<int> sizes;
  for (int g = 2; g <= world; g *= 2)
    if (world % g == 0) sizes.push_back(g);
  if (sizes.empty() || sizes.back() != world) sizes.push_back(world);
  const std::vector<double> buffers{4096, 16384, 65536, 262144, 1048576, 4194304, 16777216};
  const auto all = parallel::Group::world("plan --measure-links");
  auto slowest = [&](double s) {
    auto t = torch::tensor({s}, torch::kFloat64);
    all->all_reduce(t, comm::Op::max, "the slowest rank's time").wait();
    return t.item<double>();
  };
  json out = {{"ranks", world}, {"all_reduce", json::object()}, {"all_gather", json::object()}, {"send", json::object()}};
  if (rank == 0) {
    std::printf("measuring the collectives of %d ranks: groups of", world);
    for (int g : sizes) std::printf(" %d", g);
    std::printf(" ranks, buffers of 4 KiB to 16 MiB\n%-11s %6s %12s %12s %10s\n", "collective", "ranks", "latency us",
                "GB/s", "worst fit");
    std::fflush(stdout);
  }
  auto report = [&](const char* kind, int g, const std::vector<std::pair<double, double>>& pts) {
    const auto [line, worst] = cost::fit_link(pts);
    json samples = json::array();
    for (const auto& [b, t] : pts) samples.push_back({b, t});
    out[kind][std::to_string(g)] = {{"latency_s", line.latency_s}, {"bytes_per_s", line.bytes_per_s}, {"samples", samples}};
    if (rank == 0) std::printf("%-11s %6d %12.1f %12.3f %9.0f%%\n", kind, g, line.latency_s * 1e6, line.bytes_per_s / 1e9, 100 * worst);
    std::fflush(stdout);
  };
  for (int g : sizes) {
    const parallel::Mesh mesh(world, g, 1);
    auto group = parallel::Group::along("plan --measure-links", mesh, parallel::Dim::tp, rank);
    std::vector<std::pair<double, double>> reduce, gather, sends;
    for (double bytes : buffers) {
      const int64_t n = static_cast<int64_t>(bytes / 4);
      const int reps = bytes <= 1048576 ? 20 : 5;
      auto t = torch::ones({n}, torch::kFloat32);
      std::vector<size_t> counts(static_cast<size_t>(g), static_cast<size_t>(n / g));
      counts.back() += static_cast<size_t>(n % g);
      auto time = [&](auto&& op) {
        op();  // warm-up
        slowest(0);  // every rank starts together
        const auto t0 = comm::Clock::now();
        for (int i = 0; i < reps; ++i) op();
        return slowest(std::chrono::duration<double>(comm::Clock::now() - t0).count() / reps);
      };
      reduce.emplace_back(bytes, time([&] { group->all_reduce(t, comm::Op::sum, "measure all-reduce").wait(); }));
      gather.emplace_back(bytes, time([&] { group->all_gather(t, counts, "measure all-gather").wait(); }));
      if (g == 2)  // one way: half a round trip
        sends.emplace_back(bytes, time([&] {
                             if (group->rank() == 0) {
                               group->send(t, 1, "measure send").wait();
                               group->recv(t, 1, "measure send").wait();
                             } else {
                               group->recv(t, 0, "measure send").wait();
                               group->send(t, 0, "measure send").wait();
                             }
                           }) / 2);
    }
    report("all_reduce", g, reduce);
    report("all_gather", g, gather);
    if (g == 2) report("send", g, sends);
  }
  if (rank == 0) {
    std::ofstream f(out_file);
    f << out.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "flowrun plan --measure-links: cannot write %s\n", out_file.c_str());
      return 2;
    }
    std::printf("written to %s: flowrun plan GRAPH --devices N --links %s\n", out_file.c_str(), out_file.c_str());
  }
  return 0;
}

void read_links(const std::string& file, cost::Cluster& c) {
  std::ifstream in(file);
  if (!in) throw std::runtime_error("--links " + file + ": cannot read it");
  try {
    const json j = json::parse(in);
    auto take = [&](const char* kind, std::map<int, cost::Cluster::Curve>& into) {
      for (const auto& [g, l] : j.at(kind).items()) {
        cost::Cluster::Curve& c = into[std::stoi(g)];
        c.fit = {l.at("latency_s"), l.at("bytes_per_s")};
        for (const auto& p : l.at("samples")) c.points.emplace_back(p.at(0), p.at(1));
        std::sort(c.points.begin(), c.points.end());
      }
    };
    take("all_reduce", c.measured.all_reduce);
    take("all_gather", c.measured.all_gather);
    take("send", c.measured.send);
  } catch (const std::exception& e) {
    throw std::runtime_error("--links " + file + ": not a file flowrun plan --measure-links wrote (" + e.what() + ")");
  }
}

}  // namespace flowrun::cli::plan
