// Checkpoint manifests (nodes/formats/checkpoint_io.hpp): written and read back, and read field by
// field, every bad field an error naming the file and the field, before any state is read.
#include <gtest/gtest.h>

#include <filesystem>
#include <stdexcept>

#include "nodes/data_test_helpers.hpp"
#include "formats/checkpoint_io.hpp"
#include "support/run_graph.hpp"

namespace flowrun::ckpt {
namespace {

TEST(CheckpointManifest, RoundTrip) {
  const std::string dir = test::temp_dir("manifest");
  Manifest m;
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
      {R"({"format": "flowrun-checkpoint", "version": 2, "step": 3, "states": {}})", "manifest version 2"},
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

}  // namespace
}  // namespace flowrun::ckpt
