r"""Samples per second of the built-in world (powerclip.world), in one process and through a DataLoader.

    .venv/bin/python benchmarks/world_throughput.py [--n 4000] [--workers 2] \
        [--out benchmarks/results/world_throughput.json]

Prints one line per measurement and the machine; `--out` also writes them as JSON. `*_per_cpu_s` counts samples
per CPU-second of the process (what one free core would do), the others per wall-clock second (with the machine's
load at the time, given as load_avg_1min).
"""
import argparse, json, os, platform, sys, time
from pathlib import Path

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

from powerclip.world import WorldConfig, WorldDataset, collate_world, generate


def rate(fn, n):
    "(samples per wall second, samples per CPU second of this process): the second does not depend on other load."
    fn(0)                                   # warm-up (caches, lazy imports)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--n', type=int, default=4000, help='samples per measurement')
    ap.add_argument('--workers', type=int, default=2, help='DataLoader workers')
    ap.add_argument('--batch-size', type=int, default=128)
    ap.add_argument('--out', type=Path, default=None, help='also write the numbers here (JSON)')
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, 'n', 'batch-size')
        _checks.at_least(a, 0, 'workers')
        if a.out is not None:
            _checks.output('--out', a.out)
    torch.set_num_threads(1)
    cfg = WorldConfig()
    ds = WorldDataset(cfg, length=10 ** 7)
    res = {}
    for name, fn in (('generate_numpy', lambda i: generate(cfg, i)), ('dataset_tensors', lambda i: ds[i])):
        res[name], res[name + '_per_cpu_s'] = rate(fn, a.n)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, num_workers=a.workers, collate_fn=collate_world,
                                     persistent_workers=a.workers > 0)
    it = iter(dl)
    next(it)                 # start the workers before timing
    t0, seen = time.perf_counter(), 0
    for b in it:
        seen += len(b['text'])
        if seen >= a.n:
            break
    res[f'dataloader_{a.workers}_workers'] = seen / (time.perf_counter() - t0)
    machine = dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                   load_avg_1min=os.getloadavg()[0], python=platform.python_version(), torch=torch.__version__)
    for k, v in res.items():
        print(f'{k:28s} {v:8.0f} samples/s')
    print('machine:', json.dumps(machine))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(samples_per_s=res, machine=machine, config=vars(cfg), n=a.n),
                                    indent=1, default=str))


if __name__ == '__main__':
    sys.exit(run_main(main, prog='world_throughput.py'))
