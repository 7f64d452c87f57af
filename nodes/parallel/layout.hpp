// run.parallel as a layout of a job's processes, before anything runs: the mesh (mesh.hpp) and
// the pipeline schedule (pipeline_schedule.hpp) the settings make, or why they cannot. The run
// session checks a graph's layout with it before making a node; `flowrun explain` prints it.
// Pure arithmetic, no torch: it sits in the torch-free part of the room (flowrun_layout).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/pipeline_schedule.hpp"
#include "spec.hpp"

namespace flowrun::parallel {

// run.parallel's pipeline settings as a schedule that can be made; throws naming the setting
// when one is given without pipeline stages (a setting that is accepted must do what it says)
// or the schedule cannot be made.
pipeline::Config pipeline_config(const RunSettings::Parallel& p);

// The sizes run.parallel.tp must divide in a model node's settings: those its family declares
// (schema `family: tp_divides`: heads, MLP widths, a split vocabulary), as the graph sets them. tp_divides: whether t ranks can split them. One rule for `flowrun plan`'s
// layouts and forward_backward's memory advice, so neither names a tp the run then refuses.
std::vector<int64_t> tp_split_sizes(const NodeSpec& model);
bool tp_divides(const std::vector<int64_t>& sizes, int t);

// The graph's data sources, whose `batch` is per rank (a step's global batch is batch x dp): the
// nodes of a type that declares a `batch` output and a `batch` parameter (token_shards,
// image_text_shards, synthetic_regression, a plugin's reader alike). With `feeding` (a node's
// name), only those its inputs come from, along the declared edges. In file order.
std::vector<const NodeSpec*> batch_sources(const GraphSpec& g, const std::string& feeding = "");

// The parameter of a model node that counts its blocks when they are all alike (its schema's
// `family: alike_blocks`, gpt's and llama's layers), so that a profile of a few of them stands for
// the rest (`flowrun plan`); "" for a model of unlike blocks (dit: the later half's carry the long
// skips; cappa: an encoder's and a decoder's).
std::string alike_blocks_param(const NodeSpec& model);

// run.parallel over `world` processes: the mesh, each rank's coordinates and groups, each
// pipeline stage's program; or "cannot run: WHY".
std::string describe_layout(const GraphSpec& g, int world);

}  // namespace flowrun::parallel
