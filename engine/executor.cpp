// The executor. How it works, in short (docs/executor.md has the long form):
//
// A source (input_node) emits step numbers; a limiter_node lets at most run.prefetch + 1
// steps in flight; a serial "admit" function_node then walks the step's nodes in file order
// and derives, like the sequential program would, what each node instance (node, step)
// waits for: the producers of its values, its own previous step (serial nodes), and for each
// state access the last earlier write (reads) or every access since it (writes). Periodic
// nodes that are not due contribute nothing. This is the dependency analysis of sequential
// task-flow runtimes (StarPU, OmpSs), done once per step in O(accesses).
//
// Each instance counts its unmet dependencies; the one whose count reaches zero is put into
// its node's function_node, which runs Node::run and then releases its waiters. Steps retire
// in order: when all instances of the lowest step are done, its values are freed and the
// limiter lets one more step in. Stream inputs are delivered item by item to a per-node serial
// function_node while the producer still runs; the consumer's run() follows the last item.
//
// With device streams (RunOptions::streams, device_streams.hpp) the same dependencies also
// order the device: run() only enqueues work on the node's stream, and "done" means "queued".
// So each instance records an event on its stream when run() returns (and each stream item
// when it is emitted), and before an instance runs, its stream waits on the device for the
// events of the dependencies that ran on other streams (same stream: queue order suffices).
// Values made on another stream are marked as used on the consumer's stream, so the caching
// allocator keeps them until that stream is done with them.
//
// With a compute thread (RunOptions::compute_thread) the nodes whose type does tensor math
// (schema `compute: true`: forward/backward, optimizer, EMA, evaluator, encoders) do not run on
// the TBB workers but on the thread that called run(): the function_node hands the instance to
// that thread and returns, holding the graph's wait open until it is done. Tensor math then
// comes from one thread, so the math library's thread pool (OpenMP keeps one per calling
// thread) is one pool, and the workers keep to the nodes that wait (I/O, communication,
// checkpoints). The graph itself then runs on a driver thread.
//
// With several processes, a node that made a communication channel in setup() (allreduce,
// metrics, evaluators: comm::Channel) waits in run() until the other ranks make the same call.
// On a shared thread that wait could hold the thread another node needs first, on this rank,
// for the other rank's matching call to ever come (one worker: rank 0's metrics waits for rank
// 1's, whose only worker waits in a gradient all-reduce that needs rank 0's next backward, which
// waits for a worker). So each such node runs on a lane of its own: a thread that serves only
// it. Each channel's calls come in the node's step order on every rank, and every rank runs the
// same dependency graph, so no wait can close a cycle: any graph that validates runs without
// deadlock. The compute thread is the same kind of lane, served by the thread in run().
// The channels are edges between ranks the graph file does not show, so each is declared: a
// node's setup() may open channels only over the groups its schema's `collectives:` names
// (world, dp, tp, pp; explain and dot print them), else the run is refused naming the group.
#include "executor.hpp"

#include <spdlog/spdlog.h>
#include <tbb/flow_graph.h>
#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/task_arena.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

#include "comm.hpp"
#include "registry.hpp"
#include "runtime.hpp"
#include "step_order.hpp"
#include "trace.hpp"

namespace flowrun {

NodeError::NodeError(std::string n, std::string t, int64_t s, const std::string& what)
    : std::runtime_error(what), node(std::move(n)), type(std::move(t)), step(s) {}

namespace {

struct DepRef {
  int node = -1;
  int64_t step = -1;
  std::shared_ptr<Recorded> rec;  // device streams only: its event, kept past its retirement
};

struct Item {
  std::string port;
  Value v;
  int index = 0, count = 0;
  std::shared_ptr<DeviceEvent> event;  // device streams: recorded by the producer at emit
  int stream = -1;                     // the producer's stream
};

struct Instance {
  std::mutex mu;
  int node = -1;
  int64_t step = -1;
  bool active = false, done = false;
  std::vector<std::pair<Instance*, bool>> waiters;  // (waiter, waits for my stream to end)
  std::atomic<int> pending{0};                      // unmet dependencies (+1 while being admitted)
  // Stream consumers only (guarded by mu):
  int stream_pending = 0;  // stream producers not yet done
  bool open = false, in_item = false, fired = false;
  std::deque<Item> items;
  // Device streams only: this instance's event, and those its stream waits for first.
  std::shared_ptr<Recorded> rec;
  std::vector<std::shared_ptr<Recorded>> device_waits;
  TraceDeps trace_deps;  // with a tracer: what admission made it wait for (node name, step)
};

struct StepSlot {
  std::atomic<int> remaining{0};
  bool done = false;  // guarded by the retire mutex
  Frame frame;
};

}  // namespace

struct Executor::Impl : ExecutorCore {
  const GraphSpec& g;
  RunInfo info;
  std::vector<std::unique_ptr<NodeRuntime>> rts;
  std::vector<Value> states;
  std::vector<std::string> state_names;
  std::vector<std::vector<std::pair<int, Access>>> accesses;  // per node, in port order
  int nslots = 0;

