"""How large a PowerCLIP batch and how many masks fit an 80 GB GPU with ViT-B/16 (issue 15), from measured bytes.

No GPU is needed: autograd's saved-for-backward bytes are counted with `torch.autograd.graph.saved_tensors_hooks`
(`powerclip.powerset_fast.saved_tensor_bytes`) on the CPU, for

* the towers: `encode` of ViT-B/16 at 224 px with 77 text tokens, patch and token embeddings included (PowerCLIP
  reads them), per sample, in fp32 and under bf16 autocast, with and without gradient checkpointing;
* the PowerCLIP loss at the paper's shape: R local rows against C = 8 R gathered ones (8 GPUs), M masks, D = 512,
  node counts drawn from real parsed CC3M captions (benchmarks/results/cc3m_node_counts.json, written by
  powerset_scale.py), the fast path (blocked, analytic backward) with its transient block budget;
* the weights, their gradients and AdamW's two moments (fp32: 16 bytes per parameter).

The total for a local batch R is `weights + R * towers + loss(R, 8R, M) + block budget`, and the largest R with a
total below the budget (default 80 GiB less 10 % for the allocator and CUDA context: 72 GiB) is reported for M in
{10, 15, 32}. The loss's bytes are the same tensors on any device. The towers' are not: a GPU keeps other layouts and
kernels' tensors, and one H200 (`results/gpu_nvidia_h200/`, the GPU check's memory part) measured more than this CPU
for bf16 (8.7 MiB per sample with checkpointing against 7.6, 199.4 without against 191.3) and for fp32 without
checkpointing (387.9 against 379.0); fp32 with checkpointing agreed (13.7). So the projection takes the towers' bytes
per sample a GPU measured wherever one did (`--device-bytes`, default that H200's results; each row says which), and
this CPU's elsewhere.

    python benchmarks/paper_memory.py                 # about 2-4 minutes on 2 CPU cores
    python benchmarks/paper_memory.py --device cuda --out benchmarks/results/gpu_x   # measured on a GPU (gpu_check.py)

On a GPU (`--device cuda`) the same bytes are counted there (its attention kernels, its layouts), and the peak memory
CUDA's allocator reached in each measurement is recorded beside them; no other device's bytes are used then.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

OUT = Path(__file__).parent / "results"
DEVICE_BYTES = OUT / "gpu_nvidia_h200" / "results.json"    # the GPU check's memory part on one H200
ROOT = Path(__file__).resolve().parents[1]


def shown(path) -> str:
    "A path as the repository names it (relative to its root where it is inside)."
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def device_towers(path) -> tuple[str, dict]:
    """(device, {(precision, checkpointing): towers' MiB per sample}) that a GPU measured: the memory part of a GPU
    check's results.json (or a paper_memory.json measured on a GPU)."""
    d = json.loads(Path(path).read_text())
    if "parts" in d:
        rows, dev = d["parts"]["memory"]["results"], d["meta"]["device"]
    else:
        rows, dev = d["rows"], d["meta"]["measured_on"]
    if not rows or dev in (None, "the CPU", "CPU (dry run)"):
        raise ValueError(f"{path}: no bytes measured on a GPU")
    return dev, {(r["precision"], r["checkpointing"]): r["towers_mib_per_sample"] for r in rows}


def tower_bytes(precision: str, checkpointing: bool, b: int = 2, arch: str = "ViT-B-16", device: str = "cpu") -> dict:
    "Saved-for-backward bytes of `encode` (images and texts, patch and token embeddings) per sample; the peak (MiB)."
    from powerclip.measure import PeakMemory
    from powerclip.model import create_model, encode, geometry_of
    from powerclip.powerset_fast import saved_tensor_bytes
    torch.manual_seed(0)
    model = create_model(arch)[0].train().to(device)
    model.set_grad_checkpointing(checkpointing)
    geo = geometry_of(model)
    img = torch.randn(b, 3, geo.image_size, geo.image_size, device=device)
    tok = torch.randint(1, min(49000, getattr(model, "vocab_size", 49408) - 1), (b, geo.context_length), device=device)
    ctx = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16")
    mem = PeakMemory(device)
    mem.start()
    t0 = time.perf_counter()
    with saved_tensor_bytes() as n, ctx:
        out = encode(model, img, tok, need_patches=True)
    inputs = img.untyped_storage().nbytes() + tok.untyped_storage().nbytes()
    sum(v.float().sum() for k, v in out.items() if k != "logit_scale").backward()
    params = sum(p.numel() for p in model.parameters())
    return dict(per_sample=(n["bytes"] - inputs) / b, params=params, seconds=time.perf_counter() - t0,
                peak_mib=mem.mib(), b=b)


def _node_counts(C: int, counts: list[int]) -> torch.Tensor:
    "(C,) nodes per text, drawn from the parsed captions' counts as `loss_bytes` draws them (seed 0)."
    g = torch.Generator().manual_seed(0)
    return torch.tensor(counts)[torch.randint(len(counts), (C,), generator=g)].clamp_min(1)


def input_bytes(C: int, M: int, precision: str, counts: list[int], D: int = 512) -> int:
    """Bytes of `loss_bytes`'s inputs (the gathered image, text, region and phrase embeddings, the node index, the
    region mask), from their shapes: what it measures as `inputs`, without running the loss."""
    b = 2 if precision == "bf16" else 4
    P = int(_node_counts(C, counts).sum())
    return b * (2 * C * D + C * M * D + P * D) + 8 * P + C * M


def loss_bytes(R: int, C: int, M: int, precision: str, block_mib: int, counts: list[int], D: int = 512,
               device: str = "cpu") -> dict:
    """Saved-for-backward bytes of the PowerCLIP loss (fast path, both directions, CLIP loss included) at R x C; the
    peak (MiB)."""
    from powerclip.loss import PowerCLIPLossConfig, PowersetInputs, powerclip_loss
    from powerclip.measure import PeakMemory
    from powerclip.powerset_fast import saved_tensor_bytes
    K = _node_counts(C, counts)                                                          # (C,) nodes per text
    g = torch.Generator().manual_seed(0)
    torch.randint(len(counts), (C,), generator=g)                                        # the draw of K, consumed
    dt = torch.bfloat16 if precision == "bf16" else torch.float32                        # what autocast hands the loss
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g),
                                                    dim=-1).to(device, dt).requires_grad_()
    img_all, txt_all, reg_all = unit(C, D), unit(C, D), unit(C, M, D)
    phr_all = unit(int(K.sum()), D)
    node_text = torch.arange(C).repeat_interleave(K).to(device)
    rv = torch.ones(C, M, dtype=torch.bool, device=device)
    local_nodes = int(K[:R].sum())
    local = PowersetInputs(reg_all[:R], rv[:R], phr_all[:local_nodes], node_text=node_text[:local_nodes])
    gathered = PowersetInputs(reg_all, rv, phr_all, node_text=node_text)
    cfg = PowerCLIPLossConfig(block_bytes=block_mib << 20)
    mem = PeakMemory(device)
    mem.start()
    t0 = time.perf_counter()
    with saved_tensor_bytes() as n:
        terms = powerclip_loss(img_all[:R], txt_all[:R], torch.tensor(50.0, device=device), local, cfg, img_all,
                               txt_all, gathered, 0)
    held = sum(t.untyped_storage().nbytes() for t in (img_all, txt_all, reg_all, phr_all, node_text, rv))
    (terms["clip"] + terms["powerset"]).backward()
    return dict(saved=n["bytes"], beyond_inputs=n["bytes"] - held, inputs=held, mean_nodes=float(K.float().mean()),
                seconds=time.perf_counter() - t0, peak_mib=mem.mib())


