"""Cost of the powerset loss as the number of regions M grows: exact enumeration vs the NLAs.

The analogue of the PowerCLIP supplement's Fig. 9. For each M, time and peak memory of forward + backward of
the powerset triplet loss (pooling of patch/token embeddings into regions/phrases included), exact
(O(2^M)) and NLA (O(M)), at a fixed per-device batch; plus, at the paper's setting (M=10, K~20, D=512), the
cost of the NLA loss and of the exact loss relative to the plain CLIP loss on the same embeddings, measured
in the same process.

Each configuration runs in a fresh subprocess so that peak memory is its own (`powerclip.measure.run_isolated`).

    python benchmarks/cost_scaling.py                  # CPU defaults: batch 32, exact up to M=12, NLA to M=32
    python benchmarks/cost_scaling.py --device cuda --batch 256 --exact-max 10
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import _checks
from powerclip.cli import ArgumentParser, run_main, usage_errors
from powerclip.loss import PowerCLIPLossConfig, PowersetInputs, clip_loss, powerclip_loss
from powerclip.measure import PeakMemory, run_isolated, sync
from powerclip.powerset import phrase_embeddings, pool_normalize

OUT = Path(__file__).parent / "results"


def make_inputs(C, M, K, W, N, L, D, device, seed=0):
    "Projected patch/token embeddings with grad, random region masks, a random tree: what the model hands the loss."
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(C, N, D, generator=g).to(device).requires_grad_()
    tokens = torch.randn(C, L, D, generator=g).to(device).requires_grad_()
    image = torch.randn(C, D, generator=g).to(device).requires_grad_()
    text = torch.randn(C, D, generator=g).to(device).requires_grad_()
    rmask = (torch.rand(C, M, N, generator=g) < 0.2).to(device)
    rmask[..., 0] = True
    leaf_tokens = torch.zeros(C, W, L, dtype=torch.bool)
    leaf_tokens[:, torch.arange(W), torch.arange(W) + 1] = True  # one BPE token per word
    inc = (torch.rand(C, K, W, generator=g) < 0.3)
    inc[:, 0] = True  # root covers every word
    return dict(patches=patches, tokens=tokens, image=image, text=text, rmask=rmask,
                rvalid=torch.ones(C, M, dtype=torch.bool, device=device), leaf_tokens=leaf_tokens.to(device),
                inc=inc.to(device), nvalid=torch.ones(C, K, dtype=torch.bool, device=device))


def step(x, kind, cfg):
    "Forward + backward of one loss on the given inputs."
    img, txt = F.normalize(x["image"], dim=-1), F.normalize(x["text"], dim=-1)
    scale = torch.tensor(100.0, device=img.device)
    if kind == "clip":
        loss = clip_loss(img, txt, scale)
    else:
        regions = pool_normalize(x["patches"], x["rmask"])
        phrases = phrase_embeddings(pool_normalize(x["tokens"], x["leaf_tokens"]), x["inc"])
        out = powerclip_loss(img, txt, scale, PowersetInputs(regions, x["rvalid"], phrases, x["nvalid"]), cfg)
        loss = out["clip"] + out["powerset"]
    loss.backward()


def measure(kind, C, M, K, W, N, L, D, device, reps):
    "In a fresh process: median time of `reps` steps after one warm-up, and peak memory."
    x = make_inputs(C, M, K, W, N, L, D, device)
    cfg = PowerCLIPLossConfig(exact=(kind == "exact"))
    step(x, kind, cfg); sync(device)  # warm-up
    mem = PeakMemory(device); mem.start()
    times = []
    for _ in range(reps):
        for t in ("patches", "tokens", "image", "text"):
            x[t].grad = None
        sync(device); t0 = time.perf_counter(); step(x, kind, cfg); sync(device)
        times.append(time.perf_counter() - t0)
    return dict(time_s=sorted(times)[len(times) // 2], peak_mib=mem.mib())


def run_one(kind, M, a):
    res = run_isolated(measure, kind, a.batch, M, a.nodes, a.words, a.patches, 77, a.dim, a.device, a.reps,
                       threads=os.cpu_count() or 1)
    return dict(kind=kind, M=M, **res)


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32, help="per-device batch C (the loss is C x C pairs)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--nodes", type=int, default=20, help="tree nodes K per caption")
    ap.add_argument("--words", type=int, default=16, help="leaves W per caption")
    ap.add_argument("--patches", type=int, default=196, help="N (14x14 for ViT-B/16 at 224 px)")
    ap.add_argument("--exact-max", type=int, default=12, help="largest M for exact enumeration")
    ap.add_argument("--nla-max", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "dim", "nodes", "words", "patches", "exact-max", "nla-max", "reps")
        _checks.device(a.device)

    rows = []
    for M in [m for m in (1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32) if m <= max(a.exact_max, a.nla_max)]:
        for kind in ("exact", "nla"):
            if (kind == "exact" and M > a.exact_max) or (kind == "nla" and M > a.nla_max):
                continue
            r = run_one(kind, M, a)
            rows.append(r)
            print(f"{kind:6s} M={M:3d}  " + (f"{r['time_s']*1e3:9.1f} ms  {r['peak_mib']:9.1f} MiB" if r["ok"] else r["error"]), flush=True)
    # the paper's setting: M=10, K=20, D=512, against CLIP alone on the same embeddings
    ref = {k: run_one(k, 10, a) for k in ("clip", "nla", "exact")}
    ratio = {k: ref[k]["time_s"] / ref["clip"]["time_s"] for k in ("nla", "exact") if ref[k]["ok"] and ref["clip"]["ok"]}

    OUT.mkdir(exist_ok=True)
    tag = f"{a.device}_C{a.batch}"
    meta = dict(device=a.device, gpu=torch.cuda.get_device_name() if a.device == "cuda" else None,
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                torch=torch.__version__, args=vars(a))
    (OUT / f"cost_scaling_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows, paper_setting=ref, ratio_to_clip=ratio), indent=1))
    lines = [f"# Cost scaling ({a.device}, batch {a.batch}, K={a.nodes}, D={a.dim}, N={a.patches})", "",
             "| M | exact ms | exact MiB | NLA ms | NLA MiB |", "|---|---|---|---|---|"]
    for M in sorted({r["M"] for r in rows}):
        cell = lambda k: next((r for r in rows if r["M"] == M and r["kind"] == k), None)
        fmt = lambda r, f: ("-" if r is None else (f"{r[f] * (1e3 if f == 'time_s' else 1):.1f}" if r["ok"] else "OOM"))
        lines.append(f"| {M} | {fmt(cell('exact'), 'time_s')} | {fmt(cell('exact'), 'peak_mib')} | {fmt(cell('nla'), 'time_s')} | {fmt(cell('nla'), 'peak_mib')} |")
    lines += ["", f"At M=10: CLIP loss {ref['clip'].get('time_s', float('nan'))*1e3:.2f} ms; "
              + ", ".join(f"{k} / CLIP = {v:.1f}x" for k, v in ratio.items())]
    (OUT / f"cost_scaling_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    for kind, style in (("exact", "o-"), ("nla", "s-")):
        ok = [r for r in rows if r["kind"] == kind and r["ok"]]
        ax[0].plot([r["M"] for r in ok], [r["time_s"] * 1e3 for r in ok], style, label=kind.upper() if kind == "nla" else "exact (2^M)")
        ax[1].plot([r["M"] for r in ok], [r["peak_mib"] for r in ok], style, label=kind)
    ax[0].set(yscale="log", xlabel="regions M", ylabel="fwd+bwd time (ms)", title=f"time, batch {a.batch}, {a.device}")
    ax[1].set(yscale="log", xlabel="regions M", ylabel="peak memory (MiB)", title="peak memory")
    ax[0].legend(); fig.tight_layout(); fig.savefig(OUT / f"cost_scaling_{tag}.png", dpi=120)
    print("wrote", OUT / f"cost_scaling_{tag}.md")


if __name__ == "__main__":
    sys.exit(run_main(main, prog="cost_scaling.py"))
