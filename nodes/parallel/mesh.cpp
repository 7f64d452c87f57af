// The mesh's arithmetic (mesh.hpp): rank = (dp * pp_size + pp) * tp_size + tp.
#include "parallel/mesh.hpp"

#include <stdexcept>

#include "node.hpp"
#include "spec.hpp"

namespace flowrun::parallel {

const char* name(Dim d) { return d == Dim::dp ? "dp" : d == Dim::pp ? "pp" : "tp"; }

Mesh::Mesh(int world, int tp, int pp) : world_(world), pp_(pp), tp_(tp) {
  if (world < 1 || tp < 1 || pp < 1)
    throw std::invalid_argument("parallel mesh: world " + std::to_string(world) + ", tp " + std::to_string(tp) +
                                ", pp " + std::to_string(pp) + ": each must be at least 1");
  if (world == 1 && tp * pp > 1)
    throw std::invalid_argument("run.parallel: tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " = " +
                                std::to_string(tp * pp) + " processes per replica, and this is a single process; " +
                                "launch a multiple of " + std::to_string(tp * pp) + " (mpirun -np " +
                                std::to_string(tp * pp) + " flowrun ...) or set run.parallel.tp and pp to 1");
  if (world % (tp * pp) != 0)
    throw std::invalid_argument("run.parallel: tp " + std::to_string(tp) + " x pp " + std::to_string(pp) + " = " +
                                std::to_string(tp * pp) + " does not divide the " + std::to_string(world) +
                                " processes; the data-parallel size is processes / (tp x pp), so launch a multiple of " +
                                std::to_string(tp * pp) + " processes (mpirun -np) or change run.parallel");
  dp_ = world / (tp * pp);
}

Mesh::Coord Mesh::coord(int rank) const {
  if (rank < 0 || rank >= world_)
    throw std::out_of_range("parallel mesh: rank " + std::to_string(rank) + " of " + std::to_string(world_));
  Coord c;
  c.tp = rank % tp_;
  c.pp = (rank / tp_) % pp_;
  c.dp = rank / (tp_ * pp_);
  return c;
}

int Mesh::rank_of(const Coord& c) const { return (c.dp * pp_ + c.pp) * tp_ + c.tp; }

std::vector<int> Mesh::group(Dim d, int rank) const {
  Coord c = coord(rank);
  std::vector<int> ranks;
  for (int i = 0; i < size(d); ++i) {
    (d == Dim::dp ? c.dp : d == Dim::pp ? c.pp : c.tp) = i;
    ranks.push_back(rank_of(c));
  }
  return ranks;
}

int Mesh::color(Dim d, int rank) const {
  // The group's smallest rank with d's coordinate dropped: the other two coordinates, numbered.
  const Coord c = coord(rank);
  switch (d) {
    case Dim::tp: return c.dp * pp_ + c.pp;
    case Dim::pp: return c.dp * tp_ + c.tp;
    case Dim::dp: return c.pp * tp_ + c.tp;
  }
  return 0;
}

std::string Mesh::describe() const {
  return "dp " + std::to_string(dp_) + " x pp " + std::to_string(pp_) + " x tp " + std::to_string(tp_) + " (" +
         std::to_string(world_) + (world_ == 1 ? " process)" : " processes)");
}

std::vector<std::string> Mesh::table(int max_rows) const {
  auto ranks = [](const std::vector<int>& g) {
    std::string s = "{";
    if (g.size() > 6) {  // an arithmetic progression: the group's coordinate times its stride
      for (size_t i = 0; i < 3; ++i) s += std::to_string(g[i]) + ", ";
      return s + "..., " + std::to_string(g.back()) + "} (" + std::to_string(g.size()) + " ranks, step " +
             std::to_string(g[1] - g[0]) + ")";
    }
    for (size_t i = 0; i < g.size(); ++i) s += (i ? ", " : "") + std::to_string(g[i]);
    return s + "}";
  };
  auto row = [&](int r) {
    const Coord c = coord(r);
    std::string line = "rank " + std::to_string(r) + ": dp " + std::to_string(c.dp) + ", pp " + std::to_string(c.pp) +
                       ", tp " + std::to_string(c.tp) + ";";
    bool first = true;
    for (Dim d : {Dim::tp, Dim::pp, Dim::dp}) {
      if (size(d) == 1) continue;
      line += std::string(first ? " " : ", ") + name(d) + " group " + ranks(group(d, r));
      first = false;
    }
    return first ? line.substr(0, line.size() - 1) : line;
  };
  std::vector<std::string> lines;
  if (world_ <= max_rows) {
    for (int r = 0; r < world_; ++r) lines.push_back(row(r));
    return lines;
  }
  lines.push_back("rank r: tp = r mod " + std::to_string(tp_) + ", pp = (r / " + std::to_string(tp_) + ") mod " + std::to_string(pp_) +
                  ", dp = r / " + std::to_string(tp_ * pp_) + " (" + std::to_string(world_) + " ranks; the first " +
                  std::to_string(max_rows / 2) + " and the last shown)");
  for (int r = 0; r < max_rows / 2; ++r) lines.push_back(row(r));
  lines.push_back("...");
  lines.push_back(row(world_ - 1));
  return lines;
}

Mesh mesh_of(const RunInfo& run) {
  if (!run.graph) return Mesh(run.world, 1, 1);
  return Mesh(run.world, run.graph->settings.parallel.tp, run.graph->settings.parallel.pp);
}

Replica replica_of(const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  const Mesh::Coord c = mesh.coord(run.rank);
  return {c.dp, mesh.size(Dim::dp), c.tp == 0 && c.pp == 0};
}

}  // namespace flowrun::parallel
