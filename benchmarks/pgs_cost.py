"""Cost of CLIP-PGS's patch selection per batch against the vision tower's forward pass.

    .venv/bin/python benchmarks/pgs_cost.py [--arch ViT-B-16] [--batch 32] [--repeats 3] [--threads 1]

Times, on the same random batch (random weights, nothing downloaded):
  select   the selection alone (pixel + feature cosines, Sobel, Sinkhorn, greedy growth) as PGSSelector runs it,
  flip     the vision tower's forward in train mode with FLIP's random dropout at 0.5,
  pgs      the vision tower's forward in train mode with PGS_0.5 (selection included),
  full     the vision tower's forward without dropout (CLIP),
each the median of `repeats` runs after one warm-up, forward only, no gradient. The paper (Table 6) puts the
selection's overhead below 3 % of training time on GPUs; here it is measured on the machine it runs on.
"""
import json, platform, statistics, sys, time

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors


def _median_time(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="ViT-B-16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--debug", action="store_true", help="show the traceback of a usage error")
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, "batch", "repeats", "threads")
        _checks.arch("--arch", a.arch)
        _checks.device(a.device)
    torch.set_num_threads(a.threads)
    from powerclip.baselines.clip_pgs import PGSConfig, PGSSelector, hash_uniform
    from powerclip.baselines.flip import random_keep
    from powerclip.model import create_model, select_patch_tokens
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = create_model(a.arch)[0].to(dev).train()
    v = model.visual
    size = v.image_size[0] if isinstance(v.image_size, (tuple, list)) else v.image_size
    image = torch.randn(a.batch, 3, size, size, device=dev)
    N = v.grid_size[0] * v.grid_size[1]
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    res = dict(arch=a.arch, batch=a.batch, patches=N, device=str(dev), threads=a.threads,
               cpu=platform.processor() or platform.machine(), torch=torch.__version__)

    with torch.no_grad():
        # the token sequence the selector receives: patch + positional embeddings, class token first
        x = v.conv1(image).flatten(2).transpose(1, 2)
        x = torch.cat([v.class_embedding.expand(a.batch, 1, -1), x], 1) + v.positional_embedding
        def selector():
            return PGSSelector(PGSConfig(), v.patch_size[0], image,
                               noise=hash_uniform(torch.arange(a.batch, device=dev), 0, 0, N),
                               alpha=0.5, pos=v.positional_embedding)

        def select():
            selector()(x)
            sync()
        res["select_s"] = _median_time(select, a.repeats)

        def tower():
            v(image)
            sync()
        res["full_s"] = _median_time(tower, a.repeats)

        def tower_flip():
            with select_patch_tokens(model, lambda t: random_keep(t, 0.5)):
                v(image)
            sync()
        res["flip_s"] = _median_time(tower_flip, a.repeats)

        def tower_pgs():
            with select_patch_tokens(model, selector()):
                v(image)
            sync()
        res["pgs_s"] = _median_time(tower_pgs, a.repeats)
    res["select_over_flip_forward"] = res["select_s"] / res["flip_s"]
    res["select_over_full_forward"] = res["select_s"] / res["full_s"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    sys.exit(run_main(main, prog="pgs_cost.py"))
