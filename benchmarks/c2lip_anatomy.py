"""What costs C2LIP-from-CLIP its points (issue 43, item 3): C2LIP fine-tuned from CLIP's snapshot with one of its
parts changed at a time, T = 150 (F = 30), 3 seeds, each against the matched control (CLIP's loss with C2LIP's recipe:
lr 1e-5, wd 0.1, its warm-up) and against C2LIP as the comparison trains it.

    .venv/bin/python benchmarks/c2lip_anatomy.py [--seeds 0 1 2] [--steps 150] [--out runs/c2lip_anatomy]
    # seeds in two processes (two cores), then one table over both folders:
    .venv/bin/python benchmarks/c2lip_anatomy.py --seeds 2 --out runs/c2lip_anatomy_s2
    .venv/bin/python benchmarks/c2lip_anatomy.py --seeds 0 1 --merge runs/c2lip_anatomy_s2

The rows (`ROWS`): the control; C2LIP as `RUNS["C2LIP"]` (SigLIP's loss with t and b created fresh at 10 and -10,
npc and xac, `npc_norm=batch`, t and b at lr 1e-3); C2LIP-CLIP (CLIP's loss as the base); npc off; xac off; both off
(the sigmoid loss alone, with fresh t and b: what the base switch costs); `npc_norm=concepts` (the authors' code);
t and b at the run's lr (`modules_lr` None: 1e-5, so they stay near their initial values); C2LIP at CLIP ft's lr
(1e-4). Runs, `summary.md` (every row against the control) and `anatomy.md` (each pair below) go to `--out`; the
measured copy is benchmarks/results/sigmoid_cpu/c2lip_anatomy/. Resumable: a killed run restarts where it stopped,
finished runs are reused. One thread per run (`threads=1`), as the committed tables.
"""
import sys
from pathlib import Path

import _checks

from powerclip.compare import RUNS, RunSpec, make_plan, run_plan
from powerclip.report import load_comparison, merge_comparisons, write_outputs

C2LIP = RUNS["C2LIP"]
CONTROL = "CLIP ft (C2LIP recipe)"
ROWS = {
    "CLIP": RUNS["CLIP"],
    CONTROL: RunSpec("clip", dict(C2LIP.overrides), base="CLIP", warmup_share=C2LIP.warmup_share),   # its recipe
    "C2LIP": C2LIP,
    "C2LIP-CLIP": RUNS["C2LIP-CLIP"],
    **{name: RunSpec("c2lip", {**C2LIP.overrides, **extra}, base="CLIP", warmup_share=C2LIP.warmup_share)
       for name, extra in (
           ("C2LIP, npc off", {"method_cfg.npc_weight": 0.0}),
           ("C2LIP, xac off", {"method_cfg.xac_weight": 0.0}),
           ("C2LIP, npc and xac off", {"method_cfg.npc_weight": 0.0, "method_cfg.xac_weight": 0.0}),
           ("C2LIP, npc_norm concepts", {"method_cfg.npc_norm": "concepts"}),
           ("C2LIP, t and b at the run's lr", {"method_cfg.modules_lr": None}),
           ("C2LIP, lr 1e-4", {"optim.lr": 1e-4}))},
}
PAIRS = (("C2LIP", CONTROL), ("C2LIP-CLIP", CONTROL), ("C2LIP, npc and xac off", CONTROL),
         *((n, "C2LIP") for n in ROWS if n.startswith("C2LIP, ")))


def anatomy_md(cmp) -> str:
    "`anatomy.md`: C2LIP and its base switch against the control, then each change against C2LIP as trained."
    from powerclip.experiments import pairs_table
    m = cmp.meta
    return (f"# What costs C2LIP-from-CLIP its points: T = {m['steps']} (F = {m['finetune_steps']}), seeds "
            f"{m['seeds']}\n\nEvery row fine-tunes CLIP's snapshot at T - F. The control: CLIP's loss with C2LIP's "
            "recipe (lr 1e-5, wd 0.1, its warm-up). 'C2LIP, ...' rows change one part of C2LIP as the comparison "
            "trains it and are read against it: a positive difference is what that part costs.\n\n"
            f"{pairs_table(cmp, PAIRS)}\n")


def _main(argv) -> int:
    from powerclip.commandline import ArgumentParser, usage_errors
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default="runs/c2lip_anatomy")
    ap.add_argument("--merge", nargs="*", default=[], metavar="DIR",
                    help="folders of this anatomy over other seeds, read into this one's tables")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 0, "seeds")
        _checks.at_least(a, 10, "steps")            # F = 20 % of T: at least 2 fine-tune steps
        _checks.out_dir("--out", a.out)
        for d in a.merge:
            _checks.existing("--merge", Path(d) / "summary.json", hint="a folder this script wrote")
        plan = make_plan(ROWS, a.seeds, a.steps, a.out, overrides={"progress": False, "threads": 1},
                         grounding_scenes=200, reference=CONTROL)
    plan.meta["command"] = "python benchmarks/c2lip_anatomy.py " + " ".join(
        ["--seeds", *map(str, a.seeds), "--steps", str(a.steps), "--out", a.out]
        + (["--merge", *a.merge] if a.merge else []))
    cmp = run_plan(plan)
    if a.merge:
        cmp = merge_comparisons([cmp, *map(load_comparison, a.merge)])
        cmp.meta["command"] = plan.meta["command"]
        write_outputs(cmp, Path(a.out))
    (Path(a.out) / "anatomy.md").write_text(anatomy_md(cmp))
    print((Path(a.out) / "anatomy.md").read_text())
    return 0


if __name__ == "__main__":      # the runs train in spawned processes, which import this file again
    from powerclip.commandline import run_main
    sys.exit(run_main(_main, None, "c2lip_anatomy.py"))
