"""The Triton S-bar kernels compiled for a GPU architecture on a machine without one: registers, spills, shared memory.

    .venv/bin/python benchmarks/sbar_triton_compile.py [--arch 90] [--quick] [--out benchmarks/results]

Triton compiles ahead of time with the ptxas it ships (no GPU, no driver): each row is `compile_report` (10b) for one
dtype, spec, M and D at the default tiles of `default_tiles`, and a few other tile sizes for comparison. What it shows:
that the kernels compile for that architecture, and whether a kernel spills registers to local memory (stack > 0), the
one cost a tile choice can be judged by without running it. Which tiles are fastest needs a GPU (the GPU check's
paths part). Writes sbar_triton_sm{ARCH}.md / .json under --out (--quick: one row, printed, nothing written; the
test suite runs it). TRITON_INTERPRET must be unset: it is removed here before powerclip is imported.
"""
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)      # interpreted kernels do not compile

import torch

from powerclip.commandline import ArgumentParser, run_main, usage_errors
from powerclip.powerset_fast import SbarSpec

ROOT = Path(__file__).resolve().parents[1]
SHARED_KIB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}   # the most shared memory one block may take


def rows(quick: bool) -> list[tuple]:
    "(label, dtype, spec, tiles or None, M, D) of each compilation."
    from powerclip.sbar_triton import Tiles
    bf, fp = torch.bfloat16, torch.float32
    if quick:
        return [("bf16, default tiles", bf, SbarSpec(), None, 10, 512)]
    return [("bf16, default tiles", bf, SbarSpec(), None, 10, 512),
            ("bf16, default tiles, M = 5", bf, SbarSpec(), None, 5, 512),
            ("bf16, default tiles, M = 15", bf, SbarSpec(), None, 15, 512),
            ("bf16, default tiles, D = 768", bf, SbarSpec(), None, 10, 768),
            ("bf16, no region sets, default tiles", bf, SbarSpec(region_sets=False), None, 10, 512),
            ("fp16, default tiles", torch.float16, SbarSpec(), None, 10, 512),
            ("fp32 (parity), default tiles", fp, SbarSpec(), None, 10, 512),
            ("bf16, tiles 32 x 32, 32 texts", bf, SbarSpec(), Tiles(32, 32, 32), 10, 512),
            ("bf16, tiles 16 x 32, 16 texts", bf, SbarSpec(), Tiles(16, 32, 16), 10, 512),
            ("bf16, tiles 32 x 64, 16 texts", bf, SbarSpec(), Tiles(32, 64, 16), 10, 512),
            ("bf16, no region sets, 16 texts", bf, SbarSpec(region_sets=False), Tiles(32, 32, 16), 10, 512),
            ("fp32, tiles 32 x 32, 16 texts", fp, SbarSpec(), Tiles(32, 32, 16), 10, 512)]


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200; 80: A100)")
    ap.add_argument("--quick", action="store_true", help="one row (the default bf16 tiles), printed only")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    with usage_errors():
        a = ap.parse_args(argv)
        if a.arch < 70:
            raise ValueError(f"--arch: Triton needs compute capability 7.0 or more, got {a.arch / 10:g}")
        import triton
        from powerclip.sbar_triton import compile_report, default_tiles
    res, t0 = [], time.time()
    for label, dtype, spec, tiles, M, D in rows(a.quick):
        t = tiles or default_tiles(dtype, spec)
        rep = compile_report(a.arch, dtype, spec, t, M, D)
        res.append(dict(label=label, dtype=str(dtype).split(".")[-1], region_sets=spec.region_sets, M=M, D=D,
                        tiles=[t.rows, t.nodes, t.texts], kernels=rep))
        print(label, json.dumps(rep), flush=True)
    if a.quick:
        return 0
    head = ("| compilation | tiles (rows x nodes, texts) | forward: regs / stack / shared KiB | backward, regions | "
            "backward, nodes |")
    md = [f"# The Triton S-bar kernels compiled for sm_{a.arch} (no GPU: Triton {triton.__version__}'s ptxas)", "",
          "Registers per thread, stack (bytes per thread spilled to local memory; 0 is the aim) and shared memory per "
          f"block (sm_{a.arch} allows {SHARED_KIB.get(a.arch, '?')} KiB), per kernel. Compiling says nothing of speed: "
          "the GPU check's paths part times the kernels.", "", head, "|---|---|---|---|---|"]
    for r in res:
        cell = lambda k: "{regs} / {stack} / {kib:.0f}".format(kib=k["shared"] / 1024, **k)
        ks = r["kernels"]
        md.append(f"| {r['label']} | {r['tiles'][0]} x {r['tiles'][1]}, {r['tiles'][2]} | "
                  f"{cell(ks['_sbar_fwd_kernel'])} | {cell(ks['_sbar_bwd_regions'])} | {cell(ks['_sbar_bwd_nodes'])} |")
    cmd = "python benchmarks/sbar_triton_compile.py" + (f" --arch {a.arch}" if a.arch != 90 else "")
    md += ["", f"`{cmd}`: {time.time() - t0:.0f} s (Triton caches compilations) on "
           f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, torch {torch.__version__}, triton {triton.__version__}, "
           f"{time.strftime('%Y-%m-%d')}"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sbar_triton_sm{a.arch}.md").write_text("\n".join(md) + "\n")
    (out / f"sbar_triton_sm{a.arch}.json").write_text(json.dumps(dict(command=cmd, triton=triton.__version__,
                                                                      torch=torch.__version__, rows=res), indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog="benchmarks/sbar_triton_compile.py"))