  // ---- per run ----
  int R = 0;  // ring size (steps that can be alive at once + 1)
  std::vector<std::unique_ptr<Instance[]>> ring;
  std::unique_ptr<StepSlot[]> steps;
  std::atomic<int64_t> lo{0};  // lowest step not yet retired
  int64_t last_admitted = 0;
  std::mutex retire_mu;
  std::unique_ptr<StepOrder<DepRef>> order;  // touched by admission only (serial)
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  std::unique_ptr<NodeError> error;
  Tracer* tracer = nullptr;
  DeviceStreams* streams = nullptr;  // RunOptions::streams (null: no device, nodes synchronous)
  const RunOptions* opt = nullptr;
  std::vector<std::unique_ptr<tbb::flow::function_node<Instance*>>> fn;
  std::vector<std::unique_ptr<tbb::flow::function_node<Instance*>>> item_fn;
  tbb::flow::limiter_node<int64_t>* limiter = nullptr;
  tbb::flow::graph* graph = nullptr;

  // ---- lanes: the compute thread (RunOptions::compute_thread), served by the thread in run(),
  // and with several processes a thread per communicating node (see the top) ----
  struct Lane {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool closed = false;
  };
  Lane compute;
  bool use_compute = false;
  std::vector<std::unique_ptr<Lane>> own_lane;  // per node: its own lane, or null

  Impl(const GraphSpec& gs, const Registry& reg, RunInfo ri) : g(gs), info(std::move(ri)) {
    info.graph = &g;
    build(reg);
  }

  Instance& inst(int node, int64_t step) { return ring[node][step % R]; }
  StepSlot& slot(int64_t step) { return steps[step % R]; }

