"""Where the sigmoid table's C2LIP (SigLIP) starts (issue 43's review): SigLIP's t and b at the fine-tunes' snapshot
and at the end, and C2LIP's loss terms at the first and last logged steps of its fine-tune, seed by seed.

    .venv/bin/python benchmarks/sigmoid_temperatures.py runs/sigmoid_a/T1600 runs/sigmoid_b/T1600 \
        [--out benchmarks/results/sigmoid_cpu/T1600/temperatures.json]

Reads each table folder's `seedS/SigLIP/snapshots/stepN/model.pt` (N = T - F, the snapshot C2LIP (SigLIP) and SigLIP
ft start from), `seedS/SigLIP/model.pt` and `seedS/C2LIP_SigLIP/metrics.csv` (its `siglip`, `npc` and `xac` columns);
writes one JSON file. Nothing is trained or scored. `71a_plateau` ("What the sigmoid table measured") reads the result:
with t near 11 and b near -10 the largest logit any pair can reach is t + b, about 1.5, so C2LIP's npc positives stay
far from satisfied.
"""
import json
import math
import sys
from pathlib import Path

import torch
import yaml

from powerclip.commandline import ArgumentParser, UsageError, run_main, usage_errors
from powerclip.train import read_metrics

TERMS = ("siglip", "npc", "xac", "loss")       # C2LIP's logged terms (metrics.csv), and their weighted sum


def _t_b(path: Path) -> dict:
    "t = exp(logit_scale) and b of a saved model."
    sd = torch.load(path, map_location="cpu", weights_only=True)
    return dict(t=math.exp(float(sd["logit_scale"])), b=float(sd["logit_bias"]))


def seed_facts(seed_dir: Path) -> dict:
    """SigLIP's t and b at the snapshot C2LIP (SigLIP) starts from (its config's `start_batch`) and at the end;
    C2LIP (SigLIP)'s terms at its first and last logged row."""
    c2 = seed_dir / "C2LIP_SigLIP"
    need = [c2 / "config.yaml", c2 / "metrics.csv", seed_dir / "SigLIP" / "model.pt"]
    if missing := [str(p) for p in need if not p.is_file()]:
        raise UsageError(f"{seed_dir}: not a finished seed of the sigmoid table ({', '.join(missing)} missing)")
    start = int(yaml.safe_load(need[0].read_text())["start_batch"])
    snapshot = seed_dir / f"SigLIP/snapshots/step{start}/model.pt"
    rows = read_metrics(c2 / "metrics.csv")
    if not rows or not snapshot.is_file():
        raise UsageError(f"{seed_dir}: C2LIP (SigLIP) logged no rows or SigLIP's snapshot at step {start} is gone")
    return dict(snapshot_step=start, siglip_at_snapshot=_t_b(snapshot),
                siglip_final=_t_b(seed_dir / "SigLIP" / "model.pt"),
                c2lip_first={k: rows[0][k] for k in ("step", *TERMS)},
                c2lip_last={k: rows[-1][k] for k in ("step", *TERMS)})


def _main(argv):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", type=Path, help="sigmoid table folders (runs/NAME/T{T})")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sigmoid_cpu/T1600/temperatures.json"))
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        seeds = {int(d.name[4:]): d for t in a.tables for d in sorted(t.glob("seed*")) if d.name[4:].isdigit()}
        if not seeds:
            raise UsageError(f"no seed folders in {', '.join(map(str, a.tables))}")
        out = {"tables": [str(t) for t in a.tables], "per_seed": {s: seed_facts(d) for s, d in sorted(seeds.items())}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    for s, f in out["per_seed"].items():
        z = f["siglip_at_snapshot"]
        print(f"seed {s}: t {z['t']:.2f}, b {z['b']:.2f} at step {f['snapshot_step']}; C2LIP npc "
              f"{f['c2lip_first']['npc']:.2f} -> {f['c2lip_last']['npc']:.2f}, siglip {f['c2lip_first']['siglip']:.2f}"
              f" -> {f['c2lip_last']['siglip']:.2f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(_main, None, "sigmoid_temperatures.py"))
