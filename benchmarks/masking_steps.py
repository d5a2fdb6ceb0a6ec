"""Why a masking method's step jitters, on the CPU (issue 38, item 3): per training forward pass of FLIP, CLIP-PGS,
PGS-0.3, E-CLIP and A-CLIP (and CLIP, the reference), the number of patch tokens that enter the vision transformer,
the aten operators the pass dispatches, and the ones among them that make the host wait for a GPU, with where they are.

On one H200 (`results/gpu_nvidia_h200/`, steps-other at 256) CLIP-PGS's 5 timed steps took 164-363 ms (a 2.2x spread)
and PGS-0.3's 174-346 ms, against CLIP's 195-232 ms (1.19x). A step's time moves when its shapes move (a new token
count: new kernels, new allocations) or when the host stops to wait for the device in the middle of the forward pass
(then the device idles while the host launches the next operators one by one: the more small operators after a sync,
the longer, and the more the host's own speed shows). This script counts both where the CPU can see them, with the
paper preset's geometry (ViT-B/16, 224 px: 196 patches) at a small batch:

* tokens: the sequence length into the vision transformer's first block, per step (a hook on `ln_pre`);
* ops: aten operators of the whole training forward pass (a `TorchDispatchMode`), and of the patch choice alone (the
  difference to CLIP's forward);
* syncs: operators that read a device tensor's value or data-dependent shape on the host (`_local_scalar_dense`:
  `.item()`, `bool()`, `int()`; `nonzero`; boolean-mask indexing; `masked_select`; `unique`; `repeat_interleave`
  without `output_size`), each with the package line that issued it.

    python benchmarks/masking_steps.py --tag after --code "<this commit>"   # minutes on 2 CPU cores
    PYTHONPATH=<a checkout of be50879> python benchmarks/masking_steps.py --tag before --code be50879
    python benchmarks/masking_steps.py --methods clip-pgs-0.3 clip-pgs-0.3:drop_multiple=8 --steps 6

Results: results/masking_steps_cpu_TAG.json, and masking_steps_cpu.md with every tag's table.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from powerclip.commandline import ArgumentParser, run_main, usage_errors

OUT = Path(__file__).parent / "results"
METHODS = ("clip", "flip", "clip-pgs", "clip-pgs-0.3", "clip-pgs-0.3:drop_multiple=8", "eclip",
           "eclip:drop_multiple=8", "aclip")
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount"}


def _site() -> str:
    "The innermost line of the package (or a baseline) on the stack: where a sync was issued."
    for f in reversed(traceback.extract_stack()):
        if "/powerclip/" in f.filename and "_python_dispatch" not in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} {f.name}"
    return "?"


class Count(TorchDispatchMode):
    "Counts every aten operator, and the syncing ones by the package line that issued them."
    def __init__(self):
        super().__init__()
        self.ops, self.syncs = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += 1
        sync = name in SYNC_OPS
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            sync = True                                      # boolean-mask indexing: nonzero inside
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            sync = True
        if sync:
            k = f"{name} at {_site()}"
            self.syncs[k] = self.syncs.get(k, 0) + 1
        return func(*args, **kwargs)


def forward_counts(method: str, steps: int, batch: int) -> dict:
    "Per training forward pass of `method` (paper geometry, `batch` images): tokens, ops, syncs and host seconds."
    from powerclip import dist as pdist
    from powerclip.train import build_run, load_config
    name, _, opts = method.partition(":")
    over = [f"data.batch_size={batch}", "data.source=world", "data.workers=0", "global_batch_size=null",
            f"data.world_length={batch * steps}", f"max_steps={steps + 10}", "resume=never", "precision=fp32",
            "model.pool=tok", *[f"method_cfg.{kv}" for kv in opts.split(",") if kv]]
    run = build_run(load_config("paper", over, method=name), pdist.DistContext())
    tokens = []
    hook = run.model.visual.ln_pre.register_forward_hook(lambda m, a, y: tokens.append(int(y.shape[1])))
    it, rows = iter(run.loader()), []
    for step in range(steps):
        b = run.prepare(next(it))
        run.method.on_step(step, run.total)
        c = Count()
        t0 = time.perf_counter()
        with torch.no_grad(), c:
            run.fwd(b)
        rows.append(dict(step=step, tokens=tokens[-1], ops=c.ops, syncs=sum(c.syncs.values()), sites=c.syncs,
                         host_s=time.perf_counter() - t0))
    hook.remove()
    return dict(method=method, steps=rows)


def report(out: Path) -> None:
    "masking_steps_cpu.md from every tag's json in `out` (before / after a change)."
    runs = [json.loads(f.read_text()) for f in sorted(out.glob("masking_steps_cpu_*.json"))]
    runs.sort(key=lambda r: r["meta"]["tag"] != "before")
    m = runs[0]["meta"]
    lines = ["# The masking methods' forward pass, step by step, on the CPU", "",
             f"`python benchmarks/masking_steps.py`: {m['steps']} training forward passes of each method, paper preset "
             f"geometry (ViT-B/16, 224 px, 196 patches), batch {m['batch']} of the built-in world, torch {m['torch']}. "
             "tokens = the tokens entering the vision transformer at each step (class token included); ops = aten "
             "operators of the forward pass; choice = those beyond CLIP's forward (the patch choice, the views); "
             "host reads = operators that read a value or a data-dependent size on the host, with their line: on a "
             "GPU each makes the host wait for the device (on the CPU every tensor is a host tensor, so a read of a "
             "tensor that would be on the host anyway is counted too; the simulated GPU of tests/cuda_sim.py counts "
             "a GPU's, copies from the host included: `SYNC_BUDGET` in tests/test_cuda_dry_run.py). Runs: "
             + "; ".join(f"{r['meta']['tag']} = {r['meta']['code']}" for r in runs) + ".", ""]
    for r in runs:
        base = next((x for x in r["methods"] if x["method"] == "clip" and x["steps"]), None)
        clip_ops = base["steps"][-1]["ops"] if base else None
        lines += [f"## {r['meta']['tag']}", "", "| method | tokens per step | ops | choice | host reads | where |",
                  "|---|---|---:|---:|---:|---|"]
        for x in r["methods"]:
            if not x["steps"]:
                lines.append(f"| {x['method']} | {x.get('error', '-')} | | | | |")
                continue
            s = x["steps"]
            toks = ", ".join(str(y["tokens"]) for y in s)
            sites = "; ".join(f"{k} x{v}" for k, v in s[-1]["sites"].items()) or "-"
            choice = s[-1]["ops"] - clip_ops if clip_ops is not None else "-"
            lines.append(f"| {x['method']} | {toks} | {s[-1]['ops']} | {choice} | {s[-1]['syncs']} | {sites} |")
        lines.append("")
    (out / "masking_steps_cpu.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv=None):
    ap = ArgumentParser(prog="masking_steps.py", description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="after", help="this run's name in the report (before / after a change)")
    ap.add_argument("--code", default="this tree", help="what code it ran, in words (a commit)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--debug", action="store_true")
    with usage_errors():
        a = ap.parse_args(argv)
        if a.steps < 1 or a.batch < 2 or a.threads < 1:
            raise ValueError("--steps must be at least 1, --batch at least 2, --threads at least 1")
    torch.set_num_threads(a.threads)
    res = []
    for m in a.methods:
        try:
            res.append(forward_counts(m, a.steps, a.batch))
        except (ValueError, KeyError) as e:      # an option this code does not have (an older tree): say so
            res.append(dict(method=m, error=f"{type(e).__name__}: {e}"[:200], steps=[]))
    a.out.mkdir(parents=True, exist_ok=True)
    meta = dict(preset="paper (ViT-B/16, 224 px, 196 patches)", batch=a.batch, steps=a.steps, threads=a.threads,
                torch=torch.__version__, tag=a.tag, code=a.code, note="training forward pass only, fp32, no gradient")
    (a.out / f"masking_steps_cpu_{a.tag}.json").write_text(json.dumps(dict(meta=meta, methods=res), indent=1))
    report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog="masking_steps.py"))
