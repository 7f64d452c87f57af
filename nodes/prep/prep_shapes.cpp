// flowrun prep shapes: the command line of write_shapes (data/shapes.hpp).
#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "data/shapes.hpp"
#include "prep/cli_args.hpp"
#include "prep/prep.hpp"

namespace flowrun {

namespace {
const char* kShapesUsage =
    "usage: flowrun prep shapes OUT_DIR [--count 2000] [--size 32] [--seed 1] [--set base|lora|all]\n"
    "\n"
    "Draws the DiT demo's image-text set: one colored shape (circle, square, triangle, diamond;\n"
    "small or large) in a cell of a 3x3 grid on a plain background, with an exact caption:\n"
    "  OUT_DIR/NNNNNN.png, OUT_DIR/NNNNNN.txt  \"a small red circle at the top left on a blue background\"\n"
    "  OUT_DIR/vocab.txt                       BERT WordPiece vocab of every word either set uses\n"
    "\n"
    "  --count N      images (default 2000)\n"
    "  --size S       width = height in pixels (default 32)\n"
    "  --seed K       the same seed gives the same images (default 1)\n"
    "  --set base     colors red green blue yellow white black gray: never purple\n"
    "  --set lora     every shape purple: a concept the base set never shows\n"
    "  --set all      all eight colors (the VAE's set: it must draw what either DiT set shows)\n"
    "\n"
    "Pack it for training with: flowrun prep images OUT_DIR PREFIX\n";
}  // namespace

int prep_shapes_command(const std::vector<std::string>& args) {
  ShapesOptions opt;
  return run_cli_command("prep shapes", kShapesUsage, args, [&](const CliArgs& cl) {
    for (const auto& [a, v] : cl.options) {
      if (a == "--count") {
        opt.count = static_cast<int64_t>(cli_uint(a, v));
      } else if (a == "--size") {
        opt.size = static_cast<int>(std::min<uint64_t>(cli_uint(a, v), 1 << 20));
      } else if (a == "--seed") {
        opt.seed = cli_uint(a, v);
      } else if (a == "--set") {
        opt.set = v;
      } else {
        throw std::invalid_argument("unknown option " + a);
      }
    }
    const std::vector<std::string>& positional = cl.positional;
    if (positional.size() != 1) throw std::invalid_argument("expected one OUT_DIR, got " + std::to_string(positional.size()));
    opt.out_dir = positional[0];
    try {
      shape_spec(opt.seed, opt.set, 0);  // the one list of sets
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--set: ") + e.what());
    }
    const int64_t n = write_shapes(opt);
    std::printf("prep shapes: %lld %dx%d images (set %s, seed %llu) -> %s/NNNNNN.{png,txt}, %s/vocab.txt (%zu tokens)\n",
                static_cast<long long>(n), opt.size, opt.size, opt.set.c_str(), static_cast<unsigned long long>(opt.seed),
                opt.out_dir.c_str(), opt.out_dir.c_str(), shapes_vocab().size());
    return 0;
  });
}

}  // namespace flowrun
