// The checkpoint folder layout, shared by the checkpoint node (writes) and resume (reads):
//
//   OUT_DIR/checkpoints/
//     step_00000500/
//       model.params.safetensors          one process: one file per saved state, named by its ref,
//       opt.state.safetensors             holding its tensors whole
//       model.params.rank00001.safetensors  several: each rank's own file per state, holding the
//       ...                               pieces of the tensors it writes (below)
//       rng.safetensors                   torch's global CPU generator state (rank 0's)
//       manifest.json                     written last: what is where, with sizes and checksums
//     latest                              "step_00000500\n": moved (renamed) only once a folder is complete
//
// A folder is written as .step_00000500.tmp and renamed when complete.
//
// Version 2 (2026-12, issue 72), as PyTorch's distributed checkpoint (DCP) lays out its metadata:
// every tensor of every state by its global name, with its dtype, whole shape and chunks, each a
// box of the whole (offsets, sizes) stored in one file under one key, with the CRC32C of its
// bytes; every file with its size and CRC32C (formats/crc32c.hpp), computed as it was written,
// and the rank and host that wrote it. The chunks of a tensor cover it exactly once (checked when
// the manifest is read), so a load at any layout reads, for each piece a rank holds, the
// intersecting parts of the saved chunks and nothing else. Version 1 (whole tensors, one file per
// state, no checksums) still reads: its chunks are found in the files' headers.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flowrun::ckpt {

std::string step_folder(int64_t step);  // "step_00000500"

// A box of a whole tensor, stored in `file` under `key`.
struct Chunk {
  std::string file, key;
  std::vector<int64_t> offsets, sizes;
  std::string crc32c;  // of its bytes, 8 hex digits ("": not recorded, version 1)
  int64_t numel() const;
};
struct TensorEntry {
  std::string dtype;  // safetensors' name: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;
  std::vector<Chunk> chunks;
};
struct FileEntry {
  int64_t bytes = 0;
  std::string crc32c;  // of the whole file
  int rank = 0;        // who wrote it
  std::string host;
};

struct Manifest {
  int version = 2;
  int64_t step = 0;
  std::string graph, name, config;
  // Every state ref saved; version 1: -> its file (whole tensors); version 2: -> "".
  std::map<std::string, std::string> states;
  std::string rng_file;
  int world = 0;  // the processes of the run that wrote it (0: not recorded, a manifest before 2026-12)
  std::map<std::string, int64_t> mesh;  // version 2: "dp", "tp", "pp" of the run that wrote it
  // Version 2: state ref -> tensor name -> entry; every file of the folder (the manifest aside).
  std::map<std::string, std::map<std::string, TensorEntry>> tensors;
  std::map<std::string, FileEntry> files;
};

void write_manifest(const std::string& folder, const Manifest& m);
// Throws naming the file and the field (a step < 1, a file outside the folder, a wrong type, a
// chunk outside its tensor, chunks that overlap or leave part of a tensor uncovered, a file the
// chunks name that the manifest does not list).
Manifest read_manifest(const std::string& folder);

// The files a version 2 manifest lists, each present with the size it records ("" when so, else
// what is wrong, naming the file: missing, truncated, grown). Reads no data: what resume checks
// of every candidate. Version 1: "".
std::string check_files(const std::string& folder, const Manifest& m);
// File `name` of the folder read whole and its CRC32C compared with the manifest's ("" when it
// matches, else what is wrong, naming the file).
std::string verify_file(const std::string& folder, const std::string& name, const FileEntry& entry);

// The folder `latest` names under `dir`, or "" if there is none (missing, empty, a folder):
// formats/files.hpp's read_latest.
std::string latest(const std::string& dir);

// Every step_* folder under `dir`: the complete ones (a valid manifest, its files all there at
// their sizes) first, newest step first; then the others, with why they cannot be read.
struct Found {
  std::string folder;
  int64_t step = 0;     // from the manifest
  std::string problem;  // empty: complete
};
std::vector<Found> checkpoints(const std::string& dir);
void set_latest(const std::string& dir, const std::string& folder_name);
// (Paths through `latest`, atomic writes: formats/files.hpp.)

}  // namespace flowrun::ckpt