  void build(const Registry& reg) {
    std::vector<const NodeType*> types;
    std::vector<const NodeSchema*> schemas;
    for (const NodeSpec& ns : g.nodes) {
      types.push_back(reg.find(ns.type));
      if (!types.back()) throw std::logic_error("node type '" + ns.type + "' vanished from the registry");
      schemas.push_back(&types.back()->schema);
    }
    // The states, numbered (step_order.hpp); each is made by its owner's setup().
    StateTable table = number_states(g, schemas);
    states.resize(table.names.size());
    state_names = std::move(table.names);
    accesses = std::move(table.accesses);
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      const NodeSpec& ns = g.nodes[i];
      const NodeType* t = types[i];
      auto rt = std::make_unique<NodeRuntime>();
      rt->index = static_cast<int>(i);
      rt->spec = &ns;
      rt->schema = &t->schema;
      rt->params = Params(ns.params, ns.name);
      rt->info = &info;
      rt->who = "node '" + ns.name + "' (" + ns.type + ")";
      rt->stateless = t->schema.stateless;
      rt->compute = t->schema.compute;
      rt->states = &states;
      rt->core = this;
      for (const auto& in : ns.inputs) {
        InputBinding b;
        b.port = in.port;
        b.kind = in.schema->kind;
        b.access = in.schema->access;
        for (const auto& ref : in.refs) {
          NodeRuntime& p = *rts[ref.node_index];
          b.producers.push_back(ref.node_index);
          b.refs.push_back(ref.str());
          if (b.kind == PortKind::Value) {
            // A name read from a "*" output (the checker matched it) gets its slot now.
            auto slot = p.out_slot.find(ref.port);
            if (slot == p.out_slot.end()) slot = p.out_slot.emplace(ref.port, nslots++).first;
            b.slots.push_back(slot->second);
          } else if (b.kind == PortKind::State) {
            b.slots.push_back(p.owned_state.at(ref.port));
          } else {
            p.stream_consumers[ref.port].push_back({rt->index, in.port});
            rt->has_stream_inputs = true;
          }
        }
        rt->inputs.push_back(std::move(b));
      }
      for (const auto& o : t->schema.outputs) {
        if (o.kind == PortKind::Value) {
          if (o.name != "*") rt->out_slot[o.name] = nslots++;  // "*": per name read, above
        } else if (o.kind == PortKind::State) {
          rt->owned_state[o.name] = table.owned[i].at(o.name);
          rt->owned_access[o.name] = o.access;
        } else {
          rt->stream_consumers[o.name];
        }
      }
      try {
        rt->node = t->factory();
      } catch (const std::exception& e) {
        throw NodeError(ns.name, ns.type, 0, rt->who + ": its factory (" + t->schema.origin + ") failed: " + e.what());
      }
      if (!rt->node)
        throw NodeError(ns.name, ns.type, 0,
                        rt->who + ": its factory (" + t->schema.origin + ") returned no node; the plugin is broken");
      rts.push_back(std::move(rt));
    }
    // setup() in file order: a node's state inputs were created by earlier nodes' setup().
    for (auto& rt : rts) {
      SetupContext ctx(rt.get());
      const uint64_t channels = comm::Channel::created();
      try {
        rt->node->setup(ctx);
      } catch (const std::exception& e) {
        throw NodeError(rt->spec->name, rt->spec->type, 0, rt->who + " failed in setup: " + e.what());
      }
      rt->communicates = comm::Channel::created() != channels;
      check_declared_collectives(*rt, comm::Channel::groups_created_since(channels));
      for (const auto& [port, sid] : rt->owned_state)
        if (states[sid].empty())
          throw NodeError(rt->spec->name, rt->spec->type, 0,
                          rt->who + ": setup() did not create its state output '" + port + "' (call ctx.own_state)");
    }
  }

  // A channel over a group the schema does not declare is an undeclared edge between ranks.
  static void check_declared_collectives(const NodeRuntime& rt, const std::vector<std::string>& opened) {
    for (const std::string& group : opened) {
      bool declared = false;
      for (const auto& c : rt.schema->collectives) declared = declared || c.group == group;
      if (!declared)
        throw NodeError(rt.spec->name, rt.spec->type, 0,
                        rt.who + " opened a channel over the " + group + " group in setup, but its schema (" +
                            (rt.schema->origin == "built-in" ? "schemas/" + rt.spec->type + ".yaml" : rt.schema->origin) +
                            ") declares no collectives over " + group +
                            ": add `collectives: { group: " + group + ", doc: what it exchanges there }` to it");
    }
  }

  // ---- failure ----
  void fail(NodeRuntime& rt, int64_t step, const std::string& what) {
    std::unique_lock<std::mutex> l(err_mu);
    if (error) return;  // the first failure is the one reported
    error = std::make_unique<NodeError>(rt.spec->name, rt.spec->type, step,
                                        rt.who + " failed at step " + std::to_string(step) + ": " + what);
    failed.store(true);
    const NodeError first = *error;
    l.unlock();
    // Now, not after draining: in a multi-process run the other ranks wait for this one.
    if (opt && opt->on_error) opt->on_error(first);
  }

  template <class F>
  void guarded(NodeRuntime& rt, int64_t step, F&& f) {
    if (failed.load(std::memory_order_relaxed)) return;  // stopping: drain without work
    try {
      f();
    } catch (const std::exception& e) {
      fail(rt, step, e.what());
    } catch (...) {
      fail(rt, step, "unknown exception");
    }
  }

  // ---- running instances ----
  // Instances whose inputs are ready but that no worker runs yet (a trace counter: when it
  // stays above zero, more workers would help).
  std::atomic<int> ready{0};

