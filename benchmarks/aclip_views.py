"""A-CLIP with one view against two (T = 150, 3 seeds), both without colour augmentation and with the EMA horizon of
the comparison's row; CLIP and A-CLIP's runs are the comparison's own (`make compare` first, from the repository
root). Writes runs/compare_aclip_views/summary.md; the measured copy is benchmarks/results/compare_aclip_views_cpu/."""
from powerclip.compare import RUNS, RunSpec, make_plan, run_plan

if __name__ == "__main__":      # the runs train in spawned processes, which import this file again
    rows = {"CLIP": RUNS["CLIP"], "A-CLIP": RUNS["A-CLIP"],
            "A-CLIP (2 views)": RunSpec("aclip", {"method_cfg.color_aug": False, "method_cfg.views": 2,
                                                  "method_cfg.momentum_steps": 90_000})}
    plan = make_plan(rows, [0, 1, 2], 150, "runs/compare", overrides={"progress": False}, grounding_scenes=200,
                     report_dir="runs/compare_aclip_views")
    plan.meta["command"] = "python benchmarks/aclip_views.py"
    run_plan(plan)
