// Small file helpers shared by every layer that writes or names files (torch-free; part of the
// flowrun_formats library): atomic writes and paths through a checkpoint's `latest` file.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace flowrun {

// The whole file. Throws std::invalid_argument naming the path and why it cannot be read (a
// bad input, not a failed write: the prep commands exit 2 for it).
std::string read_file(const std::string& path);

// A sample of a file's bytes, to fingerprint its content cheaply: its size (8 bytes), then its
// first and last 4 KiB and 16 blocks of 4 KiB spread evenly between (the whole file when it is
// smaller). A change of content at equal size shows unless it falls between the blocks; copying
// or touching the file (mtime, inode) does not. At most ~72 KiB read. Throws std::runtime_error
// naming the file when it cannot be read. (Hash it with fnv1a, engine/hash.hpp.)
std::string sampled_content(const std::string& path);

// `s` without leading and trailing spaces, tabs, CRs and LFs (captions, one-line files).
std::string trim_space(std::string_view s);

// Write `text` to PATH.tmp, fsync, rename over PATH: a reader sees the old file or the new
// one, never half of one.
void write_file_atomic(const std::string& path, const std::string& text);

// The name in DIR/latest (the one-line file a checkpoint node moves to its newest complete
// folder), or "" if there is none (missing, empty, a folder).
std::string read_latest(const std::string& dir);

// A path through a checkpoint's `latest` file: each component named "latest" that is a file
// (not a folder) is replaced by the folder it names, so
// runs/dit_base/checkpoints/latest/ema.params.safetensors reads the newest checkpoint's file.
// Other paths come back unchanged. Every weights file (safetensors::load) and PEFT adapter
// folder is opened through it.
std::string resolve_latest(const std::string& path);

// The local time as "20261126-071502", for the names of files moved aside (metrics.previous-STAMP.jsonl).
std::string local_timestamp();

// Moves the file or folder FROM to BASE + SUFFIX, or to BASE-2 + SUFFIX, BASE-3 + SUFFIX, ...:
// the first name not taken. Never replaces anything (a clock set back, two starts in one
// second): the rename itself refuses an existing name (renameat2's RENAME_NOREPLACE). Returns
// where it went; throws std::filesystem::filesystem_error when it cannot move it.
std::string move_aside(const std::string& from, const std::string& base, const std::string& suffix = "");

// Makes a new empty folder BASE, or BASE-2, BASE-3, ... where BASE is taken; returns it.
std::string make_new_dir(const std::string& base);

}  // namespace flowrun