  void fire(Instance* i) {
    if (tracer) tracer->counter("nodes ready", ready.fetch_add(1) + 1);
    fn[i->node]->try_put(i);
  }

  // ---- lanes ----
  // A node runs on its own lane if it has one, else on the compute thread if its type computes
  // and there is one, else on the TBB worker that took it. The graph's wait stays reserved
  // until a lane's job is done, so wait_for_all() cannot return while a lane still holds work
  // that will fire more instances.
  Lane* lane_of(int node) {
    if (own_lane[node]) return own_lane[node].get();
    return use_compute && rts[node]->compute ? &compute : nullptr;
  }

  template <class F>
  void dispatch(int node, F f) {
    Lane* lane = lane_of(node);
    if (!lane) {
      worker_thread_init();
      return f();
    }
    graph->reserve_wait();
    {
      std::lock_guard<std::mutex> l(lane->mu);
      lane->jobs.push_back([this, f] {
        struct Release {
          tbb::flow::graph* g;
          ~Release() { g->release_wait(); }
        } release{graph};
        f();
      });
    }
    lane->cv.notify_one();
  }

  // A lane's loop: its jobs in arrival order until closed.
  static void serve(Lane& lane) {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> l(lane.mu);
        lane.cv.wait(l, [&] { return !lane.jobs.empty() || lane.closed; });
        if (lane.jobs.empty()) return;
        job = std::move(lane.jobs.front());
        lane.jobs.pop_front();
      }
      job();
    }
  }

  static void open(Lane& lane) {
    std::lock_guard<std::mutex> l(lane.mu);
    lane.jobs.clear();
    lane.closed = false;
  }

  static void close(Lane& lane) {
    {
      std::lock_guard<std::mutex> l(lane.mu);
      lane.closed = true;
    }
    lane.cv.notify_all();
  }

  // RunOptions::on_worker_thread, once per worker thread and run (TBB keeps its threads
  // between runs; each run has its own number).
  uint64_t run_id = 0;
  void worker_thread_init() {
    thread_local uint64_t done_for = 0;
    if (!use_compute || !opt->on_worker_thread || done_for == run_id) return;
    done_for = run_id;
    opt->on_worker_thread();
  }

  void execute(Instance* i) {
    NodeRuntime& rt = *rts[i->node];
    if (tracer) tracer->counter("nodes ready", ready.fetch_sub(1) - 1);
    double t0 = tracer ? tracer->now_us() : 0;
    guarded(rt, i->step, [&] {
      StepContext ctx(&rt, i->step, &slot(i->step).frame);
      if (!streams) return rt.node->run(ctx);
      enter_stream(i);
      try {
        rt.node->run(ctx);
      } catch (...) {
        streams->end(rt.stream);
        throw;
      }
      streams->end(rt.stream);
      i->rec->event = streams->record(rt.stream);  // before complete(): waiters see it set
    });
    if (tracer)
      tracer->node_span(rt.spec->name, rt.spec->type, t0, tracer->now_us(), i->step, rt.spec->stream,
                        std::move(i->trace_deps));
    complete(i);
  }

  void complete(Instance* i) {
    std::vector<std::pair<Instance*, bool>> ws;
    {
      std::lock_guard<std::mutex> l(i->mu);
      i->done = true;
      ws.swap(i->waiters);
    }
    for (auto [w, stream] : ws) {
      if (stream)
        stream_dep_done(w);
      else
        dep_done(w);
    }
    const int64_t step = i->step;  // i may be reused once the step retires
    if (slot(step).remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) step_done(step);
  }

  void dep_done(Instance* w) {
    if (w->pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (!rts[w->node]->has_stream_inputs) return fire(w);
    bool kick, go;
    {
      std::lock_guard<std::mutex> l(w->mu);
      w->open = true;
      kick = !w->items.empty();
      go = finish_ready(w);
    }
    if (kick) item_fn[w->node]->try_put(w);
    if (go) fire(w);
  }

  void stream_dep_done(Instance* w) {
    bool go;
    {
      std::lock_guard<std::mutex> l(w->mu);
      --w->stream_pending;
      go = finish_ready(w);
    }
    if (go) fire(w);
  }

  // Under w->mu: all items in and handled, other inputs ready, not yet fired.
  static bool finish_ready(Instance* w) {
    if (w->open && w->stream_pending == 0 && w->items.empty() && !w->in_item && !w->fired) {
      w->fired = true;
      return true;
    }
    return false;
  }

  Value* owned_state(int node, const std::string& port) override {
    const auto& owned = rts[static_cast<size_t>(node)]->owned_state;
    auto it = owned.find(port);
    return it == owned.end() ? nullptr : &states[static_cast<size_t>(it->second)];
  }

  void deliver_item(int producer, int64_t step, const std::string& port, Value v, int index, int count) override {
    const auto& consumers = rts[producer]->stream_consumers.at(port);
    const int pstream = rts[producer]->stream;
    std::shared_ptr<DeviceEvent> ev;
    if (streams && !consumers.empty()) ev = streams->record(pstream);  // the item's work so far
    for (const auto& [c, cport] : consumers) {
      Instance& w = inst(c, step);
      bool kick;
      {
        std::lock_guard<std::mutex> l(w.mu);
        w.items.push_back(Item{cport, v, index, count, ev, pstream});
        kick = w.open;
      }
      if (kick) item_fn[c]->try_put(&w);
    }
  }

  void run_items(Instance* w) {
    NodeRuntime& rt = *rts[w->node];
    for (;;) {
      Item it;
      {
        std::lock_guard<std::mutex> l(w->mu);
        if (w->items.empty() || !w->open) {
          bool go = finish_ready(w);
          if (go) break;  // fire outside the lock
          return;
        }
        it = std::move(w->items.front());
        w->items.pop_front();
        w->in_item = true;
      }
      double t0 = tracer ? tracer->now_us() : 0;
      guarded(rt, w->step, [&] {
        StepContext ctx(&rt, w->step, &slot(w->step).frame);
        if (!streams) return rt.node->on_item(ctx, it.port, it.v, it.index, it.count);
        enter_stream(w);
        if (it.event && it.stream != rt.stream) {
          streams->wait(rt.stream, *it.event);
          streams->used_on(it.v, rt.stream);
        }
        try {
          rt.node->on_item(ctx, it.port, it.v, it.index, it.count);
        } catch (...) {
          streams->end(rt.stream);
          throw;
        }
        streams->end(rt.stream);
      });
      if (tracer)
        tracer->span(rt.spec->name + " item " + std::to_string(it.index), rt.spec->type, t0, tracer->now_us(), w->step,
                     rt.spec->stream);
      std::lock_guard<std::mutex> l(w->mu);
      w->in_item = false;
    }
    fire(w);
  }

  // ---- device streams ----
  // Make the instance's stream current and, the first time (run_items may come before run()),
  // queue its waits for the other streams it depends on; mark its value inputs from other
  // streams as used on its stream.
  void enter_stream(Instance* i) {
    NodeRuntime& rt = *rts[i->node];
    streams->begin(rt.stream, rt.spec->name + " step " + std::to_string(i->step));
    if (i->device_waits.empty()) return;
    for (const auto& r : i->device_waits)
      if (r->event) streams->wait(rt.stream, *r->event);
    const Frame& f = slot(i->step).frame;
    for (const auto& b : rt.inputs)
      if (b.kind == PortKind::Value)
        for (size_t k = 0; k < b.slots.size(); ++k)
          if (rts[b.producers[k]]->stream != rt.stream) streams->used_on(f.values[b.slots[k]], rt.stream);
    i->device_waits.clear();
  }

  // ---- admission: derive what each instance of step s waits for ----
  void admit(int64_t s) {
    last_admitted = s;
    const int n = static_cast<int>(rts.size());
    int active = 0;
    // Pass 1: reset every instance of step s before any of them can fire or receive items.
    for (int i = 0; i < n; ++i) {
      Instance& x = inst(i, s);
      x.node = i;
      x.step = s;
      x.active = g.nodes[i].schedule.active(s, info.first_step, info.last_step);
      x.done = !x.active;
      x.waiters.clear();
      x.pending.store(1);  // guard: released after registration
      x.stream_pending = 0;
      x.open = x.in_item = x.fired = false;
      x.items.clear();
      if (streams) {
        x.rec = x.active ? std::make_shared<Recorded>() : nullptr;
        if (x.rec) x.rec->stream = rts[i]->stream;
        x.device_waits.clear();
        slot(s).frame.recorded[i] = x.rec;
      }
      active += x.active;
    }
    StepSlot& ss = slot(s);
    ss.remaining.store(active + 1);  // +1: guard released at the end of admission
    if (tracer) tracer->counter("steps in flight", static_cast<double>(s - lo.load() + 1));

    std::vector<std::pair<DepRef, bool>> deps;
    for (int i = 0; i < n; ++i) {
      Instance& x = inst(i, s);
      if (!x.active) continue;
      NodeRuntime& rt = *rts[i];
      deps.clear();
      auto add = [&](DepRef d, bool stream) {
        if (d.node < 0 || (d.node == i && d.step == s)) return;
        for (auto& [e, st] : deps)
          if (e.node == d.node && e.step == d.step && st == stream) return;
        deps.push_back({d, stream});
      };
      for (const auto& b : rt.inputs)
        if (b.kind != PortKind::State)
          for (int p : b.producers) add({p, s, inst(p, s).rec}, b.kind == PortKind::Stream);
      // Its previous step (same stream) and its state accesses (step_order.hpp).
      order->admit(i, s, rt.stateless, accesses[i], DepRef{i, s, x.rec},
                   [&](const DepRef& d, Why, int) { add(d, false); });
      if (tracer && tracer->records()) {
        x.trace_deps.clear();
        for (const auto& [d, stream] : deps) x.trace_deps.emplace_back(rts[d.node]->spec->name, d.step);
      }
      // Device order: wait for the events of dependencies on other streams (a stream input's
      // items carry their own events; its end is host order only).
      if (streams)
        for (const auto& [d, stream] : deps)
          if (!stream && d.rec && d.rec->stream != rt.stream) x.device_waits.push_back(d.rec);
      const int64_t low = lo.load(std::memory_order_acquire);
      for (auto& [d, stream] : deps) {
        if (d.step < low) continue;  // retired: done
        Instance& p = inst(d.node, d.step);
        if (stream) {
          std::lock_guard<std::mutex> l2(x.mu);
          ++x.stream_pending;
        } else {
          x.pending.fetch_add(1, std::memory_order_relaxed);
        }
        bool done;
        {
          std::lock_guard<std::mutex> l(p.mu);
          done = p.done;
          if (!done) p.waiters.push_back({&x, stream});
        }
        if (done) {
          if (stream) {
            std::lock_guard<std::mutex> l2(x.mu);
            --x.stream_pending;
          } else {
            x.pending.fetch_sub(1, std::memory_order_relaxed);
          }
        }
      }
      dep_done(&x);  // release the guard
    }
    if (ss.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) step_done(s);
  }

  // ---- retiring steps in order ----
  void step_done(int64_t s) {
    int released = 0;
    {
      std::lock_guard<std::mutex> l(retire_mu);
      slot(s).done = true;
      int64_t low = lo.load();
      while (low <= last_admitted && slot(low).done) {
        StepSlot& ss = slot(low);
        ss.done = false;
        for (auto& v : ss.frame.values) v = Value();
        for (auto& r : ss.frame.recorded) r.reset();
        lo.store(low + 1, std::memory_order_release);
        if (opt->on_step_done && !failed.load()) opt->on_step_done(low);
        ++low;
        ++released;
      }
    }
    for (int k = 0; k < released; ++k) limiter->decrementer().try_put(tbb::flow::continue_msg());
  }

  // ---- at stop ----
  // A run stopped early (RunOptions::stop: Ctrl-C, SIGTERM) runs its `at: stop` nodes (a final
  // checkpoint) once more after its last finished step s, in file order, on this thread. Every
  // admitted step has retired, so they see the states as they were after step s: what they
  // would have seen had they been due in step s. The checker allows them state inputs only
  // (the values of step s are freed). A node that did run in step s does not run again.
  void run_at_stop(int64_t s) {
    Frame frame;
    frame.values.resize(nslots);
    frame.recorded.assign(streams ? rts.size() : 0, nullptr);
    for (auto& rt : rts) {
      const Schedule& when = rt->spec->schedule;
      if (!when.at_stop || when.active(s, info.first_step, info.last_step)) continue;
      const double t0 = tracer ? tracer->now_us() : 0;
      guarded(*rt, s, [&] {
        StepContext ctx(rt.get(), s, &frame);
        if (!streams) return rt->node->run(ctx);
        streams->begin(rt->stream, rt->spec->name + " at stop");
        try {
          rt->node->run(ctx);
        } catch (...) {
          streams->end(rt->stream);
          throw;
        }
        streams->end(rt->stream);
        streams->synchronize_all();
      });
      if (tracer) tracer->node_span(rt->spec->name, rt->spec->type, t0, tracer->now_us(), s, rt->spec->stream, {});
    }
  }

  RunStats run(const RunOptions& o) {
    opt = &o;
    tracer = (o.tracer && o.tracer->enabled()) ? o.tracer : nullptr;
    streams = o.streams;
    for (auto& rt : rts) {
      rt->tracer = tracer;
      rt->streams = streams;
      rt->stream = streams ? streams->stream(rt->spec->stream) : -1;
    }
    const int window = std::max(1, o.prefetch + 1);
    R = window + 1;
    const int n = static_cast<int>(rts.size());
    ring.clear();
    for (int i = 0; i < n; ++i) ring.emplace_back(new Instance[R]);
    steps.reset(new StepSlot[R]);
    for (int k = 0; k < R; ++k) {
      steps[k].frame.values.resize(nslots);
      steps[k].frame.recorded.assign(streams ? n : 0, nullptr);
    }
    order = std::make_unique<StepOrder<DepRef>>(states.size(), static_cast<size_t>(n));
    lo.store(info.first_step);
    last_admitted = info.first_step - 1;
    failed.store(false);
    error.reset();

    RunStats stats;
    stats.first_step = info.first_step;
    const auto t0 = std::chrono::steady_clock::now();
    const int workers = o.workers > 0 ? o.workers : tbb::info::default_concurrency();
    // More workers than cores is useful when nodes wait (I/O, sleeps, device syncs); TBB caps
    // its pool at the core count unless told otherwise.
    tbb::global_control allow(tbb::global_control::max_allowed_parallelism,
                              std::max<size_t>(workers, tbb::info::default_concurrency()));
    tbb::task_arena arena(workers);
    static std::atomic<uint64_t> runs{0};
    run_id = ++runs;
    use_compute = o.compute_thread;
    open(compute);
    // With several processes, a lane per communicating node (see the top): the threads start
    // here and end with the run. A lane of a compute type does its math with the compute
    // thread's settings; the others are set up like workers.
    own_lane.clear();
    own_lane.resize(static_cast<size_t>(n));
    std::vector<std::thread> lane_threads;
    if (info.world > 1)
      for (int i = 0; i < n; ++i)
        if (rts[i]->communicates) {
          own_lane[i] = std::make_unique<Lane>();
          Lane* lane = own_lane[i].get();
          const bool worker_like = use_compute && !rts[i]->compute && opt->on_worker_thread;
          lane_threads.emplace_back([this, lane, worker_like] {
            if (worker_like) opt->on_worker_thread();
            serve(*lane);
          });
        }
    auto close_lanes = [&] {
      for (auto& lane : own_lane)
        if (lane) close(*lane);
      for (auto& t : lane_threads) t.join();
    };
    auto drive = [&] {
      arena.execute([&] {
        tbb::flow::graph g;
        graph = &g;
        int64_t next = info.first_step;
        tbb::flow::input_node<int64_t> source(g, [&](tbb::flow_control& fc) -> int64_t {
          if (next > info.last_step || failed.load() || (o.stop && o.stop->load() > 0) ||
              (o.stop_before && o.stop_before(next))) {
            fc.stop();
            return 0;
          }
          return next++;
        });
        tbb::flow::limiter_node<int64_t> lim(g, static_cast<size_t>(window));
        limiter = &lim;
        tbb::flow::function_node<int64_t> admitter(g, tbb::flow::serial, [&](int64_t s) { admit(s); });
        tbb::flow::make_edge(source, lim);
        tbb::flow::make_edge(lim, admitter);
        fn.clear();
        item_fn.clear();
        for (int i = 0; i < n; ++i) {
          size_t conc = rts[i]->stateless ? tbb::flow::unlimited : tbb::flow::serial;
          fn.emplace_back(new tbb::flow::function_node<Instance*>(
              g, conc, [this](Instance* x) { dispatch(x->node, [this, x] { execute(x); }); }));
          item_fn.emplace_back(nullptr);
          if (rts[i]->has_stream_inputs)
            item_fn.back().reset(new tbb::flow::function_node<Instance*>(
                g, tbb::flow::serial, [this](Instance* x) { dispatch(x->node, [this, x] { run_items(x); }); }));
        }
        source.activate();
        g.wait_for_all();
        fn.clear();
        item_fn.clear();
        limiter = nullptr;
        graph = nullptr;
      });
    };
    if (!use_compute) {
      try {
        drive();
      } catch (...) {
        close_lanes();
        throw;
      }
      close_lanes();
    } else {
      // The graph runs on a driver thread; this thread serves the compute jobs until it ends.
      std::exception_ptr drive_error;
      std::thread driver([&] {
        try {
          drive();
        } catch (...) {
          drive_error = std::current_exception();
        }
        close(compute);
      });
      serve(compute);
      driver.join();
      close_lanes();
      if (drive_error) std::rethrow_exception(drive_error);
    }
    stats.last_step_done = lo.load() - 1;
    stats.stopped = !failed.load() && stats.last_step_done < info.last_step;
    // The host saw every step "done" when its work was queued; finish() and the caller see
    // results, so wait for the device (also after a failure: queued work still runs).
    if (streams) {
      try {
        streams->synchronize_all();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> l(err_mu);
        if (!error)
          error = std::make_unique<NodeError>("", "", stats.last_step_done,
                                              std::string("the device failed after step ") +
                                                  std::to_string(stats.last_step_done) + ": " + e.what());
        failed.store(true);
      }
    }
    if (stats.stopped && !failed.load() && stats.last_step_done >= info.first_step) run_at_stop(stats.last_step_done);
    // finish() in file order, also after a failure: background writers must be joined.
    for (auto& rt : rts) {
      SetupContext ctx(rt.get());
      try {
        rt->node->finish(ctx);
      } catch (const std::exception& e) {
        fail(*rt, stats.last_step_done, std::string("in finish: ") + e.what());
      }
    }
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (error) throw *error;
    return stats;
  }
};

