"""Throughput of data_prep/annotate_shards.py on real photos packed as img2dataset shards.

    .venv/bin/python benchmarks/annotate_throughput.py [--n 200] [--per-shard 50] [--regions none slic] [--workers 1 2]

Packs the first N coco_sample photos (first caption each) into shards in a temporary directory (never in the
repository), runs the tool on them for each setting, and prints samples per second, with and without the
process start-up (spaCy and torch imports, measured by a run on an empty shard list). Writes
benchmarks/results/annotate_throughput.json.
"""
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import webdataset as wds

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors

ROOT = Path(__file__).resolve().parents[1]
COCO = ROOT.parent / 'shared' / 'data' / 'coco_sample'


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--n', type=int, default=200)
    ap.add_argument('--per-shard', type=int, default=50)
    ap.add_argument('--regions', nargs='+', default=['none', 'slic'], choices=['none', 'slic', 'felzenszwalb'])
    ap.add_argument('--workers', type=int, nargs='+', default=[1, 2])
    ap.add_argument('--coco', type=Path, default=COCO, help='coco_sample folder (images/, captions.jsonl)')
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, 'n', 'per-shard', 'workers')
        _checks.existing('--coco', a.coco / 'images', 'dir', 'the shared coco_sample: images/ and captions.jsonl')
        _checks.existing('--coco', a.coco / 'captions.jsonl')
    coco = a.coco
    rows = [json.loads(l) for l in (coco / 'captions.jsonl').read_text().splitlines()][: a.n]
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / 'in'
        src.mkdir()
        for s in range(0, len(rows), a.per_shard):
            with wds.TarWriter(str(src / f'{s // a.per_shard:05d}.tar')) as w:
                for i, r in enumerate(rows[s: s + a.per_shard]):
                    w.write({'__key__': f'{s + i:09d}', 'jpg': (coco / 'images' / r['file_name']).read_bytes(),
                             'txt': r['captions'][0], 'json': json.dumps({'caption': r['captions'][0]})})
        for regions in a.regions:
            for workers in a.workers:
                out = Path(tmp) / f'out_{regions}_{workers}'
                cmd = [sys.executable, '-m', 'data_prep.annotate_shards', str(src), '--out', str(out), '--regions',
                       regions, '--workers', str(workers), '--parser', 'spacy', '--no-progress']
                t = time.time()
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                dt = time.time() - t
                if r.returncode:
                    sys.exit(r.stderr[-2000:])
                summ = json.loads((out / 'summary.json').read_text())
                shard_s = sum(json.loads(p.read_text())['seconds'] for p in out.glob('*.stats.json'))
                res.append(dict(regions=regions, workers=workers, samples=summ['written'], wall_s=round(dt, 2),
                                samples_per_s_wall=round(summ['written'] / dt, 2),
                                samples_per_s_per_process_excluding_startup=round(summ['written'] / shard_s, 2)))
                print(res[-1], flush=True)
    machine = dict(platform=platform.platform(), cpus=os.cpu_count(), load_avg=os.getloadavg())
    print(machine)
    out = ROOT / 'benchmarks' / 'results'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'annotate_throughput.json').write_text(json.dumps(dict(machine=machine, runs=res), indent=1))


if __name__ == '__main__':
    sys.exit(run_main(main, prog='annotate_throughput.py'))
