#include "formats/checkpoint_io.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <stdexcept>
#include <vector>

#include "formats/crc32c.hpp"
#include "formats/files.hpp"
#include "formats/json_file.hpp"

namespace flowrun::ckpt {

namespace fs = std::filesystem;

std::string step_folder(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

int64_t Chunk::numel() const {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  return n;
}

void write_manifest(const std::string& folder, const Manifest& m) {
  nlohmann::json j;
  j["format"] = "flowrun-checkpoint";
  j["version"] = m.version;
  j["step"] = m.step;
  j["graph"] = m.graph;
  j["name"] = m.name;
  j["rng"] = m.rng_file;
  j["config"] = m.config;
  if (m.world > 0) j["world"] = m.world;
  if (m.version == 1) {
    j["states"] = m.states;
  } else {
    if (!m.mesh.empty()) j["mesh"] = m.mesh;
    nlohmann::json files = nlohmann::json::object();
    for (const auto& [name, f] : m.files)
      files[name] = {{"bytes", f.bytes}, {"crc32c", f.crc32c}, {"rank", f.rank}, {"host", f.host}};
    j["files"] = files;
    nlohmann::json states = nlohmann::json::object();
    for (const auto& [ref, tensors] : m.tensors) {
      nlohmann::json ts = nlohmann::json::object();
      for (const auto& [name, t] : tensors) {
        nlohmann::json chunks = nlohmann::json::array();
        for (const Chunk& c : t.chunks)
          chunks.push_back(
              {{"file", c.file}, {"key", c.key}, {"offsets", c.offsets}, {"sizes", c.sizes}, {"crc32c", c.crc32c}});
        ts[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"chunks", chunks}};
      }
      states[ref] = {{"tensors", ts}};
    }
    for (const auto& [ref, file] : m.states)
      if (!states.contains(ref)) states[ref] = {{"tensors", nlohmann::json::object()}};
    j["states"] = states;
  }
  write_file_atomic(folder + "/manifest.json", j.dump(1) + "\n");
}

namespace {

bool is_crc(const nlohmann::json& v) {
  uint32_t c = 0;
  return v.is_string() && parse_crc32c_hex(v.get<std::string>(), c);
}

// A list of non-negative integers (a shape, offsets, sizes), or an error naming `where`.
std::vector<int64_t> int_list(const nlohmann::json& v, const std::string& path, const std::string& where) {
  std::vector<int64_t> out;
  if (!v.is_array()) throw std::runtime_error(path + ": field '" + where + "': expected a list of integers, got " + v.dump());
  for (const auto& x : v) {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > (int64_t{1} << 48))
      throw std::runtime_error(path + ": field '" + where + "': expected integers >= 0, got " + v.dump());
    out.push_back(x.get<int64_t>());
  }
  return out;
}

// Version 2's files, tensors and their chunks, each checked: a chunk lies inside its tensor in a
// listed file, and a tensor's chunks cover it exactly once (their volumes add up to its size and
// no two overlap), so a load never reads garbage for an element nobody saved.
using NameCheck = std::function<bool(const std::string&)>;
void read_version2(const nlohmann::json& j, const std::string& path, Manifest& m, const NameCheck& plain,
                   const NameCheck& is_ref) {
  auto bad = [&](const std::string& field, const std::string& expected, const nlohmann::json* got) {
    return std::runtime_error(path + ": field '" + field + "': expected " + expected +
                              (got ? ", got " + got->dump() : ", but it is missing"));
  };
  if (j.contains("mesh")) {
    if (!j["mesh"].is_object()) throw bad("mesh", "an object {dp, tp, pp}", &j["mesh"]);
    for (const auto& [k, v] : j["mesh"].items()) {
      if (!v.is_number_integer() || v.get<int64_t>() < 1) throw bad("mesh." + k, "an integer >= 1", &v);
      m.mesh[k] = v.get<int64_t>();
    }
  }
  if (!j.contains("files") || !j["files"].is_object())
    throw bad("files", "an object {file name: {bytes, crc32c, rank, host}}", j.contains("files") ? &j["files"] : nullptr);
  for (const auto& [name, f] : j["files"].items()) {
    const std::string where = "files." + name;
    if (!plain(name)) throw std::runtime_error(path + ": field 'files': '" + name + "' is not a file name in the checkpoint folder");
    if (!f.is_object()) throw bad(where, "an object {bytes, crc32c, rank, host}", &f);
    FileEntry e;
    if (!f.contains("bytes") || !f["bytes"].is_number_integer() || f["bytes"].get<int64_t>() < 0)
      throw bad(where + ".bytes", "the file's size (an integer >= 0)", f.contains("bytes") ? &f["bytes"] : nullptr);
    e.bytes = f["bytes"].get<int64_t>();
    if (!f.contains("crc32c") || !is_crc(f["crc32c"]))
      throw bad(where + ".crc32c", "8 hex digits", f.contains("crc32c") ? &f["crc32c"] : nullptr);
    e.crc32c = f["crc32c"].get<std::string>();
    if (f.contains("rank")) {
      if (!f["rank"].is_number_integer() || f["rank"].get<int64_t>() < 0 || f["rank"].get<int64_t>() > (1 << 20))
        throw bad(where + ".rank", "the rank that wrote it", &f["rank"]);
      e.rank = f["rank"].get<int>();
    }
    if (f.contains("host")) {
      if (!f["host"].is_string()) throw bad(where + ".host", "a string", &f["host"]);
      e.host = f["host"].get<std::string>();
    }
    m.files[name] = e;
  }
  if (!m.rng_file.empty() && !m.files.count(m.rng_file)) throw bad("rng", "a file that 'files' lists", &j["rng"]);
  if (!j.contains("states") || !j["states"].is_object())
    throw bad("states", "an object {state ref: {tensors}}", j.contains("states") ? &j["states"] : nullptr);
  for (const auto& [ref, st] : j["states"].items()) {
    if (!is_ref(ref)) throw std::runtime_error(path + ": field 'states': '" + ref + "' is not a state ref NODE.PORT");
    if (!st.is_object() || !st.contains("tensors") || !st["tensors"].is_object())
      throw bad("states." + ref, "an object {\"tensors\": {name: {dtype, shape, chunks}}}", &st);
    m.states[ref] = "";
    auto& tensors = m.tensors[ref];
    for (const auto& [name, t] : st["tensors"].items()) {
      const std::string where = "states." + ref + ".tensors." + name;
      if (!t.is_object()) throw bad(where, "an object {dtype, shape, chunks}", &t);
      TensorEntry e;
      if (!t.contains("dtype") || !t["dtype"].is_string()) throw bad(where + ".dtype", "a dtype name (\"F32\", ...)", t.contains("dtype") ? &t["dtype"] : nullptr);
      e.dtype = t["dtype"].get<std::string>();
      if (!t.contains("shape")) throw bad(where + ".shape", "a list of integers", nullptr);
      e.shape = int_list(t["shape"], path, where + ".shape");
      int64_t numel = 1;
      for (int64_t d : e.shape)
        if (__builtin_mul_overflow(numel, d, &numel) || numel > (int64_t{1} << 56))
          throw std::runtime_error(path + ": field '" + where + ".shape': more elements than a tensor can have");
      if (!t.contains("chunks") || !t["chunks"].is_array()) throw bad(where + ".chunks", "a list of chunks", t.contains("chunks") ? &t["chunks"] : nullptr);
      int64_t covered = 0;
      for (const auto& c : t["chunks"]) {
        const std::string cw = where + ".chunks[" + std::to_string(e.chunks.size()) + "]";
        if (!c.is_object()) throw bad(cw, "an object {file, key, offsets, sizes, crc32c}", &c);
        Chunk k;
        if (!c.contains("file") || !c["file"].is_string() || !m.files.count(c["file"].get<std::string>()))
          throw bad(cw + ".file", "a file that 'files' lists", c.contains("file") ? &c["file"] : nullptr);
        k.file = c["file"].get<std::string>();
        if (!c.contains("key") || !c["key"].is_string()) throw bad(cw + ".key", "a string", c.contains("key") ? &c["key"] : nullptr);
        k.key = c["key"].get<std::string>();
        if (!c.contains("offsets") || !c.contains("sizes")) throw bad(cw + ".offsets", "offsets and sizes", nullptr);
        k.offsets = int_list(c["offsets"], path, cw + ".offsets");
        k.sizes = int_list(c["sizes"], path, cw + ".sizes");
        if (k.offsets.size() != e.shape.size() || k.sizes.size() != e.shape.size())
          throw std::runtime_error(path + ": field '" + cw + "': offsets and sizes need " + std::to_string(e.shape.size()) +
                                   " entries each (the tensor's dimensions)");
        for (size_t d = 0; d < e.shape.size(); ++d)
          if (k.offsets[d] + k.sizes[d] > e.shape[d])
            throw std::runtime_error(path + ": field '" + cw + "': the chunk reaches past the tensor's shape along dimension " +
                                     std::to_string(d));
        if (!c.contains("crc32c") || !is_crc(c["crc32c"])) throw bad(cw + ".crc32c", "8 hex digits", c.contains("crc32c") ? &c["crc32c"] : nullptr);
        k.crc32c = c["crc32c"].get<std::string>();
        covered += k.numel();  // (each at most numel: inside the shape)
        if (covered > numel)
          throw std::runtime_error(path + ": field '" + where + ".chunks': the chunks hold more than the tensor's " +
                                   std::to_string(numel) + " elements");
        e.chunks.push_back(std::move(k));
      }
      // Exactly once: no two chunks share an element, and together they hold every one. (The pairs
      // are compared for up to 4096 chunks a tensor, 8 M pairs: a few per rank of a run of a
      // thousand ranks; past that only the volumes, a reader still counting what it copies.)
      for (size_t a = 0; e.chunks.size() <= 4096 && a < e.chunks.size(); ++a)
        for (size_t b = a + 1; b < e.chunks.size(); ++b) {
          bool overlap = e.chunks[a].numel() > 0 && e.chunks[b].numel() > 0;
          for (size_t d = 0; d < e.shape.size() && overlap; ++d)
            overlap = e.chunks[a].offsets[d] < e.chunks[b].offsets[d] + e.chunks[b].sizes[d] &&
                      e.chunks[b].offsets[d] < e.chunks[a].offsets[d] + e.chunks[a].sizes[d];
          if (overlap)
            throw std::runtime_error(path + ": field '" + where + ".chunks': chunks " + std::to_string(a) + " and " +
                                     std::to_string(b) + " overlap");
        }
      if (covered != numel)
        throw std::runtime_error(path + ": field '" + where + ".chunks': the chunks hold " + std::to_string(covered) +
                                 " of the tensor's " + std::to_string(numel) + " elements");
      tensors[name] = std::move(e);
    }
  }
}

}  // namespace