RunInfo run_info(const GraphSpec& g) {
  RunInfo info;
  info.graph = &g;
  info.out_dir = g.settings.out_dir;
  info.first_step = 1;
  info.last_step = g.settings.steps;
  info.seed = g.settings.seed;
  info.log_every = g.settings.log_every;
  info.rank = comm::rank();
  info.world = comm::size();
  info.device = g.settings.device;
  return info;
}

RunOptions run_options(const GraphSpec& g) {
  RunOptions o;
  o.prefetch = g.settings.prefetch;
  o.workers = g.settings.workers;
  o.compute_thread = g.settings.compute_thread;
  return o;
}

Executor::Executor(const GraphSpec& g, const Registry& reg, RunInfo info)
    : impl_(std::make_unique<Impl>(g, reg, std::move(info))) {}
Executor::~Executor() = default;
RunStats Executor::run(const RunOptions& opt) { return impl_->run(opt); }
const RunInfo& Executor::info() const { return impl_->info; }

Node& Executor::node(const std::string& name) {
  for (auto& rt : impl_->rts)
    if (rt->spec->name == name) return *rt->node;
  throw std::out_of_range("no node '" + name + "'");
}

Value& Executor::state(const std::string& node, const std::string& port) {
  for (auto& rt : impl_->rts)
    if (rt->spec->name == node) {
      auto it = rt->owned_state.find(port);
      if (it == rt->owned_state.end()) throw std::out_of_range("node '" + node + "' owns no state '" + port + "'");
      return impl_->states[it->second];
    }
  throw std::out_of_range("no node '" + node + "'");
}

}  // namespace flowrun