def main(argv=None):
    ap = ArgumentParser(prog="paper_memory.py", description=__doc__.split("\n")[0])
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory (GiB)")
    ap.add_argument("--reserve", type=float, default=0.10, help="share kept for the allocator and the CUDA context")
    ap.add_argument("--M", type=int, nargs="+", default=[10, 15, 32])
    ap.add_argument("--R", type=int, default=512, help="local rows at which the loss is measured (the paper: 4096 / 8)")
    ap.add_argument("--block-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="where the bytes are measured: cpu | cuda | cuda:N")
    ap.add_argument("--arch", default="ViT-B-16", help="the towers' architecture (a small one "
                                                       "only to check the script)")
    ap.add_argument("--device-bytes", default=str(DEVICE_BYTES), help="a GPU check's results.json whose memory part "
                    "gives the towers' bytes per sample the projection takes where a GPU measured them; 'none': only "
                    "this run's (always so with --device cuda)")
    ap.add_argument("--reproject", type=Path, default=None, metavar="JSON", help="measure nothing: the projection "
                    "again from a paper_memory.json measured on the CPU (its towers' and loss's bytes), with "
                    "--device-bytes; seconds")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the results (paper_memory.{json,md})")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "R", "M", "block-mib")
        if a.gpu_gib <= 0 or not 0 <= a.reserve < 1:
            raise ValueError("--gpu-gib must be > 0 and --reserve in [0, 1)")
        _checks.device(a.device)
        _checks.arch("--arch", a.arch)
        _checks.out_dir("--out", a.out)
        gpu_dev, gpu_towers = None, {}
        if a.device_bytes != "none" and a.device == "cpu" and a.arch == "ViT-B-16":
            p = _checks.existing("--device-bytes", a.device_bytes)
            try:
                gpu_dev, gpu_towers = device_towers(p)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--device-bytes: {e}") from None
        hist = OUT / "cc3m_node_counts.json"
        if not hist.is_file():
            raise FileNotFoundError(f"{hist} is missing: run benchmarks/powerset_scale.py once "
                                    "(it parses CC3M captions)")
        old = None
        if a.reproject is not None:
            old = json.loads(_checks.existing("--reproject", a.reproject).read_text())
            if old.get("meta", {}).get("device", "cpu") != "cpu" or a.device != "cpu":
                raise ValueError("--reproject: takes a paper_memory.json measured on the CPU, on the CPU")
            a.R, a.M, a.block_mib = old["rows"][0]["R_measured"], sorted({r["M"] for r in old["rows"]}), \
                old["meta"]["block_mib"]
    if a.threads:
        torch.set_num_threads(a.threads)
    # the parsed captions' K
    counts = [int(k) for k, n in json.loads(hist.read_text())["hist"].items() for _ in range(n)]
    rows, towers = [], {}
    for prec in ("fp32", "bf16"):
        for ck in (False, True):
            if old is not None:           # the CPU's bytes as measured then
                r = next(r for r in old["rows"] if (r["precision"], r["checkpointing"]) == (prec, ck))
                mib = r.get("towers_mib_per_sample_cpu") or r["towers_mib_per_sample"]
                towers[(prec, ck)] = dict(per_sample=mib * 2**20, params=old["meta"]["params"],
                                          peak_mib=r.get("towers_peak_mib"), b=r.get("towers_peak_b"))
                continue
            towers[(prec, ck)] = tower_bytes(prec, ck, arch=a.arch, device=a.device)
            print(f"towers {prec} checkpointing={ck}: "
                  f"{towers[(prec, ck)]['per_sample'] / 2**20:.1f} MiB per sample", flush=True)
    params = towers[("fp32", False)]["params"]
    on_ = torch.cuda.get_device_name(torch.device(a.device)) if a.device.startswith("cuda") else "the CPU"
    weights = 16 * params                                       # fp32 weights + grads + AdamW m, v
    budget = a.gpu_gib * 2**30 * (1 - a.reserve)
    for prec in ("fp32", "bf16"):
        for M in a.M:
            if old is not None:           # the loss's bytes as measured then; its inputs' share from their shapes
                r = next(r for r in old["rows"] if (r["precision"], r["M"]) == (prec, M))
                saved, held = round(r["loss_gib_at_R"] * 2**30), input_bytes(8 * a.R, M, prec, counts)
                lb = dict(saved=saved, inputs=held, beyond_inputs=saved - held, mean_nodes=old["meta"]["mean_nodes"],
                          peak_mib=r.get("loss_peak_gib", float("nan")) * 2**10)
            else:
                lb = loss_bytes(a.R, 8 * a.R, M, prec, a.block_mib, counts, device=a.device)
                print(f"loss {prec} M={M} R={a.R} C={8 * a.R}: {lb['saved'] / 2**30:.2f} GiB "
                      f"saved ({lb['seconds']:.0f} s)", flush=True)
            # the loss's bytes grow as R*C = 8 R^2 (tables) and C*(M + K)*D (gathered inputs): scale from the
            # measurement
            per_rc = lb["beyond_inputs"] / (a.R * 8 * a.R)
            per_c = lb["inputs"] / (8 * a.R)
            for ck in (False, True):
                here = towers[(prec, ck)]["per_sample"]
                t = gpu_towers[(prec, ck)] * 2**20 if (prec, ck) in gpu_towers else here
                total = lambda R: weights + R * t + per_rc * R * 8 * R + per_c * 8 * R + (a.block_mib << 20)
                R = 1
                while total(R + 1) <= budget:
                    R += 1
                rows.append(dict(precision=prec, checkpointing=ck, M=M, towers_mib_per_sample=t / 2**20,
                                 towers_mib_per_sample_cpu=here / 2**20 if a.device == "cpu" else None,
                                 towers_from=gpu_dev if (prec, ck) in gpu_towers else on_,
                                 loss_gib_at_R=lb["saved"] / 2**30, loss_beyond_inputs_bytes=lb["beyond_inputs"],
                                 loss_inputs_bytes=lb["inputs"], R_measured=a.R, total_gib_at_R=total(a.R) / 2**30,
                                 fits_at_R=total(a.R) <= budget, max_local_batch=R,
                                 towers_peak_mib=towers[(prec, ck)]["peak_mib"], towers_peak_b=towers[(prec, ck)]["b"],
                                 loss_peak_gib=lb["peak_mib"] / 2**10))
    on = on_
    if old is not None:                   # the measurement's own record
        meta_old = old["meta"]
    meta = dict(machine=platform.processor() or platform.machine(), torch=torch.__version__, params=params,
                weights_gib=weights / 2**30, gpu_gib=a.gpu_gib, reserve=a.reserve, block_mib=a.block_mib,
                mean_nodes=lb["mean_nodes"], device=a.device, measured_on=on, arch=a.arch,
                towers_from_device=gpu_dev, device_bytes=shown(a.device_bytes) if gpu_dev else None)
    if old is not None:
        meta.update(machine=meta_old["machine"], torch=meta_old["torch"],
                    reprojected=f"from {a.reproject.name}'s CPU bytes, measured with torch {meta_old['torch']}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "paper_memory.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# PowerCLIP with {a.arch} on one GPU of {a.gpu_gib:.0f} GiB (8 GPUs: C = 8 R), from "
             f"saved-for-backward bytes measured on {on}" + (f" and {gpu_dev}" if gpu_dev else ""),
             "", f"{params / 1e6:.1f} M parameters: weights + gradients + AdamW moments {weights / 2**30:.2f} GiB; "
             f"budget {budget / 2**30:.1f} GiB ({a.gpu_gib:g} GiB less {a.reserve:.0%} kept back); loss measured at "
             f"R = {a.R}, C = {8 * a.R}, mean {lb['mean_nodes']:.1f} nodes per caption (CC3M); block budget "
             f"{a.block_mib} MiB. "
             + (f"Towers: the bytes per sample {gpu_dev} measured (its attention kernels and layouts; the GPU check's "
                f"memory part, {shown(a.device_bytes)}) where it measured them, this CPU's elsewhere; column 'towers "
                "from' says which, 'CPU' gives this CPU's for comparison." if gpu_dev else
                "Towers: CPU attention kernels." if on == "the CPU" else "Measured with this GPU's kernels."), "",
             "| precision | grad ckpt | M | towers MiB/sample | towers from | CPU | loss GiB at R | total GiB at R | "
             "fits at R | largest local batch |",
             "|---|---|---:|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        cpu = r["towers_mib_per_sample_cpu"]
        lines.append(f"| {r['precision']} | {'yes' if r['checkpointing'] else 'no'} | {r['M']} | "
                     f"{r['towers_mib_per_sample']:.1f} | {r['towers_from']} | "
                     f"{'-' if cpu is None else format(cpu, '.1f')} | {r['loss_gib_at_R']:.2f} | "
                     f"{r['total_gib_at_R']:.1f} | {'yes' if r['fits_at_R'] else 'no'} | {r['max_local_batch']} |")
    if old is not None:
        lines += ["", f"Projected again without measuring (`--reproject`): {meta['reprojected']}."]
    (a.out / "paper_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_main(main, prog="paper_memory.py"))