// Field by field, each error naming the file and the field: a manifest is read before any
// state is, and a bad one must not become a negative step or a path outside the folder. A key
// given twice in one object is refused too (JSON parsers keep one of them silently).
Manifest read_manifest(const std::string& folder) {
  const std::string path = folder + "/manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw std::runtime_error("checkpoint " + folder + " has no manifest.json (incomplete or not a checkpoint)");
  // JSON as read_json_file reads it: a key given twice is refused too (nlohmann keeps one of
  // them: a manifest with "step" twice would pass the field checks with whichever came last).
  nlohmann::json j;
  try {
    j = read_json_file(path);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string(e.what()) +
                             "; flowrun writes a manifest whole, so this one was damaged or edited: resume from another "
                             "checkpoint");
  }
  auto bad = [&](const std::string& field, const std::string& expected) {
    return std::runtime_error(path + ": field '" + field + "': expected " + expected +
                              (j.is_object() && j.contains(field) ? ", got " + j[field].dump() : ", but it is missing"));
  };
  if (!j.is_object()) throw std::runtime_error(path + ": expected a JSON object, got " + std::string(j.type_name()));
  if (!j.contains("format") || j["format"] != "flowrun-checkpoint") throw bad("format", "\"flowrun-checkpoint\"");
  if (!j.contains("version") || !j["version"].is_number_integer()) throw bad("version", "1 or 2");
  if (j["version"] != 1 && j["version"] != 2)
    throw std::runtime_error(path + ": manifest version " + j["version"].dump() +
                             ", this flowrun reads versions 1 and 2 (a newer flowrun wrote it?)");
  Manifest m;
  m.version = j["version"].get<int>();
  if (!j.contains("step") || !j["step"].is_number_integer() || j["step"].get<int64_t>() < 1)
    throw bad("step", "the step number (an integer >= 1)");
  m.step = j["step"].get<int64_t>();
  auto text = [&](const char* field, std::string& out) {
    if (!j.contains(field)) return;
    if (!j[field].is_string()) throw bad(field, "a string");
    out = j[field].get<std::string>();
  };
  text("graph", m.graph);
  text("name", m.name);
  text("config", m.config);
  text("rng", m.rng_file);
  if (j.contains("world")) {
    if (!j["world"].is_number_integer() || j["world"].get<int64_t>() < 1 || j["world"].get<int64_t>() > (1 << 20))
      throw bad("world", "the number of processes that wrote it (an integer >= 1)");
    m.world = j["world"].get<int>();
  }
  // A file of the checkpoint is a plain name inside its folder.
  auto plain = [](const std::string& f) { return !f.empty() && f.find('/') == std::string::npos && f != "." && f != ".."; };
  if (!m.rng_file.empty() && !plain(m.rng_file)) throw bad("rng", "a file name in the checkpoint folder");
  auto is_ref = [](const std::string& ref) {
    return ref.find('.') != std::string::npos && ref.front() != '.' && ref.back() != '.';
  };
  if (m.version == 1) {
    if (!j.contains("states") || !j["states"].is_object()) throw bad("states", "an object {state ref: file name}");
    for (const auto& [ref, file] : j["states"].items()) {
      if (!file.is_string() || !plain(file.get<std::string>()))
        throw std::runtime_error(path + ": field 'states." + ref + "': expected a file name in the checkpoint folder, got " +
                                 file.dump());
      if (!is_ref(ref)) throw std::runtime_error(path + ": field 'states': '" + ref + "' is not a state ref NODE.PORT");
      m.states[ref] = file.get<std::string>();
    }
    return m;
  }
  read_version2(j, path, m, plain, is_ref);
  return m;
}

