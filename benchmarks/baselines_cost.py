"""Cost of the baseline losses (forward + backward of the loss alone, model excluded) at ViT-B/16 sizes.

    .venv/bin/python benchmarks/baselines_cost.py --batch 32 --repeats 3

Per-process batch R = C (one process), N = 196 patches, L = 77 token slots of which 12 are words, D = 512.
Writes benchmarks/results/baselines_cost_<device>_C<batch>.{json,md}. On CUDA it also records peak memory.
"""
import json, platform, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

import _checks
from powerclip.baselines.c2lip import npc_loss, xac_loss
from powerclip.baselines.filip import filip_loss
from powerclip.baselines.smartclip import modular_loss
from powerclip.baselines.sparc import sparc_fine_loss
from powerclip.loss import clip_loss
from powerclip.commandline import ArgumentParser, run_main, usage_errors
from powerclip.model import text_token_mask


def inputs(C, N=196, L=77, D=512, words=12, K=4, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()
    ids = torch.zeros(C, L, dtype=torch.long)
    ids[:, 0] = 49406
    ids[:, 1:1 + words] = 5
    ids[:, 1 + words] = 49407
    return dict(image=r(C, D), text=r(C, D), patches=r(C, N, D), tokens=r(C, L, D),
                mask=torch.rand(C, D, generator=g).to(device).requires_grad_(),
                concepts=r(C, K, D), valid=text_token_mask(ids).to(device),
                cvalid=torch.ones(C, K, dtype=torch.bool, device=device))


LOSSES = {
    "clip": lambda x, s: clip_loss(F.normalize(x["image"], dim=-1), F.normalize(x["text"], dim=-1), s),
    "filip": lambda x, s: filip_loss(F.normalize(x["patches"], dim=-1),
                                     F.normalize(x["tokens"], dim=-1), x["valid"], s),
    "filip_chunk8": lambda x, s: filip_loss(F.normalize(x["patches"], dim=-1), F.normalize(x["tokens"], dim=-1),
                                            x["valid"], s, chunk=8),
    "sparc_fine": lambda x, s: sparc_fine_loss(x["patches"], x["tokens"], x["valid"], s),
    "smartclip_modular": lambda x, s: modular_loss(x["image"], x["text"], x["mask"], s),
    "c2lip_npc+xac": lambda x, s: npc_loss(F.normalize(x["image"], dim=-1), F.normalize(x["concepts"], dim=-1),
                                           x["cvalid"], s, -10.0)
                                  + xac_loss(x["patches"], F.normalize(x["concepts"], dim=-1), x["cvalid"], s, -10.0),
}


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--note", default="", help="a line about the machine's state (e.g. shared with other jobs)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "repeats")
        dev = _checks.device(a.device)
    x, s = inputs(a.batch, device=dev), torch.tensor(100.0, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for name, f in LOSSES.items():
        f(x, s).backward()  # warm-up
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.repeats):
            for v in x.values():
                if v.grad is not None:
                    v.grad = None
            sync()
            t = time.perf_counter()
            f(x, s).backward()
            sync()
            times.append(time.perf_counter() - t)
        row = {"loss": name, "batch": a.batch, "ms_median": 1000 * sorted(times)[len(times) // 2]}
        if dev.type == "cuda":
            row["peak_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
        rows.append(row)
        print(row, flush=True)
    machine = (torch.cuda.get_device_name() if dev.type == "cuda" else f"{platform.processor() or platform.machine()}, "
                                                                       f"{torch.get_num_threads()} threads")
    out = Path(__file__).parent / "results" / f"baselines_cost_{dev.type}_C{a.batch}"
    out.parent.mkdir(exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "torch": torch.__version__, "note": a.note,
                                                    "rows": rows}, indent=1))
    lines = [f"Loss forward+backward, ViT-B/16 sizes (N=196, L=77, 12 words, D=512), batch {a.batch}, on {machine}", "",
             "| loss | ms (median of %d) |%s" % (a.repeats, " peak MiB |" if dev.type == "cuda" else ""),
             "|---|---|%s" % ("---|" if dev.type == "cuda" else "")]
    lines += [f"| {r['loss']} | {r['ms_median']:.1f} |"
              + (f" {r['peak_mib']:.0f} |" if "peak_mib" in r else "") for r in rows]
    if a.note:
        lines += ["", a.note]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(run_main(main, prog="baselines_cost.py"))
