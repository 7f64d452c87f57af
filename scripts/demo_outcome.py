#!/usr/bin/env python3
"""The LoRA demo's outcome, checked against its bars (scripts/setup.sh runs it after the demo;
tests/nodes/demo_outcome_test.cpp and bench/demo_matrix.sh run it on other runs folders).

What the samples show is shapes_fidelity's figures, logged by evlog in each graph's
metrics.jsonl: per prompt the share of checks its sample passes and whether the shape has the
prompted color. Read from RUNS (default runs/): the base's last evaluation (dit_base), and the
LoRA run's first (the base, before any update) and last (after LoRA). The bars:
  - the base draws its own colors: the color check passes for at least 80 % of its prompts;
  - the LoRA taught purple: at least 50 % of the purple prompts' samples purple after it, and
    30 points more than the base drew (it draws none);
  - the LoRA kept what the base knew: the control prompts (the base's colors) pass the color
    check at least 75 % of the time after it, and no less than the base did minus 25 points.

  python3 scripts/demo_outcome.py [RUNS] [--json]
Exit: 0 every bar passes, 3 one does not (each named), 2 no figures (a run did not score samples).
"""
import json
import os
import sys

BASE_COLOR_BAR = 80.0
PURPLE_BAR, PURPLE_RISE_BAR = 50.0, 30.0
CONTROL_BAR, CONTROL_DROP_BAR = 75.0, 25.0


def evals(path):
    try:
        with open(path) as f:
            return [j for j in map(json.loads, f) if "fidelity" in j]
    except OSError:
        return []


def by_prompt(j, field):
    return {k[len(field) + 1:]: v for k, v in j.items() if k.startswith(field + "/")}


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def outcome(runs):
    """The figures and the failed bars (a list of sentences), or None without figures."""
    base = evals(os.path.join(runs, "dit_base", "metrics.jsonl"))
    lora = evals(os.path.join(runs, "hydit_lora", "metrics.jsonl"))
    if not lora:
        return None
    fig = {"base_step": base[-1]["step"] if base else None, "base_color": base[-1].get("color") if base else None}
    failed = []
    if base and not fig["base_color"] >= BASE_COLOR_BAR:
        failed.append("the base draws the prompted color for %.1f %% of its prompts (bar: %d %%): look at %s" % (
            fig["base_color"], BASE_COLOR_BAR, os.path.join(runs, "dit_base", "samples", "step_%07d.png" % fig["base_step"])))
    for what, j in (("before", lora[0]), ("after", lora[-1])):
        color = by_prompt(j, "per_prompt_color")
        purple = [k for k in color if " purple " in k]
        control = [k for k in color if k not in purple]
        fig[what] = {"step": j["step"], "purple": mean(color[k] for k in purple),
                     "control": mean(color[k] for k in control), "per_prompt_color": color}
    grid = os.path.join(runs, "hydit_lora", "samples", "step_%07d.png" % fig["after"]["step"])
    rise = fig["after"]["purple"] - fig["before"]["purple"]
    if not (fig["after"]["purple"] >= PURPLE_BAR and rise >= PURPLE_RISE_BAR):
        failed.append("the LoRA did not teach purple: %.1f %% of the purple prompts' samples are purple after it (bar: "
                      "%d %%), %.1f points more than the base's (bar: %d): look at the purple rows of %s" % (
                          fig["after"]["purple"], PURPLE_BAR, rise, PURPLE_RISE_BAR, grid))
    drop = fig["before"]["control"] - fig["after"]["control"]
    if not (fig["after"]["control"] >= CONTROL_BAR and drop <= CONTROL_DROP_BAR):
        lost = [k for k, v in fig["after"]["per_prompt_color"].items()
                if " purple " not in k and v < fig["before"]["per_prompt_color"].get(k, 0)]
        failed.append("the LoRA overwrote the base's colors: the control prompts pass the color check %.1f %% of the time "
                      "after it (bar: %d %%; the base: %.1f %%), lost on %s: look at the control rows (the last) of %s" % (
                          fig["after"]["control"], CONTROL_BAR, fig["before"]["control"],
                          "; ".join('"%s"' % k for k in lost) or "none", grid))
    fig["rise"] = rise
    return fig, failed


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = args[0] if args else "runs"
    result = outcome(runs)
    if result is None:
        print("== no fidelity figures in %s/hydit_lora/metrics.jsonl (see %s/*/metrics.jsonl)" % (runs, runs))
        return 2
    fig, failed = result
    if "--json" in sys.argv:
        print(json.dumps({"figures": fig, "failed": failed}))
        return 3 if failed else 0
    print("== what the samples show (shapes_fidelity: % of prompts whose sample has the prompted color):")
    if fig["base_step"] is not None:
        print("   the base (dit_base, step %d): %.1f %% on prompts in its seven colors" % (fig["base_step"], fig["base_color"]))
    for what in ("before", "after"):
        f = fig[what]
        print("   %s LoRA (step %d): purple prompts %.1f %%, control prompts (the base's colors) %.1f %%" % (
            what, f["step"], f["purple"], f["control"]))
    if failed:
        print("== the set-up itself succeeded (flowrun built, the data made, the three graphs trained), but the demo's "
              "outcome is below its bars:")
        for f in failed:
            print("   - " + f)
        print("   (rows of a grid: the sampler's prompts in graphs/hydit_lora.yaml's order, six purple then four "
              "controls; step_0000001.png is the base before LoRA; VAE reconstructions: %s/vae/recon/)" % runs)
        return 3
    print("== outcome: the LoRA taught purple (+%.1f points), the control prompts kept the base's colors" % fig["rise"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
