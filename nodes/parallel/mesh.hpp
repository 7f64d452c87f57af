// The room for parallelism (docs/distributed.md): the processes of a run as a mesh of named
// dimensions, as torchtitan's ParallelDims / DeviceMesh and Megatron-LM's parallel_state.
//
//   run: { parallel: { tp: 2, pp: 1 } }      mpirun -np 8 flowrun GRAPH
//   -> dp 4 x pp 1 x tp 2; rank r = (dp * pp_size + pp) * tp_size + tp
//
// tp varies fastest, so the tensor-parallel ranks of a replica are neighbours (on one machine
// when they fit: their collectives are the most frequent), then pp, then dp. A group of a
// dimension is the ranks that differ only in that coordinate: rank 5 of the mesh above is
// (dp 2, pp 0, tp 1); its tp group is ranks {4, 5}, its dp group {1, 3, 5, 7}.
//
// Expert parallel (run.parallel.ep, a mixture of experts' experts split over ranks; issue 73) is
// carved out of dp, as torchtitan's and Megatron-LM's: the dp coordinate d of a rank is
// (d / ep, d mod ep), ep fastest, so the ep ranks of a group are dp neighbours. Two more groups
// follow: `ep` (the ranks that share one set of experts between them: the all-to-all's) and `edp`
// (the ranks that hold the same experts: what an expert's gradient is summed over, dp / ep of
// them). dp 4 x ep 2 over 4 ranks: ep groups {0, 1} and {2, 3}, edp groups {0, 2} and {1, 3}.
//
// Pure arithmetic, no MPI and no torch: the run session builds it once from run.parallel and the
// world, `flowrun explain` prints it, and collectives over a dimension use group() and color()
// (comm::Channel::create's split).
#pragma once
#include <string>
#include <vector>

namespace flowrun {
struct RunInfo;
}

namespace flowrun::parallel {

// ep and edp are cuts of dp (above): ep's coordinate is dp mod ep, edp's dp / ep.
enum class Dim { dp, pp, tp, ep, edp };
const char* name(Dim d);  // "dp", "pp", "tp", "ep", "edp"

class Mesh {
 public:
  struct Coord {
    int dp = 0, pp = 0, tp = 0;
    bool operator==(const Coord& o) const { return dp == o.dp && pp == o.pp && tp == o.tp; }
  };

  Mesh() = default;  // a single process: every dimension 1
  // `world` processes split as tp x pp per replica, the replicas' experts over ep of them; throws
  // (naming the numbers and how to fix them) when tp x pp does not divide the world or ep the dp.
  Mesh(int world, int tp, int pp, int ep = 1);

  int world() const { return world_; }
  int size(Dim d) const;
  Coord coord(int rank) const;
  int at(const Coord& c, Dim d) const;  // the coordinate along d (ep: dp mod ep; edp: dp / ep)
  int rank_of(const Coord& c) const;
  // The ranks of `rank`'s group along `d` (its other coordinates fixed), by their coordinate in d.
  std::vector<int> group(Dim d, int rank) const;
  // The same number for every member of that group and a different one for every other group
  // along `d`, 0-based (MPI_Comm_split's color; the member's position is its coordinate in d).
  int color(Dim d, int rank) const;
  // "dp 4 x pp 1 x tp 2 (8 processes)"; with ep: "dp 4 (ep 2) x pp 1 x tp 2 (8 processes)"
  std::string describe() const;
  // One line per rank: "rank 5: dp 2, pp 0, tp 1; tp group {4, 5}, dp group {1, 3, 5, 7}"; a
  // group of more than 6 ranks as its progression ("{1, 3, 5, ..., 65535} (32768 ranks, step
  // 2)"). Over max_rows ranks: the rule that gives any rank's coordinates, the first ranks and
  // the last, so the text stays a few lines at any world size.
  std::vector<std::string> table(int max_rows = 16) const;

 private:
  int world_ = 1, dp_ = 1, pp_ = 1, tp_ = 1, ep_ = 1;
};

// The run's mesh: run.parallel of its graph over its world (a RunInfo without a graph, as in
// tests: world x 1 x 1).
Mesh mesh_of(const RunInfo& run);

// The data-parallel replica a rank belongs to and how many there are: what data readers,
// evaluators and samplers shard by (the tp and pp ranks of one replica read the same batches).
// Without tp or pp: the rank and the world.
struct Replica {
  int index = 0, count = 1;
  // This rank is its replica's first (tp 0, pp 0): the one of them that counts what they all
  // compute alike (an evaluator's sums).
  bool first = true;
};
Replica replica_of(const RunInfo& run);

}  // namespace flowrun::parallel
