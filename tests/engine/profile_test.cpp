// The profile (engine/profile.hpp) of spans laid out by hand, every figure worked out below;
// spans recorded by the executor and read back from the trace file it writes. The end-to-end
// checks (a slowed reader on the critical path of `flowrun dot --trace`, the profile's totals
// against the trace's spans, a serial node as the bottleneck) are cli.profile_and_dot_trace.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "profile.hpp"
#include "spec.hpp"
#include "support/run_graph.hpp"

namespace flowrun {
namespace {

GraphSpec graph(std::initializer_list<const char*> names) {
  GraphSpec g;
  for (const char* n : names) {
    NodeSpec s;
    s.name = n;
    s.type = std::string("t_") + n;
    g.nodes.push_back(s);
  }
  return g;
}

TraceSpan span(const char* node, int64_t step, double t0, double t1, int tid, TraceDeps deps) {
  TraceSpan s;
  s.node = node;
  s.type = std::string("t_") + node;
  s.step = step;
  s.t0 = t0;
  s.t1 = t1;
  s.tid = tid;
  s.deps = std::move(deps);
  return s;
}

// Two steps of data -> fb -> opt, µs:
//   thread 1  data1 [0,10]            data2 [10,20]
//   thread 2            fb1 [10,14] opt1 [14,15]      fb2 [20,24] opt2 [24,25]
// data2 is read ahead while fb1 and opt1 run; fb2 is free at 14 (fb1 done) but waits for data2
// (ends 20); opt2 is free at 15 and waits for fb2 (ends 24).
std::vector<TraceSpan> two_steps() {
  return {span("data", 1, 0, 10, 1, {}),
          span("fb", 1, 10, 14, 2, {{"data", 1}}),
          span("opt", 1, 14, 15, 2, {{"fb", 1}}),
          span("data", 2, 10, 20, 1, {{"data", 1}}),
          span("fb", 2, 20, 24, 2, {{"data", 2}, {"fb", 1}, {"opt", 1}}),
          span("opt", 2, 24, 25, 2, {{"fb", 2}, {"opt", 1}})};
}

TEST(Profile, FiguresOfHandLaidSpans) {
  const Profile p = make_profile(graph({"data", "fb", "opt", "never"}), two_steps());  // "never": no runs
  EXPECT_DOUBLE_EQ(p.wall_us, 25);
  EXPECT_EQ(p.steps, 2);
  EXPECT_EQ(p.threads, 2);
  EXPECT_DOUBLE_EQ(p.idle_fraction, 1 - 30.0 / (2 * 25));  // node time 20 + 8 + 2 of 2 x 25
  ASSERT_EQ(p.nodes.size(), 3u);                          // "never" did not run
  const NodeProfile& data = *p.node("data");
  EXPECT_EQ(data.type, "t_data");
  EXPECT_EQ(data.runs, 2);
  EXPECT_DOUBLE_EQ(data.mean_us, 10);
  EXPECT_DOUBLE_EQ(data.p95_us, 10);
  EXPECT_DOUBLE_EQ(data.total_us, 20);
  EXPECT_DOUBLE_EQ(data.share, 20.0 / 25);
  EXPECT_DOUBLE_EQ(data.overlapped_us, 5);  // data2 beside fb1 (4) and opt1 (1)
  EXPECT_DOUBLE_EQ(p.node("fb")->overlapped_us, 4);
  EXPECT_DOUBLE_EQ(p.node("opt")->overlapped_us, 1);
  EXPECT_DOUBLE_EQ(p.node("fb")->max_us, 4);
  // Waits: fb2 free at 14, data2 ends at 20; opt2 free at 15, fb2 ends at 24.
  EXPECT_DOUBLE_EQ(p.node("fb")->waited_us, 6);
  EXPECT_DOUBLE_EQ(p.node("opt")->waited_us, 9);
  EXPECT_DOUBLE_EQ(p.node("data")->waited_us, 0);
  EXPECT_DOUBLE_EQ(p.mean_wait_us("data", "fb"), 3);  // 6 over fb's 2 runs
  EXPECT_DOUBLE_EQ(p.mean_wait_us("fb", "opt"), 4.5);
  EXPECT_DOUBLE_EQ(p.mean_wait_us("opt", "fb"), 0);   // opt1 ended before data2
  // Both steps: opt <- fb <- data (data2's own dependency is of step 1: the path starts there).
  EXPECT_EQ(p.critical_path, (std::vector<std::string>{"data", "fb", "opt"}));
  EXPECT_EQ(p.critical_path_steps, 2);
  EXPECT_DOUBLE_EQ(p.critical_path_us, 15);  // 0..15 and 10..25
}

// The same steps with the reader fast and the optimizer slow: the path of a typical step
// changes with where the time goes.
TEST(Profile, TheCriticalPathFollowsTheDependencyThatEndedLast) {
  std::vector<TraceSpan> s = {span("data", 1, 0, 1, 1, {}),
                              span("fb", 1, 1, 3, 2, {{"data", 1}}),
                              span("opt", 1, 3, 13, 2, {{"fb", 1}}),
                              span("data", 2, 1, 2, 1, {{"data", 1}}),
                              span("fb", 2, 13, 15, 2, {{"data", 2}, {"fb", 1}, {"opt", 1}}),
                              span("opt", 2, 15, 25, 2, {{"fb", 2}, {"opt", 1}})};
  const Profile p = make_profile(graph({"data", "fb", "opt"}), s);
  // Step 1: data -> fb -> opt. Step 2: fb2 waited for opt1 (step 1): its path is fb -> opt.
  EXPECT_EQ(p.critical_path.size(), 3u);  // a tie (1 step each): the longer path
  EXPECT_EQ(p.critical_path_steps, 1);
  EXPECT_DOUBLE_EQ(p.node("fb")->waited_us, 13 - 3);  // free at 3, opt1 ends at 13
  EXPECT_DOUBLE_EQ(p.mean_wait_us("opt", "fb"), 5);    // charged to the previous step's opt
  ASSERT_EQ(p.waits.size(), 2u);
  for (const auto& w : p.waits)
    if (w.from == "opt") EXPECT_FALSE(w.same_step);
}

// A node due every 9 steps is free from the start of its step, not from its previous run.
TEST(Profile, APeriodicNodeWaitsFromTheStartOfItsStep) {
  std::vector<TraceSpan> s = {span("data", 1, 0, 1, 1, {}), span("every", 1, 1, 2, 1, {{"data", 1}}),
                              span("data", 10, 100, 110, 1, {{"data", 9}}),
                              span("every", 10, 110, 111, 1, {{"data", 10}, {"every", 1}})};
  const Profile p = make_profile(graph({"data", "every"}), s);
  EXPECT_DOUBLE_EQ(p.node("every")->waited_us, 10);  // 110 - max(2, 100)
}

TEST(Profile, ATraceOfAnotherGraphIsRefusedNamingBothNodeSets) {
  try {
    make_profile(graph({"a", "b"}), two_steps());
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("data : t_data, fb : t_fb, opt : t_opt"), std::string::npos) << m;
    EXPECT_NE(m.find("a : t_a, b : t_b"), std::string::npos) << m;
  }
  // The same names with other types (another graph whose nodes are named alike) likewise.
  GraphSpec g = graph({"data", "fb", "opt"});
  g.nodes[0].type = "token_shards";
  EXPECT_THROW(make_profile(g, two_steps()), std::runtime_error);
}

// Spans the tracer records (with deps) come back from the trace file it writes; the JSON of a
// profile carries the table's figures.
TEST(Profile, TraceFileRoundTripAndJson) {
  Tracer t;
  t.enable(true);
  for (const auto& s : two_steps()) t.node_span(s.node, s.type, s.t0, s.t1, s.step, "io", s.deps);
  t.span("fb: bucket 1", "mark", 11, 12, 1);  // a mark: not a node span
  const std::string path = test::temp_dir("profile") + "/trace.json";
  t.write(path);
  const std::vector<TraceSpan> back = read_trace_file(path);
  ASSERT_EQ(back.size(), 6u);
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].node, two_steps()[i].node);
    EXPECT_EQ(back[i].step, two_steps()[i].step);
    EXPECT_EQ(back[i].deps, two_steps()[i].deps);
    EXPECT_EQ(back[i].stream, "io");
    EXPECT_NEAR(back[i].t1 - back[i].t0, two_steps()[i].t1 - two_steps()[i].t0, 1e-3);
  }
  const Profile p = make_profile(graph({"data", "fb", "opt"}), back);
  const auto j = nlohmann::json::parse(profile_json(p));
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["nodes"][0]["name"], "data");
  EXPECT_NEAR(j["nodes"][0]["total_s"].get<double>(), 20e-6, 1e-9);
  EXPECT_EQ(j["critical_path"]["nodes"], (std::vector<std::string>{"data", "fb", "opt"}));
  const std::string table = profile_table(p);
  EXPECT_NE(table.find("critical path (2 of 2 steps, 0.015 ms): data -> fb -> opt"), std::string::npos) << table;
  // A tally without recording keeps no events; the busiest node since the last look.
  Tracer tally;
  tally.enable_tally(true);
  for (const auto& s : two_steps()) tally.node_span(s.node, s.type, s.t0, s.t1, s.step, "", {});
  EXPECT_TRUE(tally.node_spans().empty());
  const Tracer::Busiest b = tally.take_busiest();
  EXPECT_EQ(b.node, "data");
  EXPECT_DOUBLE_EQ(b.us, 20);
  EXPECT_EQ(b.runs, 2);
  EXPECT_TRUE(tally.take_busiest().node.empty());  // reset
}

TEST(Profile, UnreadableTracesAreErrorsNamingTheFile) {
  const std::string dir = test::temp_dir("profile_bad");
  std::ofstream(dir + "/x.json") << "{\"traceEvents\": [{\"ph\": \"C\"}]}";
  std::ofstream(dir + "/y.json") << "not json";
  for (const std::string f : {dir + "/x.json", dir + "/y.json", dir + "/missing.json"}) {
    try {
      read_trace_file(f);
      FAIL() << f;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace flowrun
