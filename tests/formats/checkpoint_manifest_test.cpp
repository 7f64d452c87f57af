// Checkpoint manifests (nodes/formats/checkpoint_io.hpp): written and read back, and read field by
// field, every bad field an error naming the file and the field, before any state is read.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <stdexcept>

#include "nodes/data_test_helpers.hpp"
#include "formats/checkpoint_io.hpp"
#include "support/run_graph.hpp"

namespace flowrun::ckpt {
namespace {

TEST(CheckpointManifest, RoundTrip) {
  const std::string dir = test::temp_dir("manifest");
  Manifest m;
  m.version = 1;
  m.step = 42;
  m.graph = "graphs/gpt.yaml";
  m.name = "gpt";
  m.config = "run: {steps: 50}\n";
  m.states = {{"model.params", "model.params.safetensors"}, {"opt.state", "opt.state.safetensors"}};
  m.rng_file = "rng.safetensors";
  write_manifest(dir, m);
  const Manifest r = read_manifest(dir);
  EXPECT_EQ(r.step, 42);
  EXPECT_EQ(r.graph, m.graph);
  EXPECT_EQ(r.config, m.config);
  EXPECT_EQ(r.states, m.states);
  EXPECT_EQ(r.rng_file, m.rng_file);
}

// Field by field; a key given twice anywhere is refused, naming the key and where it is.
TEST(CheckpointManifest, EveryBadFieldIsAnErrorNamingFileAndField) {
  const std::string dir = test::temp_dir("manifest");
  const std::string ok = R"("format": "flowrun-checkpoint", "version": 1)";
  struct Case {
    std::string json, expect;
  } cases[] = {
      {"{", "not valid JSON"},
      {"[1]", "expected a JSON object, got array"},
      {"[1, 8e88889]", "not valid JSON"},  // a number out of range (found by fuzz_manifest)
      {R"({"version": 1, "step": 3, "states": {}})", "field 'format'"},
      {R"({"format": "flowrun-checkpoint", "version": 3, "step": 3, "states": {}})", "manifest version 3"},
      {"{" + ok + R"(, "step": -5, "states": {}})", "field 'step': expected the step number (an integer >= 1), got -5"},
      {"{" + ok + R"(, "step": 18446744073709551615, "states": {}})", "field 'step'"},
      {"{" + ok + R"(, "step": "7", "states": {}})", "field 'step'"},
      {"{" + ok + R"(, "step": 7})", "field 'states': expected an object {state ref: file name}, but it is missing"},
      {"{" + ok + R"(, "step": 7, "states": {"m.p": "../../etc/passwd"}})", "field 'states.m.p'"},
      {"{" + ok + R"(, "step": 7, "states": {"m.p": 3}})", "field 'states.m.p'"},
      {"{" + ok + R"(, "step": 7, "states": {"mp": "f"}})", "'mp' is not a state ref NODE.PORT"},
      {"{" + ok + R"(, "step": 7, "states": {}, "rng": "/tmp/x"})", "field 'rng'"},
      {"{" + ok + R"(, "step": 7, "states": {}, "graph": 5})", "field 'graph': expected a string, got 5"},
      // Issue 31, item 11: a key given twice passed (the parser keeps the last one).
      {"{" + ok + R"(, "step": 7, "states": {}, "step": 9})", "key 'step' appears twice"},
      {"{" + ok + R"(, "step": 7, "states": {"m.p": "a.st", "m.p": "b.st"}})", "key 'm.p' in 'states' appears twice"},
      {"{" + ok + R"(, "step": 7, "states": {}, "x": [{"k": 1}, {"k": 1, "k": 2}]})", "key 'k' in 'x[]' appears twice"},
      // Issue 47: a million '[' built a path string per level (11.8 GB, no answer in 150 s).
      {std::string(1000000, '['), "nested deeper than 64 levels"},
      {"{" + ok + R"(, "step": 7, "states": {}, "x": {"y": [[{"z": 1, "z": 1}]]}})", "key 'z' in 'x.y[][]' appears twice"},
  };
  for (const Case& c : cases) {
    test::write_text(dir + "/manifest.json", c.json);
    try {
      read_manifest(dir);
      ADD_FAILURE() << c.json << ": no error";
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(dir + "/manifest.json"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.expect), std::string::npos) << c.json << "\n  gave: " << msg;
    }
  }
  std::filesystem::remove(dir + "/manifest.json");
  EXPECT_THROW(read_manifest(dir), std::runtime_error);  // no manifest: incomplete
}

// Version 2 (written by every rank, issue 72): files with sizes and checksums, tensors by their
// whole names with the boxes each file holds.
Manifest two_ranks() {
  Manifest m;
  m.step = 6;
  m.world = 2;
  m.mesh = {{"dp", 2}, {"tp", 1}, {"pp", 1}};
  m.files = {{"model.params.rank00000.safetensors", {100, "0000abcd", 0, "a"}},
             {"model.params.rank00001.safetensors", {90, "1234abcd", 1, "b"}}};
  m.states = {{"model.params", ""}};
  TensorEntry w{"F32", {4, 3}, {}};
  w.chunks = {{"model.params.rank00000.safetensors", "w[0:2,0:3]", {0, 0}, {2, 3}, "deadbeef"},
              {"model.params.rank00001.safetensors", "w[2:4,0:3]", {2, 0}, {2, 3}, "feedf00d"}};
  m.tensors["model.params"]["w"] = w;
  m.tensors["model.params"]["step"] = {"I64", {}, {{"model.params.rank00001.safetensors", "step", {}, {}, "00000001"}}};
  return m;
}

TEST(CheckpointManifest, VersionTwoRoundTripsEveryChunkAndFile) {
  const std::string dir = test::temp_dir("manifest2");
  const Manifest m = two_ranks();
  write_manifest(dir, m);
  const Manifest r = read_manifest(dir);
  EXPECT_EQ(r.version, 2);
  EXPECT_EQ(r.world, 2);
  EXPECT_EQ(r.mesh, m.mesh);
  ASSERT_EQ(r.files.size(), 2u);
  EXPECT_EQ(r.files.at("model.params.rank00001.safetensors").bytes, 90);
  EXPECT_EQ(r.files.at("model.params.rank00001.safetensors").host, "b");
  EXPECT_EQ(r.states.count("model.params"), 1u);
  const TensorEntry& w = r.tensors.at("model.params").at("w");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[1].offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(w.chunks[1].crc32c, "feedf00d");
  EXPECT_TRUE(r.tensors.at("model.params").at("step").shape.empty());
}

// A manifest whose chunks would leave an element unread, or read it twice, or from a file it does
// not list, is refused as it is read, naming the field.
TEST(CheckpointManifest, VersionTwoChunksMustCoverEachTensorExactlyOnce) {
  const std::string dir = test::temp_dir("manifest2bad");
  struct Case {
    std::function<void(Manifest&)> damage;
    std::string expect;
  } cases[] = {
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks.pop_back(); }, "the chunks hold 6 of the tensor's 12 elements"},
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks[1].offsets = {1, 0}; }, "chunks 0 and 1 overlap"},
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks[1].offsets = {3, 0}; }, "reaches past the tensor's shape"},
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks[0].sizes = {2}; }, "offsets and sizes need 2 entries"},
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks[0].file = "other.safetensors"; }, "a file that 'files' lists"},
      {[](Manifest& m) { m.tensors["model.params"]["w"].chunks[0].crc32c = "xyz"; }, "8 hex digits"},
      {[](Manifest& m) { m.files["model.params.rank00000.safetensors"].crc32c = "12"; }, "files.model.params.rank00000.safetensors.crc32c"},
      {[](Manifest& m) { m.files["../x"] = {1, "00000000", 0, ""}; }, "'../x' is not a file name in the checkpoint folder"},
  };
  for (const Case& c : cases) {
    Manifest m = two_ranks();
    c.damage(m);
    write_manifest(dir, m);
    try {
      read_manifest(dir);
      ADD_FAILURE() << c.expect << ": no error";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(c.expect), std::string::npos) << e.what();
    }
  }
}

