// Reading a checkpoint folder (formats/checkpoint_io.hpp), version 1 or 2, a state at a time: each
// state's tensors as a StateSource (common/state_io.hpp) that reads only the boxes asked for, out of
// the files mapped into memory (safetensors::map: a page is read when touched, and given back once
// copied), each chunk's CRC32C checked the first time any of it is read. A load at any layout
// reads this way: a rank asks for the pieces it holds, and gets the intersecting parts of the
// chunks every rank of the writing run saved.
#pragma once
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/safetensors.hpp"
#include "common/state_io.hpp"
#include "formats/checkpoint_io.hpp"

namespace flowrun {

// A checkpoint whose files are not as its manifest says (missing, truncated, bytes changed): resume
// falls back to an older one. The message names the file.
class DamagedCheckpoint : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class CheckpointReader {
 public:
  // Reads and checks the manifest (version 1: the chunks from its files' headers).
  explicit CheckpointReader(const std::string& folder);
  const ckpt::Manifest& manifest() const { return m_; }
  const std::string& folder() const { return folder_; }
  // State `ref`'s tensors (an error naming the folder when it holds no such state).
  std::unique_ptr<StateSource> state(const std::string& ref) const;

 private:
  friend class CheckpointStateSource;
  // The chunk's bytes as a tensor (a view of the mapped file), its checksum checked on first use.
  torch::Tensor chunk(const ckpt::TensorEntry& t, const ckpt::Chunk& c, const std::string& name) const;
  std::string folder_;
  ckpt::Manifest m_;
  mutable std::mutex mutex_;
  mutable std::map<std::string, safetensors::File> mapped_;  // file -> its tensors (views)
  mutable std::map<std::string, bool> checked_;             // file/key -> its checksum matched
};

}  // namespace flowrun
