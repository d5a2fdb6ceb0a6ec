"""Ops dispatched and host syncs of one PowerCLIP loss call on the blocked path (issue 37, item 3).

A GPU waits for itself at every host sync (`.item()`, `.tolist()`, an op whose output size depends on the data, a
blocking copy from the host), and spends ~10-15 us of launch overhead on every op it dispatches; on a CPU neither
shows. This script counts both on the simulated CUDA device of `tests/cuda_sim.py` (real CPU values, a GPU's device
rules; every aten op that touches the device is counted, every host sync with its kind and the line it came from),
for one call of the loss, forward and backward, in fp32 and under bf16 autocast:

* `ddp-rows`: `powerclip_loss` in its data-parallel form with `impl='fast'`: R local images and texts against C
  gathered ones, both directions of the triplet loss plus CLIP's loss, the inputs as `PowerCLIP.loss` hands them
  over after its gather (packed nodes; the host facts where the code has them: `PowersetInputs.node_counts` and
  `all_regions_valid`);
* `method`: `PowerCLIP.loss` of one process (R = C), from the padded batch the data pipeline builds
  (`powerset_inputs`: region pooling, phrase sums, packing) to the loss, the batch through
  `PowerCLIP.prepare_batch` on the host first, as `Run.prepare` does.

`ddp-rows` runs at each `--block-mib` budget (16 MiB, the CPU's, and 1 MiB: about 10x the blocks), which separates the
ops that every block costs from those of the call (the `blocks` column: both directions' blocks, `block_plan`); at the
paper's size (R = 512, C = 4,096, M = 10) 16 MiB makes 84 blocks and the GPU budget of an 80 GB device (596 MiB) 4.

Node counts K_j are drawn from real parsed CC3M captions (`results/cc3m_node_counts.json`, as
`powerset_scale.py`), every region valid (random boxes, PowerCLIP-R). The counts are the same on any machine; they
do not time anything.

    python benchmarks/loss_syncs.py --tag after                                  # this tree
    git worktree add /tmp/before <commit>                                         # another tree of the package:
    PYTHONPATH=/tmp/before python benchmarks/loss_syncs.py --tag before           # its powerclip, this simulator

Results: `--out`/loss_syncs_cpu.{json,md}; a tag already there is replaced, the others kept (so the table compares
them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from powerclip.commandline import ArgumentParser, run_main, usage_errors

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
sys.path.insert(0, str(HERE.parent / "tests"))          # the simulator


def _host_facts_supported() -> bool:
    "Whether this tree's `PowersetInputs` carries host facts (the change of issue 37's item 3)."
    from powerclip.loss import PowersetInputs
    return "node_counts" in {f.name for f in dataclasses.fields(PowersetInputs)}


def _ddp_rows_inputs(R, C, M, D, counts, seed=0):
    "Leaves (CPU, with grad), and a function that builds the loss's inputs from their simulated copies."
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g), dim=-1)
    P = sum(counts)
    node_text = torch.arange(C).repeat_interleave(torch.tensor(counts))                  # (P,)
    P_loc = sum(counts[:R])
    leaves = dict(image_all=unit(C, D), text_all=unit(C, D), regions_all=unit(C, M, D),
                  phrases_all=unit(P, D) * (1 + 2 * torch.rand(P, 1, generator=g)))
    rest = dict(rv=torch.ones(C, M, dtype=torch.bool), node_text=node_text)
    return leaves, rest, P_loc


def n_blocks(R, C, M, counts, block_bytes) -> int:
    "Blocks of one call at this budget, both directions (local images x all texts, all images x local texts), fp32."
    from powerclip.powerset_fast import block_plan
    total = 0
    for rows_, texts in ((R, counts), (C, counts[:R])):
        rows, blocks = block_plan(rows_, M, texts, 4, block_bytes)
        total += -(-rows_ // rows) * len(blocks)
    return total


def one_call(scenario, precision, R, C, M, D, counts, block_bytes=16 << 20) -> dict:
    "Ops and host syncs of one forward + backward of the loss on the simulated GPU."
    from cuda_sim import counted, sim_backward, sim_cuda, to_sim
    from powerclip.loss import PowerCLIPLossConfig, PowersetInputs, powerclip_loss
    host = _host_facts_supported()
    res = {}
    with sim_cuda():
        if scenario == "ddp-rows":
            leaves, rest, P_loc = _ddp_rows_inputs(R, C, M, D, counts)
            sim = {k: to_sim(v).requires_grad_() for k, v in leaves.items()}
            rv, nt = to_sim(rest["rv"]), to_sim(rest["node_text"])
            facts = lambda n: dict(node_counts=list(counts[:n]), all_regions_valid=True) if host else {}
            local = PowersetInputs(sim["regions_all"][:R], rv[:R], sim["phrases_all"][:P_loc], node_text=nt[:P_loc],
                                   **facts(R))
            gathered = PowersetInputs(sim["regions_all"], rv, sim["phrases_all"], node_text=nt, **facts(C))
            cfg = PowerCLIPLossConfig(impl="fast", block_bytes=block_bytes)
            scale = to_sim(torch.tensor(100.0))

            def forward():
                out = powerclip_loss(sim["image_all"][:R], sim["text_all"][:R], scale, local, cfg, sim["image_all"],
                                     sim["text_all"], gathered, 0)
                return out["clip"] + out["powerset"]
        else:
            from powerclip.dist import DistContext
            from powerclip.methods import get_method
            method = get_method("powerclip", {"impl": "fast", "M": M, "block_bytes": block_bytes})
            out_cpu, batch = _method_batch(C, M, D, counts)
            batch = method.prepare_batch(batch)                                    # on the host, as Run.prepare
            batch = {k: to_sim(v) if torch.is_tensor(v) else v for k, v in batch.items()}
            out = {k: to_sim(v).requires_grad_(v.is_floating_point() and v.dim() > 0) for k, v in out_cpu.items()}

            def forward():
                terms = method.loss(out, batch, DistContext(device=torch.device("cuda", 0)))
                return terms["clip"] + terms["powerset"]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            with counted() as fwd:
                loss = forward()
        with counted() as bwd:
            sim_backward(loss)
        for name, st in (("forward", fwd), ("backward", bwd)):
            res[name] = dict(ops=st.ops, syncs=st.syncs, scalars=st.scalars, d2h=st.d2h, shape=st.shape,
                             h2d_blocking=st.h2d_blocking, sites=dict(sorted(st.sync_sites.items())))
        res["loss"] = float(loss.detach().cpu())
    res["host_facts"] = host
    return res


def _method_batch(C, M, D, counts, N=49, L=77, seed=0):
    "Model outputs (`encode`'s) and a host batch with the batch contract's shapes, nodes padded to the longest caption."
    g = torch.Generator().manual_seed(seed)
    K = max(counts)
    W = K                                   # words: as many as nodes (each leaf a word, each node a span of words)
    out = dict(image=F.normalize(torch.randn(C, D, generator=g), dim=-1),
               text=F.normalize(torch.randn(C, D, generator=g), dim=-1),
               patches=torch.randn(C, N, D, generator=g), tokens=torch.randn(C, L, D, generator=g),
               logit_scale=torch.tensor(100.0))
    k = torch.tensor(counts)
    node_valid = torch.arange(K)[None, :] < k[:, None]                                     # (C, K)
    leaf = torch.zeros(C, W, L, dtype=torch.bool)
    for w in range(W):
        leaf[:, w, 1 + w] = True
    inc = (torch.rand(C, K, W, generator=g) < 0.3) & node_valid[:, :, None]               # (C, K, W)
    inc[:, :, 0] |= node_valid                                                            # every node covers a word
    masks = torch.rand(C, M, N, generator=g) < 0.3
    masks[:, :, 0] = True
    batch = dict(leaf_tokens=leaf, leaf_valid=torch.ones(C, W, dtype=torch.bool), incidence=inc,
                 node_valid=node_valid, region_masks=masks, region_valid=torch.ones(C, M, dtype=torch.bool))
    return out, batch


def machine() -> str:
    cpu = (next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                 if l.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists()
           else platform.machine())
    return f"{cpu}, {os.cpu_count()} cores"


def _commit(path: Path) -> str:
    "The commit of the package's tree, and whether the package differs from it."
    git = lambda *a: subprocess.run(["git", "-C", str(path), *a], capture_output=True, text=True, check=True).stdout
    try:
        dirty = git("status", "--porcelain", "--", ".").strip()
        return git("rev-parse", "--short", "HEAD").strip() + (" + uncommitted changes in the package" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def report(data: dict, out: Path) -> None:
    "The md table of every tag in `data`, before / after side by side."
    rows = data["rows"]
    tags = list(dict.fromkeys(r["tag"] for r in rows))
    lines = ["# Ops and host syncs of one PowerCLIP loss call (blocked path)", "",
             "Counted on the simulated CUDA device of `tests/cuda_sim.py` (CPU values, a GPU's rules): every aten op "
             "that touches the device, and every host sync by kind (`scalar`: `.item()`/`bool()`/`int()`; `d2h`: a "
             "copy to the host, `.tolist()`; `shape`: an op whose output size depends on the data, `nonzero`, "
             "boolean-mask indexing, `bincount`, `repeat_interleave` without `output_size`, `unique`; `h2d_blocking`: "
             "a copy from the host without `non_blocking`, which CUDA follows with a stream sync).", "",
             "`ddp-rows`: `powerclip_loss(impl='fast')` with R local rows against C gathered columns (what a process "
             "of a data-parallel run computes after its gather); `method`: `PowerCLIP.loss` of one process (R = C), "
             "from the padded batch to the loss (region pooling, phrase sums, packing included), the batch through "
             "`prepare_batch` on the host first.", ""]
    for t in tags:
        m = data["meta"][t]
        lines.append(f"- `{t}`: powerclip of {m['package']} (commit {m['commit']}), host facts "
                     f"{'passed' if m['host_facts'] else 'not in this tree'}; torch {m['torch']}; {m['machine']}; "
                     f"`{m['command']}`")
    order = lambda r: (r["scenario"], -r["block_mib"], r["precision"], tags.index(r["tag"]))
    lines += ["", "| scenario | R | C | M | D | block MiB | blocks | precision | tag | ops fwd | ops bwd | ops | "
                  "syncs fwd | syncs bwd | scalar / d2h / shape / h2d_blocking |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=order):
        f, b = r["forward"], r["backward"]
        kinds = " / ".join(str(f[k] + b[k]) for k in ("scalars", "d2h", "shape", "h2d_blocking"))
        lines.append(f"| {r['scenario']} | {r['R']} | {r['C']} | {r['M']} | {r['D']} | {r['block_mib']:g} | "
                     f"{r['blocks']} | {r['precision']} | {r['tag']} | {f['ops']:,} | {b['ops']:,} | "
                     f"{f['ops'] + b['ops']:,} | {f['syncs']} | {b['syncs']} | {kinds} |")
    est = []
    for t in tags:
        for prec in ("fp32", "bf16"):
            pts = sorted({r["blocks"]: r for r in rows if (r["tag"], r["scenario"], r["precision"]) == (t, "ddp-rows",
                                                                                                       prec)}.items())
            if len(pts) < 2:
                continue
            (b0, r0), (b1, r1) = pts[0], pts[-1]
            ops0, ops1 = (r["forward"]["ops"] + r["backward"]["ops"] for r in (r0, r1))
            per = (ops1 - ops0) / (b1 - b0)
            est.append(f"- {t}, {prec}: {per:.0f} ops per block, {ops0 - per * b0:.0f} per call besides; so at the "
                       f"paper's size about {ops0 + per * (84 - b0):,.0f} ops with 16 MiB (84 blocks) and "
                       f"{ops0 + per * (4 - b0):,.0f} with an 80 GB GPU's 596 MiB (4 blocks)")
    if est:
        lines += ["", "Ops per block, from the two budgets of `ddp-rows` (a straight line through them: an estimate "
                      "for other block counts, not a measurement):", "", *est]
    lines += ["", "Where each sync came from (forward and backward together):", ""]
    for r in sorted(rows, key=order):
        sites = {}
        for part in ("forward", "backward"):
            for k, v in r[part]["sites"].items():
                sites[k] = sites.get(k, 0) + v
        lines.append(f"- {r['scenario']}, {r['block_mib']:g} MiB, {r['precision']}, {r['tag']}: "
                     + ("; ".join(f"{k} x{v}" for k, v in sites.items()) if sites else "none"))
    (out / "loss_syncs_cpu.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = ArgumentParser(prog="loss_syncs.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="name of this tree's rows (e.g. before, after)")
    ap.add_argument("--R", type=int, default=64, help="ddp-rows: local rows")
    ap.add_argument("--C", type=int, default=512, help="ddp-rows: gathered columns")
    ap.add_argument("--method-C", type=int, default=128, help="method: the one process's batch")
    ap.add_argument("--M", type=int, default=10, help="regions per image")
    ap.add_argument("--dim", type=int, default=64, help="embedding width D")
    ap.add_argument("--block-mib", type=float, nargs="+", default=[16, 1],
                    help="ddp-rows: block budgets in MiB (method: the first)")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--scenarios", nargs="+", default=["ddp-rows", "method"], choices=["ddp-rows", "method"])
    ap.add_argument("--out", type=Path, default=OUT, help="folder of loss_syncs_cpu.{json,md}")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        # checked here, not with _checks: the script also runs against an older tree of the package (--tag before)
        for n in ("R", "C", "method-C", "M", "dim"):
            if getattr(a, n.replace("-", "_")) < 1:
                raise ValueError(f"--{n}: must be at least 1, got {getattr(a, n.replace('-', '_'))}")
        if min(a.block_mib) <= 0:
            raise ValueError(f"--block-mib: must be > 0, got {min(a.block_mib)}")
        if a.R > a.C:
            raise ValueError(f"--R: at most --C ({a.C}), got {a.R}")
        if a.out.exists() and not a.out.is_dir():
            raise ValueError(f"--out: {a.out} is a file, not a folder")
    if torch.cuda.is_available():
        raise SystemExit("loss_syncs.py: a GPU is here; the simulator runs without one (make gpu-check measures "
                         "the real thing)")
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    from powerset_scale import draw_counts, node_count_hist
    import powerclip
    nc = node_count_hist()
    pkg = Path(powerclip.__file__).resolve().parent
    meta = dict(package=str(pkg), commit=_commit(pkg), host_facts=_host_facts_supported(), torch=torch.__version__,
                machine=machine(), node_counts=nc["source"],
                command=" ".join([*(["PYTHONPATH=" + os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                    else []), "python benchmarks/loss_syncs.py", *(argv or sys.argv[1:])]))
    rows = []
    for scenario in a.scenarios:
        R, C = (a.R, a.C) if scenario == "ddp-rows" else (a.method_C, a.method_C)
        counts = draw_counts(nc.get("hist"), C, seed=C)
        for mib in a.block_mib if scenario == "ddp-rows" else a.block_mib[:1]:
            bb = int(mib * 2**20)
            for precision in a.precision:
                r = one_call(scenario, precision, R, C, a.M, a.dim, counts, bb)
                rows.append(dict(tag=a.tag, scenario=scenario, precision=precision, R=R, C=C, M=a.M, D=a.dim,
                                 block_mib=mib, blocks=n_blocks(R, C, a.M, counts, bb), K_max=max(counts),
                                 P=sum(counts), **r))
                f, b = r["forward"], r["backward"]
                print(f"{a.tag} {scenario} {mib:g} MiB {precision}: ops {f['ops']} + {b['ops']}, syncs {f['syncs']} + "
                      f"{b['syncs']}", flush=True)
                for k, v in {**f["sites"], **{f"(bwd) {k}": v for k, v in b["sites"].items()}}.items():
                    print(f"    {v} x {k}")
    path = a.out / "loss_syncs_cpu.json"
    data = json.loads(path.read_text()) if path.exists() else dict(meta={}, rows=[])
    data["rows"] = [r for r in data["rows"] if r["tag"] != a.tag] + rows
    data["meta"][a.tag] = meta
    path.write_text(json.dumps(data, indent=1) + "\n")
    report(data, a.out)
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    sys.exit(run_main(main, prog="loss_syncs.py"))