// check_files reads no data: a file missing, shorter or longer than the manifest says is named.
TEST(CheckpointManifest, CheckFilesNamesAMissingOrTruncatedFile) {
  const std::string dir = test::temp_dir("manifest2files");
  const Manifest m = two_ranks();
  test::write_text(dir + "/model.params.rank00000.safetensors", std::string(100, 'x'));
  test::write_text(dir + "/model.params.rank00001.safetensors", std::string(90, 'x'));
  EXPECT_EQ(check_files(dir, m), "");
  test::write_text(dir + "/model.params.rank00001.safetensors", std::string(50, 'x'));
  EXPECT_NE(check_files(dir, m).find("model.params.rank00001.safetensors is 50 bytes, the manifest says 90 (truncated)"),
            std::string::npos);
  std::filesystem::remove(dir + "/model.params.rank00000.safetensors");
  EXPECT_NE(check_files(dir, m).find("model.params.rank00000.safetensors is missing"), std::string::npos);
}

// verify_file reads the whole file: the same size with one byte changed is caught by its CRC32C.
TEST(CheckpointManifest, VerifyFileCatchesAChangedByteOfTheSameSize) {
  const std::string dir = test::temp_dir("manifest2verify");
  test::write_text(dir + "/f", "123456789");
  const FileEntry ok{9, "e3069283", 0, ""};
  EXPECT_EQ(verify_file(dir, "f", ok), "");
  test::write_text(dir + "/f", "123456780");
  EXPECT_NE(verify_file(dir, "f", ok).find("its CRC32C is"), std::string::npos);
}

}  // namespace
}  // namespace flowrun::ckpt
