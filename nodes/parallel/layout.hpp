// run.parallel as a layout of a job's processes, before anything runs: the mesh (mesh.hpp) and
// the pipeline schedule (pipeline_schedule.hpp) the settings make, or why they cannot. The run
// session checks a graph's layout with it before making a node; `flowrun explain` prints it.
// Pure arithmetic, no torch: it sits in the torch-free part of the room (flowrun_layout).
#pragma once
#include <string>

#include "parallel/pipeline_schedule.hpp"
#include "spec.hpp"

namespace flowrun::parallel {

// run.parallel's pipeline settings as a schedule that can be made; throws naming the setting
// when one is given without pipeline stages (a setting that is accepted must do what it says)
// or the schedule cannot be made.
pipeline::Config pipeline_config(const RunSettings::Parallel& p);

// run.parallel over `world` processes: the mesh, each rank's coordinates and groups, each
// pipeline stage's program; or "cannot run: WHY".
std::string describe_layout(const GraphSpec& g, int world);

}  // namespace flowrun::parallel
