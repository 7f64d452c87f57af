// Device streams: the executor's ordering of work queued on streams, checked with the CPU
// test double (tests/support/thread_streams.hpp: each stream a thread running queued
// "kernels" in order). Test nodes poison what they write while their kernel "computes"
// (sleeps), so a consumer that starts too early sees the poison. The same graphs with a
// device that ignores waits (NoWaitStreams) show that the checks can fail.
#include <gtest/gtest.h>

#include <map>

#include "support/run_graph.hpp"
#include "support/test_nodes.hpp"
#include "support/thread_streams.hpp"

using namespace flowrun;
using test::Recorder;
using test::ThreadStreams;

namespace {

// A device whose streams never wait for each other: what the executor would be without events.
class NoWaitStreams : public ThreadStreams {
 public:
  void wait(int, const DeviceEvent&) override {}
};

test::RunResult run_on(DeviceStreams& streams, const std::string& yaml, const std::vector<std::string>& ov = {}) {
  Recorder::get().clear();
  RunOptions o;
  o.streams = &streams;
  return test::run_graph_text(yaml, ov, o);
}

std::vector<test::Event> events_of(const std::string& node, const std::string& what) {
  std::vector<test::Event> out;
  for (const auto& e : Recorder::get().events())
    if (e.node == node && e.what == what) out.push_back(e);
  return out;
}

// A producer whose kernel takes 3 ms on stream `io`, a consumer on the default stream.
const char* kProducerConsumer = R"(flowrun: 1
run: { steps: 20, prefetch: 2 }
nodes:
  src: { type: t_dev_source, stream: io, with: { k: 7, sleep_us: 3000 } }
  chk: { type: t_dev_check, in: { in: src.out } }
)";

}  // namespace

TEST(DeviceStreams, AConsumerOnAnotherStreamNeverSeesAnUnfinishedProducersOutput) {
  ThreadStreams dev;
  run_on(dev, kProducerConsumer);
  EXPECT_EQ(Recorder::get().violations(), 0);
  const auto seen = events_of("chk", "device");
  ASSERT_EQ(seen.size(), 20u);
  for (const auto& e : seen) EXPECT_EQ(e.value, e.step * 1000 + 7) << "step " << e.step;
  // One device-side wait per step (chk waits for src), no host sync (nobody read on the host).
  EXPECT_EQ(dev.waits(), 20);
  EXPECT_EQ(dev.host_syncs(), 0);
  EXPECT_EQ(dev.used_on_calls(), 20);  // src's buffer, made on io, used on the default stream
}

TEST(DeviceStreams, WithoutTheEventWaitsTheConsumerSeesPoison) {
  NoWaitStreams dev;
  run_on(dev, kProducerConsumer);
  EXPECT_GT(Recorder::get().violations(), 0) << "the check cannot tell ordered from unordered streams";
}

TEST(DeviceStreams, OnOneStreamQueueOrderIsEnoughAndNothingWaits) {
  ThreadStreams dev;
  run_on(dev, kProducerConsumer, {"chk.stream=io"});
  EXPECT_EQ(Recorder::get().violations(), 0);
  EXPECT_EQ(events_of("chk", "device").size(), 20u);
  EXPECT_EQ(dev.waits(), 0);
  EXPECT_EQ(dev.used_on_calls(), 0);
}

// One state, written and read on three streams. The sequential program, per step s:
// w1 makes version 2s-1, r1 and r2 read it, w2 makes version 2s. Each kernel sees exactly that,
// whatever the streams: a read waits for the last write's event, a write for every read since.
const char* kStateAcrossStreams = R"(flowrun: 1
run: { steps: 15, prefetch: 2 }
nodes:
  cell: { type: t_dev_cell }
  w1: { type: t_dev_write, stream: a, in: { s: cell.cell }, with: { sleep_us: 2000 } }
  r1: { type: t_dev_read, stream: b, in: { s: cell.cell }, with: { sleep_us: 1500 } }
  r2: { type: t_dev_read, stream: c, in: { s: cell.cell }, with: { sleep_us: 500 } }
  w2: { type: t_dev_write, stream: b, in: { s: cell.cell }, with: { sleep_us: 1000 } }
)";

TEST(DeviceStreams, StateAccessesKeepProgramOrderAcrossStreams) {
  ThreadStreams dev;
  run_on(dev, kStateAcrossStreams);
  EXPECT_EQ(Recorder::get().violations(), 0);
  for (const auto& [node, seen_at_step] : std::map<std::string, int64_t>{{"w1", -2}, {"r1", -1}, {"r2", -1}, {"w2", -1}}) {
    const auto ev = events_of(node, node[0] == 'w' ? "write" : "read");
    ASSERT_EQ(ev.size(), 15u) << node;
    for (const auto& e : ev) EXPECT_EQ(e.value, 2 * e.step + seen_at_step) << node << " at step " << e.step;
  }
  EXPECT_GT(dev.waits(), 0);
}

TEST(DeviceStreams, StateOrderFailsWithoutTheEventWaits) {
  NoWaitStreams dev;
  run_on(dev, kStateAcrossStreams);
  int wrong = Recorder::get().violations();
  for (const auto& e : events_of("r1", "read")) wrong += e.value != 2 * e.step - 1;
  EXPECT_GT(wrong, 0) << "the check cannot tell ordered from unordered streams";
}

TEST(DeviceStreams, AHostReaderSynchronizesOnlyOnTheStepsItReads) {
  ThreadStreams dev;
  run_on(dev, kProducerConsumer, {"chk.host_every=5"});
  EXPECT_EQ(Recorder::get().violations(), 0);
  const auto host = events_of("chk", "host");
  ASSERT_EQ(host.size(), 4u);  // steps 5, 10, 15, 20
  for (const auto& e : host) EXPECT_EQ(e.value, e.step * 1000 + 7);
  EXPECT_EQ(dev.host_syncs(), 4) << "a host sync on a step the reader does not read";
}

// Items emitted on `compute` while the producer still runs, consumed on `comm`.
const char* kStreamItems = R"(flowrun: 1
run: { steps: 10, prefetch: 1 }
nodes:
  gen: { type: t_dev_stream, stream: compute, with: { count: 5, sleep_us: 800 } }
  sink: { type: t_dev_sink, stream: comm, in: { items: gen.items } }
)";

TEST(DeviceStreams, StreamItemsAreOrderedByTheirOwnEvents) {
  ThreadStreams dev;
  run_on(dev, kStreamItems);
  EXPECT_EQ(Recorder::get().violations(), 0);
  EXPECT_EQ(events_of("sink", "item").size(), 50u);
}

TEST(DeviceStreams, StreamItemsSeePoisonWithoutTheirEvents) {
  NoWaitStreams dev;
  run_on(dev, kStreamItems);
  EXPECT_GT(Recorder::get().violations(), 0);
}

TEST(DeviceStreams, WithoutDeviceStreamsNodesRunSynchronouslyAndSyncIsANoOp) {
  Recorder::get().clear();
  test::run_graph_text(kProducerConsumer, {"chk.host_every=5"});
  EXPECT_EQ(Recorder::get().violations(), 0);
  EXPECT_EQ(events_of("chk", "device").size(), 20u);
  EXPECT_EQ(events_of("chk", "host").size(), 4u);
}
