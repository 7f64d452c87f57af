// IndexKits' Index V2 (HunyuanDiT's data index: `idk base`, `idk multireso`), read as its own
// ArrowIndexV2 / MultiResolutionBucketIndexV2 read it. Torch- and Arrow-free.
//
// An Index V2 JSON lists Arrow files ("arrow_files"), their cumulative row counts
// ("cum_length": file k holds global rows [cum_length[k-1], cum_length[k])), and the rows to
// train on ("indices": global rows, filtered and repeated as the index was built), grouped per
// file ("group_length"). Two kinds:
//   - base: "indices" a list (or, over 5,000,000 of them, stored in "indices_file", an .npz
//     beside the JSON with the list as array "x"), "group_length" a list;
//   - multi-resolution: "group_length" an object keyed by bucket "HxW" (height x width), the
//     indices of each bucket in "indices_file" (an .npz with one array per key).
// Relative arrow_files are looked for beside the JSON first, then in the current folder (where
// IndexKits' own loader looks). Every error names the JSON (or .npz) and the key or entry.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flowrun {

struct IndexV2 {
  struct Bucket {
    int height = 0, width = 0;    // from the key "HxW"
    std::vector<int64_t> indices;  // global rows
  };
  std::string path;                     // the JSON
  std::vector<std::string> data_type;   // the builder's notes (multireso: base_size=..., reso_step=...)
  std::vector<std::string> arrow_files; // resolved (see above)
  std::vector<int64_t> cum_length;
  bool multireso = false;
  std::vector<int64_t> indices;  // base
  std::vector<Bucket> buckets;   // multi-resolution, sorted by h/w as MultiResolutionBucketIndexV2 sorts them

  int64_t rows() const { return cum_length.empty() ? 0 : cum_length.back(); }
  // The file holding global row `row` and the row inside it (IndexKits: bisect on cum_length).
  std::pair<int, int64_t> locate(int64_t row) const;
};

// Reads and checks an Index V2 JSON: the keys and their types, arrow_files and cum_length of one
// length, cum_length increasing, every index inside [0, cum_length[-1]), group_length summing to
// the indices. Throws std::runtime_error naming the file and key. (That the Arrow files exist
// and hold cum_length's rows is the reader's to check: it opens them.) An index of more than
// max_entries entries (the indices, all buckets together) is refused before they are expanded
// in memory, naming the count and the setting that raises it; *entries_from_file gets the count
// when they came from an indices_file (.npz), for the caller's log.
IndexV2 read_index_v2(const std::string& path, int64_t max_entries = INT64_MAX, int64_t* entries_from_file = nullptr);

// IndexKits' ArrowIndexV2.align: repeats the last indices (each once more, or all of them n
// times when that is not enough) so that their count is a multiple of `align`. Unchanged when
// it already is.
std::vector<int64_t> align_indices(std::vector<int64_t> indices, int64_t align);

// The integer arrays of a NumPy .npz (np.savez or np.savez_compressed: a zip of .npy files,
// stored or deflated, zip64 headers as NumPy writes them), by name without ".npy". 1-D arrays
// of int8..int64 and uint8..uint32, little-endian; anything else, and any damage, is refused
// with std::runtime_error naming the file and array (fuzzed: tests/fuzz/fuzz_npz.cpp).
// More than max_values values in all (known from each member's sizes before it is inflated) is
// refused: a small deflated file can claim hundreds of millions.
std::map<std::string, std::vector<int64_t>> read_npz_int_arrays(const std::string& path, int64_t max_values = INT64_MAX,
                                                                const std::string& raise_with = "");

}  // namespace flowrun
