"""Why the plateau's and the fine-tune's CLIP differ (issue 44): one CLIP seed of the plateau's plan (T = 1,600).

At a given thread count, at the code of whichever checkout `powerclip` is imported from:

    .venv/bin/python benchmarks/table_parting.py --seed 0 --threads 1 [--steps 400] [--out /tmp/parting]
    # at another commit: git worktree add /tmp/be50879 be50879 && cd /tmp/be50879 && \
    #     PYTHONPATH=. /path/to/repo/.venv/bin/python /path/to/repo/benchmarks/table_parting.py --seed 0 --threads 2
    # as on a machine without AVX-512 (torch's, MKL's and oneDNN's kernels limited to AVX2):
    #     ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python ...

Scores the untrained model of the seed (the tables' chance line) on the plan's 300 test scenes, and with `--steps N`
trains the seed's CLIP for its first N steps (the whole schedule's learning rates, `stop_at`) and scores its snapshot
at N; prints one JSON line: the commit, the thread count, the CPU's vector instructions torch dispatches to, the
numbers, the logged losses (issue 44's runs: benchmarks/results/table_parting_cpu.json). The committed tables' own
numbers are in benchmarks/results/{plateau,finetune}_cpu/T1600/summary.json (per_seed) and the plateau's per-seed
curve at step 400 in its curves_per_seed.csv. `71a_plateau` ("Why the two CLIP tables differ") reads the results.
At a commit older than `benchmarks/_checks.py`'s `check_number` (be50879), run a copy without its two `_checks` lines.
"""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors


def _main(argv):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of training and scoring")
    ap.add_argument("--steps", type=int, default=0, help="train the first N steps too (0: the untrained model only)")
    ap.add_argument("--out", default="/tmp/table_parting", help="scratch folder (runs and test scenes)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 0, "seed", "steps")
        _checks.at_least(a, 1, "threads")
    torch.set_num_threads(a.threads)
    import powerclip
    from powerclip.data import derive_seed
    from powerclip.eval.data import write_world_benchmark
    from powerclip.eval.models import load_model
    from powerclip.eval.world_scores import evaluate_folder
    from powerclip.experiments import _plateau_plan
    from powerclip.train import read_metrics, train
    code = Path(powerclip.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = Path(a.out) / f"{head[:7]}_seed{a.seed}_t{a.threads}"
    plan = _plateau_plan(["CLIP"], [a.seed], 1600, out / "plan", log=lambda m: None)
    write_world_benchmark(plan.test_root, plan.eval_images, plan.world, split="test", extras=False)
    job = plan.job("CLIP", a.seed)
    keys = ("hn_mean", "i2t_R@1", "t2i_R@1", "region_acc", "region_ap50", "region_crop_ap50")
    lm = load_model(job.cfg.model.name, None, seed=derive_seed(a.seed, "init"), model_kwargs=job.cfg.model.kwargs)
    r = evaluate_folder(out / "untrained", plan.test_root, plan.world, 0, lm=lm)
    res = dict(commit=head, code=str(code), seed=a.seed, threads=torch.get_num_threads(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(),
               untrained={k: r[k] for k in keys if k in r})
    if a.steps:
        cfg = dataclasses.replace(job.cfg, stop_at=a.steps, progress=False, tensorboard=False,
                                  snapshot_steps=(a.steps,))
        train(cfg)
        s = evaluate_folder(job.dir / "snapshots" / f"step{a.steps}", plan.test_root, plan.world, 0, "cpu")
        res.update(steps=a.steps, trained={k: s[k] for k in keys if k in s},
                   losses={r["step"]: r["loss"] for r in read_metrics(job.dir / "metrics.csv")})
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(_main, None, "table_parting.py"))
