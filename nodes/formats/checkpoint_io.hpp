// The checkpoint folder layout, shared by the checkpoint node (writes) and resume (reads):
//
//   OUT_DIR/checkpoints/
//     step_00000500/
//       model.params.safetensors   one file per saved state, named by its ref
//       opt.state.safetensors
//       rng.safetensors            torch's global CPU generator state
//       manifest.json              written last: step, states -> files, resolved config, processes
//     latest                       "step_00000500\n": moved (renamed) only once a folder is complete
//
// A folder is written as .step_00000500.tmp and renamed when complete.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flowrun::ckpt {

std::string step_folder(int64_t step);  // "step_00000500"

struct Manifest {
  int64_t step = 0;
  std::string graph, name, config;
  std::map<std::string, std::string> states;  // ref -> file in the folder
  std::string rng_file;
  int world = 0;  // the processes of the run that wrote it (0: not recorded, a manifest before 2026-12)
};

void write_manifest(const std::string& folder, const Manifest& m);
// Throws naming the file and the field (a step < 1, a file outside the folder, a wrong type).
Manifest read_manifest(const std::string& folder);

// The folder `latest` names under `dir`, or "" if there is none (missing, empty, a folder):
// formats/files.hpp's read_latest.
std::string latest(const std::string& dir);

// Every step_* folder under `dir`: the complete ones (a valid manifest) first, newest step
// first; then the others, with why they cannot be read.
struct Found {
  std::string folder;
  int64_t step = 0;     // from the manifest
  std::string problem;  // empty: complete
};
std::vector<Found> checkpoints(const std::string& dir);
void set_latest(const std::string& dir, const std::string& folder_name);
// (Paths through `latest`, atomic writes: formats/files.hpp.)

}  // namespace flowrun::ckpt
