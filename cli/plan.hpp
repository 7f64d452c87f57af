// flowrun plan's parts, one concern a file (docs/parallel.md "Planning a layout"):
//   plan.cpp          the command: the graph's roles, 2. the search, 3. the table and the overrides
//   plan_links.cpp    0. the links: --measure-links under mpirun, and --links FILE read back
//   plan_profile.cpp  1. the profile: the graph's model timed here, a few of its blocks at a few
//                     sizes, within a time budget, and extrapolated to the whole model
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "parallel/cost_model.hpp"
#include "spec.hpp"

namespace flowrun::cli::plan {

// The nodes the plan reads and overrides, found from forward_backward's inputs.
struct Roles {
  std::string fb, model, zero, model_type;
  // The data sources forward_backward's batch comes from (parallel::batch_sources), with their
  // rows a step (per replica), and their sum: a replica's batch. The plan scales each alike.
  std::vector<std::pair<std::string, int64_t>> sources;
  int64_t batch = 0;
  std::vector<std::string> batch_overrides(double rows) const;  // NODE.batch=N for a replica's `rows`
  bool whole_tensors = false;  // the optimizer's rule needs whole tensors a rank (Adafactor): ZeRO cuts at tensors
  std::vector<int64_t> split_sizes;  // the model's sizes tensor parallel must divide (heads, ...)
  std::string blocks_param;  // the model's parameter counting its alike blocks ("": they are not all alike)
  int64_t blocks = 0;        // its value
};
Roles roles_of(const GraphSpec& g);
const NodeSpec* node_named(const GraphSpec& g, const std::string& name);

// ---- 0. the links (plan_links.cpp)
int measure_links(const std::string& out_file);
void read_links(const std::string& file, parallel::cost::Cluster& c);

// ---- 1. the profile (plan_profile.cpp)
struct Profile {
  parallel::cost::Model model;
  bool splits = false;  // the family splits over tp and cuts into pipeline stages (gpt, dit, cappa)
  bool frozen = false;  // some parameters are frozen (LoRA): no pipeline stages
  double tokens_per_row = 0;  // what the first block sees of a row (0: not known)
  int threads = 0;            // the intra-op threads it ran with (0: not recorded)
  std::map<std::string, double> nodes;  // the other nodes' seconds a step (data, frozen encoders, metrics)
  int profiled_blocks = 0;    // of the model's blocks, how many ran (the others repeat the last of them; 0: all)
  double block_flops_per_row = 0;  // the last profiled block's model FLOPs a row (not saved: for repeating it)
};
nlohmann::json profile_json(const Profile& p);
Profile profile_of(const nlohmann::json& j);  // throws nlohmann::json::exception on a bad file

struct ProfileRequest {
  int64_t rows = 1;      // a replica's rows a step: the largest size worth timing
  int threads = 0;       // intra-op threads (0: the run's default)
  int neighbours = 0;    // threads computing beside it as the node's other devices (CPU)
  int cores = 0;         // this machine's cores (for the first line)
  int rounds = 1;        // runs of each size (medians)
  int64_t blocks = 1;    // the model's blocks that run (the rest repeat the last of them); 0: all
  double seconds = 45;   // the budget: sizes past it are not timed (the first one always is)
};
// Times the graph here (one process, one replica), each size a progress line with its estimate;
// the first stop signal exits at once.
Profile profile_here(const GraphSpec& g, const std::vector<std::string>& overrides, const Roles& r,
                     const ProfileRequest& q);

}  // namespace flowrun::cli::plan