std::string check_files(const std::string& folder, const Manifest& m) {
  std::string problems;
  for (const auto& [name, f] : m.files) {
    std::error_code ec;
    const std::string file = folder + "/" + name;
    const auto size = fs::file_size(file, ec);
    std::string p;
    if (ec)
      p = file + " is missing (" + ec.message() + ")";
    else if (static_cast<int64_t>(size) != f.bytes)
      p = file + " is " + std::to_string(size) + " bytes, the manifest says " + std::to_string(f.bytes) +
          (static_cast<int64_t>(size) < f.bytes ? " (truncated)" : " (grown)");
    if (!p.empty()) problems += (problems.empty() ? "" : "; ") + p;
  }
  return problems;
}

std::string verify_file(const std::string& folder, const std::string& name, const FileEntry& entry) {
  const std::string file = folder + "/" + name;
  std::ifstream in(file, std::ios::binary);
  if (!in) return file + " cannot be read (" + std::strerror(errno) + ")";
  std::vector<char> block(size_t{8} << 20);
  uint32_t crc = 0;
  int64_t bytes = 0;
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto n = static_cast<size_t>(in.gcount());
    crc = crc32c(block.data(), n, crc);
    bytes += static_cast<int64_t>(n);
  }
  if (in.bad()) return file + ": a read failed (" + std::strerror(errno) + ")";
  if (bytes != entry.bytes)
    return file + " is " + std::to_string(bytes) + " bytes, the manifest says " + std::to_string(entry.bytes);
  if (crc32c_hex(crc) != entry.crc32c)
    return file + ": its CRC32C is " + crc32c_hex(crc) + ", the manifest says " + entry.crc32c +
           " (its bytes changed after it was written)";
  return "";
}

std::string latest(const std::string& dir) { return read_latest(dir); }

std::vector<Found> checkpoints(const std::string& dir) {
  std::vector<Found> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step_", 0) != 0 || !e.is_directory(ec)) continue;
    Found f;
    f.folder = e.path().string();
    try {
      const Manifest m = read_manifest(f.folder);
      f.step = m.step;
      f.problem = check_files(f.folder, m);
    } catch (const std::exception& x) {
      f.problem = x.what();
    }
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const Found& a, const Found& b) {
    if (a.problem.empty() != b.problem.empty()) return a.problem.empty();  // complete ones first
    return a.step != b.step ? a.step > b.step : a.folder > b.folder;
  });
  return out;
}

void set_latest(const std::string& dir, const std::string& folder_name) {
  write_file_atomic(dir + "/latest", folder_name + "\n");
}

}  // namespace flowrun::ckpt
