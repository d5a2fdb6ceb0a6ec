r"""Recipes for the paper's global batch on fewer or smaller GPUs: `accum_steps` (and gradient checkpointing) per GPU
count and memory, from the bytes `paper_memory.py` measured (issue 32).

With `accum_steps = k` (`powerclip.accum`) a process's batch of L = global / G rows is embedded k micro-batches of
m = L / k at a time. Its memory, by the passes of `accumulate`:

* k = 1, the trainer's plain step (paper_memory.py's model): W + L * t + loss(L) + the loss's block budget;
* pass 2, the loss once on the joined outputs: W + L * j + loss(L);
* pass 3, one micro-batch re-embedded with gradient: W + L * (j + g) + m * t + the loss's block budget;

with W the weights, their gradients and AdamW's moments (16 bytes per parameter) and autocast's bf16 copy of the
weights (2 bytes per parameter under bf16), j the joined forward outputs per sample (image, text, patch and token
embeddings: what PowerCLIP's loss reads; CLIP's reads image and text but the tokens are joined all the same), g their
gradient (the outputs the loss reads), t the towers' saved-for-backward bytes per sample (`paper_memory.json`: those
one H200 measured where it measured them, which is every precision and checkpointing setting here; each recipe row
says which), and loss(L) the loss's saved bytes at L local rows against the global batch. PowerCLIP's loss was
measured at R = 512 against C = 4096 (`paper_memory.json`); at L rows against the same C it is at most L / 512 times
that (its R x C tables grow as L, its gathered inputs stay). CLIP's loss at CLIP's own batch (32,768) is measured
here, at 512 rows against 32,768 columns, and scaled by L / 512 the same way.

A recipe is k = 1 where the plain step fits, else the smallest k >= 2 (a power of two dividing L) with both passes
within the GPU's memory less 10 % (the allocator and the CUDA context, as `paper_memory.py`). Nothing here runs on a
GPU: these are bounds from measured bytes, to be checked on the GPU at hand by the GPU check's `accum` part
(`gpu_check.py`, ViT-B/16 at 256 per GPU in k = 1, 2, 4 micro-batches).

    python benchmarks/accum_recipes.py        # seconds; writes results/accum_recipes.{md,json}
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from powerclip.commandline import ArgumentParser, run_main, usage_errors

OUT = Path(__file__).parent / "results"
# memory a CUDA process can have on each card class (GiB, as the driver reports it): a 24 GB A10 reports 22.5 GiB
# (a 4090 24.0), a 48 GB A6000 47.5 (an L40S 45.0), an 80 GB H100 79.6: the smallest of each class
CARDS = {"24 GB": 22.5, "48 GB": 45.0, "80 GB": 79.6}
GPUS = (1, 2, 4, 8)


def clip_loss_bytes(R: int, C: int, D: int, precision: str) -> int:
    "Saved-for-backward bytes of the CLIP loss (both directions) at R local rows against C gathered columns."
    from powerclip.loss import clip_loss
    from powerclip.powerset_fast import saved_tensor_bytes
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=-1).to(dt).requires_grad_()
    img_all, txt_all = unit(C), unit(C)
    held = img_all.untyped_storage().nbytes() + txt_all.untyped_storage().nbytes()
    with saved_tensor_bytes() as n:
        loss = clip_loss(img_all[:R], txt_all[:R], torch.tensor(100.0), img_all, txt_all, 0)
    loss.backward()
    return n["bytes"] - held


def recipe(L: int, budget: float, W: float, j: float, g: float, t: float, loss_L: float, block: float) -> dict:
    "The smallest k (a power of two dividing L) whose two passes fit `budget` bytes; k None when none does."
    plain = W + L * t + loss_L + block                     # k = 1: the trainer's plain step, nothing joined
    if plain <= budget:
        return dict(k=1, micro=L, peak_gib=plain / 2**30)
    pass2 = W + L * j + loss_L
    k = 2
    while L % k == 0:
        m = L // k
        pass3 = W + L * (j + g) + m * t + block
        if max(pass2, pass3) <= budget:
            return dict(k=k, micro=m, peak_gib=max(pass2, pass3) / 2**30)
        k *= 2
    return dict(k=None, micro=None, peak_gib=pass2 / 2**30)


def main(argv=None):
    ap = ArgumentParser(prog="accum_recipes.py", description=__doc__.split("\n")[0])
    ap.add_argument("--memory", type=Path, default=OUT / "paper_memory.json", help="paper_memory.py's results")
    ap.add_argument("--reserve", type=float, default=0.10, help="share kept for the allocator and the CUDA context")
    ap.add_argument("--batch", type=int, default=4096, help="the paper's global batch (PowerCLIP)")
    ap.add_argument("--clip-batch", type=int, default=32768, help="CLIP's global batch (Radford et al.)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of accum_recipes.{md,json}")
    with usage_errors():
        a = ap.parse_args(argv)
        if not a.memory.is_file():
            raise FileNotFoundError(f"--memory {a.memory} is missing: run benchmarks/paper_memory.py first")
        try:
            pm = json.loads(a.memory.read_text())
            meta, rows = pm["meta"], pm["rows"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"--memory {a.memory} is not paper_memory.py's output ({e})") from None
        if not 0 <= a.reserve < 1 or a.batch < 8 or a.clip_batch < 8:
            raise ValueError("--reserve must be in [0, 1), --batch and --clip-batch at least 8")
    from powerclip.model import model_geometry
    import open_clip
    arch = meta.get("arch", "ViT-B-16")
    geo = model_geometry(arch)
    D = open_clip.get_model_config(arch)["embed_dim"]
    N = (geo.image_size // geo.patch_size) ** 2
    params, block = meta["params"], meta["block_mib"] * 2**20
    R0 = next(r["R_measured"] for r in rows)
    out, lines, towers_from = [], [], {}
    for prec in ("bf16", "fp32"):
        b = 2 if prec == "bf16" else 4                                     # bytes of an output under autocast
        W = 16 * params + (2 * params if prec == "bf16" else 0)
        clip_R0 = clip_loss_bytes(R0, a.clip_batch, D, prec)
        for ck in (False, True):
            row = next(r for r in rows if r["precision"] == prec and r["checkpointing"] == ck and r["M"] == 10)
            t = row["towers_mib_per_sample"] * 2**20
            src = row.get("towers_from", meta.get("measured_on", "the CPU"))
            towers_from[f"{prec}, checkpointing {'on' if ck else 'off'}"] = (f"{row['towers_mib_per_sample']:.1f} MiB "
                                                                            f"({src})")
            cases = [("powerclip", a.batch, (N + geo.context_length + 2) * D * b,
                      (N + geo.context_length + 2) * D * b, lambda L: row["loss_gib_at_R"] * 2**30 * L / R0),
                     ("clip", a.clip_batch, (geo.context_length + 2) * D * b, 2 * D * b, lambda L: clip_R0 * L / R0)]
            for method, batch, j, g, loss in cases:
                for card, gib in CARDS.items():
                    for G in GPUS:
                        if method == "clip" and (G != 8 or card != "80 GB"):
                            continue                                         # CLIP's 32k: on 8 x 80 GB only
                        L = batch // G
                        r = recipe(L, gib * 2**30 * (1 - a.reserve), W, j, g, t, loss(L), block)
                        out.append(dict(method=method, precision=prec, checkpointing=ck, card=card, card_gib=gib,
                                        gpus=G, global_batch=batch, local_batch=L, towers_from=src, **r))
    meta_out = dict(memory=str(a.memory), reserve=a.reserve, arch=arch, params=params, patches=N,
                    context=geo.context_length, embed_dim=D, measured_on=meta.get("measured_on", "the CPU"),
                    towers_from=towers_from, loss_R_measured=R0, cards_gib=CARDS)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "accum_recipes.json").write_text(json.dumps(dict(meta=meta_out, recipes=out), indent=1))

    def cell(r):
        if r["k"] is None:
            return f"no ({r['peak_gib']:.0f} GiB before any micro-batch)"
        return f"k={r['k']} (micro {r['micro']}, {r['peak_gib']:.1f} GiB)"

    lines = [f"# The paper's batch on fewer GPUs: accum_steps from measured bytes ({arch}, M = 10)", "",
             f"Computed by `python benchmarks/accum_recipes.py` from `{a.memory.name}` (the loss's saved bytes "
             f"measured on {meta_out['measured_on']}; the towers' per sample: "
             + "; ".join(f"{k} {v}" for k, v in towers_from.items()) + "). Memory per card class: "
             + ", ".join(f"{c} as {v} GiB" for c, v in CARDS.items())
             + f", less {a.reserve:.0%}. Each cell: the smallest `accum_steps` k whose two passes fit, the micro-batch "
             "per process and the larger pass's bytes; \"no\" when the joined outputs and the loss of one process's "
             "batch alone do not fit.", ""]
    for method, batch in (("powerclip", a.batch), ("clip", a.clip_batch)):
        sel = [r for r in out if r["method"] == method]
        lines += [f"## {'PowerCLIP (and CLIP)' if method == 'powerclip' else 'CLIP'} at a global batch of {batch}", "",
                  "| precision | grad ckpt | card | " + " | ".join(f"{G} GPU{'s' * (G > 1)}" for G in GPUS) + " |",
                  "|---|---|---|" + "---|" * len(GPUS)]
        for prec in ("bf16", "fp32"):
            for ck in (False, True):
                for card in CARDS:
                    cells = [next((cell(r) for r in sel if r["precision"] == prec and r["checkpointing"] == ck
                                   and r["card"] == card and r["gpus"] == G), "") for G in GPUS]
                    if any(cells):
                        lines.append(f"| {prec} | {'yes' if ck else 'no'} | {card} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["The command: `torchrun --nproc_per_node G -m powerclip.train --preset paper accum_steps=k` "
              "(the preset sets `global_batch_size: 4096`, bf16 on a GPU and gradient checkpointing; "
              "`model.grad_checkpointing=false` for the rows without it; CLIP's 32k: "
              "`--method clip global_batch_size=32768`)."]
    (a.out / "accum_recipes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_main(main, prog="accum_recipes.py"))
