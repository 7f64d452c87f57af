// The mesh's arithmetic (mesh.hpp): rank = (dp * pp_size + pp) * tp_size + tp.
#include "parallel/mesh.hpp"

#include <stdexcept>

#include "node.hpp"
#include "spec.hpp"

namespace flowrun::parallel {

const char* name(Dim d) {
  switch (d) {
    case Dim::dp: return "dp";
    case Dim::pp: return "pp";
    case Dim::tp: return "tp";
    case Dim::ep: return "ep";
    case Dim::edp: return "edp";
  }
  return "?";
}

Mesh::Mesh(int world, int tp, int pp, int ep) : world_(world), pp_(pp), tp_(tp), ep_(ep) {
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
  if (ep < 1 || dp_ % ep != 0)
    throw std::invalid_argument("run.parallel: ep " + std::to_string(ep) + " does not divide the data-parallel size " +
                                std::to_string(dp_) + " (" + std::to_string(world) + " processes / (tp " +
                                std::to_string(tp) + " x pp " + std::to_string(pp) + ")); expert parallel is cut out of "
                                "the data-parallel ranks, so launch a multiple of tp x pp x ep processes or choose an ep "
                                "dividing " + std::to_string(dp_));
}

int Mesh::size(Dim d) const {
  switch (d) {
    case Dim::dp: return dp_;
    case Dim::pp: return pp_;
    case Dim::tp: return tp_;
    case Dim::ep: return ep_;
    case Dim::edp: return dp_ / ep_;
  }
  return 1;
}

int Mesh::at(const Coord& c, Dim d) const {
  switch (d) {
    case Dim::dp: return c.dp;
    case Dim::pp: return c.pp;
    case Dim::tp: return c.tp;
    case Dim::ep: return c.dp % ep_;
    case Dim::edp: return c.dp / ep_;
  }
  return 0;
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
    switch (d) {
      case Dim::dp: c.dp = i; break;
      case Dim::pp: c.pp = i; break;
      case Dim::tp: c.tp = i; break;
      case Dim::ep: c.dp = c.dp / ep_ * ep_ + i; break;
      case Dim::edp: c.dp = i * ep_ + c.dp % ep_; break;
    }
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
    case Dim::ep: return ((c.dp / ep_) * pp_ + c.pp) * tp_ + c.tp;
    case Dim::edp: return ((c.dp % ep_) * pp_ + c.pp) * tp_ + c.tp;
  }
  return 0;
}

std::string Mesh::describe() const {
  return "dp " + std::to_string(dp_) + (ep_ > 1 ? " (ep " + std::to_string(ep_) + ")" : "") + " x pp " + std::to_string(pp_) + " x tp " + std::to_string(tp_) + " (" +
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
    std::string line = "rank " + std::to_string(r) + ": dp " + std::to_string(c.dp) +
                       (ep_ > 1 ? " (ep " + std::to_string(at(c, Dim::ep)) + ")" : "") + ", pp " + std::to_string(c.pp) +
                       ", tp " + std::to_string(c.tp) + ";";
    bool first = true;
    for (Dim d : {Dim::tp, Dim::pp, Dim::dp, Dim::ep, Dim::edp}) {
      if (size(d) == 1 || (d == Dim::edp && ep_ == 1)) continue;
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
                  ", dp = r / " + std::to_string(tp_ * pp_) + (ep_ > 1 ? ", ep = dp mod " + std::to_string(ep_) : "") +
                  " (" + std::to_string(world_) + " ranks; the first " +
                  std::to_string(max_rows / 2) + " and the last shown)");
  for (int r = 0; r < max_rows / 2; ++r) lines.push_back(row(r));
  lines.push_back("...");
  lines.push_back(row(world_ - 1));
  return lines;
}

Mesh mesh_of(const RunInfo& run) {
  if (!run.graph) return Mesh(run.world, 1, 1);
  const RunSettings::Parallel& p = run.graph->settings.parallel;
  return Mesh(run.world, p.tp, p.pp, p.ep);
}

Replica replica_of(const RunInfo& run) {
  const Mesh mesh = mesh_of(run);
  const Mesh::Coord c = mesh.coord(run.rank);
  return {c.dp, mesh.size(Dim::dp), c.tp == 0 && c.pp == 0};
}

}  // namespace flowrun::parallel
