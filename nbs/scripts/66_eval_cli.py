# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp eval.cli

# %%
#| export
from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path

import torch

from powerclip.eval.benchmarks import BENCHMARKS, _missing, clip_benchmark_cli, select
from powerclip.eval.data import MissingData, write_world_benchmark
from powerclip.eval.models import Evaluator
from powerclip.eval.tables import PAPER, paper_tables, render_table, results_table, write_paper_tables
from powerclip.eval.tasks import TASKS, evaluate_scorers, find_data, run_suite, write_scored
from powerclip.world import WorldConfig

log = logging.getLogger(__name__)

# %%
#| hide
import tempfile
from contextlib import redirect_stdout
from io import StringIO
from fastcore.test import test_eq


# %% [markdown]
# # The evaluation command line
#
# > `powerclip-eval` (or `python -m powerclip.eval`): one checkpoint on one data folder, the paper's suite, the world's benchmark folder, tables, and clip_benchmark's own CLI.

# %% [markdown]
# ```
# powerclip-eval run [--model powerclip-tiny] [--checkpoint run/ | ckpt.pt] [--method filip] --data ../shared/data/coco_sample \
#     [--tasks retrieval sugarcrepe | all] [--out results/eval] [--cache ~/.cache/powerclip/features]
# powerclip-eval make-world /tmp/world --n-images 100     # the built-in world's benchmark folder (every task)
# powerclip-eval table results/eval/*/*.json --out results/eval/table   # table.md and table.csv
# powerclip-eval suite --model ViT-B-16 --checkpoint run/model.pt --root ~/benchmarks [--benchmarks table1 table3 | cifar10 ..] \
#     [--device cuda --precision bf16 --workers 8]       # the paper's benchmarks found under ROOT/<data set>/
# powerclip-eval tables results/eval --out results/eval/tables [--paper powerclip-s=PowerCLIP-S]   # Tables 1-5, 9
# powerclip-eval clip-benchmark eval --dataset ... --model powerclip-tiny --pretrained run/model.pt --output 'res/{dataset}.json'
# ```
# `python -m powerclip.eval` is the same (`66a_eval_main`). A checkpoint is a file or a run folder (`62_eval_models`):
# the run's config names the architecture and the method, whose scorers are all computed (`--method` overrides it;
# `--model` the architecture). `--tasks all` skips, and records, tasks whose data is absent; naming a task whose data is
# absent stops with the message saying what to put where (exit code 2). Every user mistake (a missing file, a
# checkpoint that does not fit, an unknown method, a diverged checkpoint) is one line on stderr and exit code 2.

# %%
#| export
def _model_args(r):
    "The options of `run` and `suite` that pick the checkpoint and how to run it."
    r.add_argument('--model', default=None, help="model config: 'powerclip-tiny', 'powerclip-micro', 'ViT-B-16', a preset "
                   "(default: the one the run's config names)")
    r.add_argument('--model-kwargs', default=None, type=json.loads, help='JSON open_clip model_kwargs overriding the config')
    r.add_argument('--checkpoint', default=None, help='checkpoint file or run folder; omitted = random init (tests)')
    r.add_argument('--method', default=None, help="training method whose scorers to use, e.g. 'filip' (default: the one the "
                   "run's config names; none known: the global cosine)")
    r.add_argument('--label', default=None, help='checkpoint column label (default: the checkpoint file stem)')
    r.add_argument('--out', default='results/eval')
    r.add_argument('--cache', default=str(Path.home() / '.cache' / 'powerclip' / 'features'), help="feature cache; 'none' disables")
    r.add_argument('--seed', type=int, default=0, help='random-init seed when no checkpoint is given')
    r.add_argument('--batch-size', type=int, default=64)
    r.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    r.add_argument('--precision', choices=('fp32', 'bf16'), default='fp32', help='bf16: torch.autocast in bfloat16 (features cached apart)')
    r.add_argument('--workers', type=int, default=0, help='DataLoader workers for clip_benchmark data sets')
    r.add_argument('--no-progress', action='store_true')

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog='powerclip-eval', description='Evaluate an open_clip checkpoint on local benchmark files.')
    sub = p.add_subparsers(dest='cmd', required=True)
    r = sub.add_parser('run', help='evaluate one checkpoint on one data root')
    _model_args(r)
    r.add_argument('--data', required=True, help='data root (coco_sample, a world folder, a SugarCrepe or Winoground folder, a webdataset export)')
    r.add_argument('--images', default=None, help='image folder when it is not DATA/images (e.g. COCO val2017 for SugarCrepe)')
    r.add_argument('--tasks', nargs='+', default=['all'], help=f"some of {' '.join(TASKS)}, or all")
    r.add_argument('--name', default=None, help='data set name in the results (default: the data folder name)')
    s = sub.add_parser('suite', help="one checkpoint on the paper's benchmarks under a root (one folder per data set)")
    _model_args(s)
    s.add_argument('--root', required=True, help="benchmark root: ROOT/<clip_benchmark name, '/' as '-'>/, e.g. ROOT/cifar10, ROOT/vtab-resisc45")
    s.add_argument('--benchmarks', nargs='+', default=['all'], help='data set names, table ids (table1 .. table5, table9) or all; '
                   'naming some makes an absent one an error')
    tb = sub.add_parser('tables', help="the paper's Tables 1-5 and 9 from result JSONs (Markdown and CSV)")
    tb.add_argument('results', nargs='+', help='result JSONs or folders holding them')
    tb.add_argument('--out', default=None, help='folder for table1.md, table1.csv, ..')
    tb.add_argument('--paper', nargs='*', default=[], metavar='LABEL=METHOD',
                    help="add the paper's reported numbers of METHOD (CLIP, PowerCLIP-R, PowerCLIP-S, PowerCLIP) beside row LABEL, in columns 'paper: ..'")
    cb = sub.add_parser('clip-benchmark', help="clip_benchmark's own CLI (eval/build) with the project's configs registered and no downloads")
    cb.add_argument('args', nargs=argparse.REMAINDER, help="clip_benchmark's arguments, e.g. eval --dataset wds/cifar10 --dataset_root ROOT/{dataset_cleaned} ..")
    w = sub.add_parser('make-world', help="write the built-in world's benchmark folder (every task)")
    w.add_argument('out'); w.add_argument('--n-images', type=int, default=100); w.add_argument('--seed', type=int, default=0)
    t = sub.add_parser('table', help='side-by-side table of result JSONs')
    t.add_argument('results', nargs='+'); t.add_argument('--out', default=None, help='write OUT.md and OUT.csv')
    return p.parse_args(argv)

def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    a = parse_args(argv)
    if a.cmd == 'make-world':
        print(json.dumps(write_world_benchmark(a.out, a.n_images, WorldConfig(seed=a.seed)))); return 0
    if a.cmd == 'table':
        header, rows = results_table(a.results)
        md = render_table(header, rows)
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out + '.md').write_text(md); Path(a.out + '.csv').write_text(render_table(header, rows, 'csv'))
        print(md); return 0
    if a.cmd == 'clip-benchmark': return clip_benchmark_cli(a.args)
    if a.cmd == 'tables':
        files = [f for x in map(Path, a.results) for f in (sorted(x.rglob('*.json')) if x.is_dir() else [x])]
        paper = dict(x.split('=', 1) for x in a.paper)
        bad = {m for m in paper.values() if not any(m in t for t in PAPER.values())}
        if bad: print(f'unknown paper methods {sorted(bad)}; known: CLIP, PowerCLIP-R, PowerCLIP-S, PowerCLIP', file=sys.stderr); return 2
        tables = paper_tables(files, paper)
        if not tables: print(f'no result of a paper benchmark among {len(files)} files', file=sys.stderr); return 2
        if a.out: write_paper_tables(files, a.out, paper)
        for table, (header, rows) in tables.items(): print(f'### {table}\n\n' + render_table(header, rows))
        return 0
    kw = dict(model_kwargs=a.model_kwargs, method=a.method, batch_size=a.batch_size, progress=not a.no_progress,
              precision=a.precision, workers=a.workers)
    cmd = shlex.join(['powerclip-eval', *(sys.argv[1:] if argv is None else argv)])
    cache = None if a.cache == 'none' else a.cache
    if a.cmd == 'suite':
        try:
            names = select(a.benchmarks)
            if a.benchmarks != ['all']:            # named: fail fast, before the model loads
                for n in names:
                    b, r = BENCHMARKS[n], Path(a.root) / BENCHMARKS[n].folder
                    if 'zeroshot' in b.tasks and not (r / 'test' / 'nshards.txt').is_file() and not (b.marker and (r / b.marker).exists()):
                        raise _missing(b, r)
            ev = Evaluator.build(a.model, a.checkpoint, cache, a.seed, a.device, **kw)
            written, skipped = run_suite(ev, a.root, names, a.out, a.label, a.checkpoint, strict=a.benchmarks != ['all'], command=cmd)
        except MissingData as e: print(f'missing data: {e}', file=sys.stderr); return 2
        except ValueError as e: print(f'error: {e}', file=sys.stderr); return 2
        print(json.dumps(dict(results={k: str(v) for k, v in written.items()}, skipped=skipped), indent=1))
        return 0 if written else 2
    tasks = list(TASKS) if a.tasks == ['all'] else a.tasks
    bad = set(tasks) - set(TASKS)
    if bad: print(f'unknown tasks {sorted(bad)}; known: {TASKS}', file=sys.stderr); return 2
    try:
        found = find_data(a.data, tasks, a.images, strict=a.tasks != ['all'])   # before the model: fail fast
        if not found[0]: print(f'no task found its data under {a.data}: {found[1]}', file=sys.stderr); return 2
        ev = Evaluator.build(a.model, a.checkpoint, cache, a.seed, a.device, **kw)
        by, skipped = evaluate_scorers(ev, a.data, found=found)
    except MissingData as e:
        print(f'missing data: {e}', file=sys.stderr); return 2
    except ValueError as e:     # no model name, a checkpoint that does not fit, an unknown method, non-finite features
        print(f'error: {e}', file=sys.stderr); return 2
    f = write_scored(a.out, ev, by, skipped, checkpoint=a.checkpoint, data_root=a.data, name=a.name, label=a.label, command=cmd)
    log.info('features: %d cache hits, %d computed', ev.cache.hits, ev.cache.misses)
    print(json.dumps(dict(result=str(f), scorer=ev.headline, metrics=by[ev.headline], skipped=list(skipped)), indent=1))
    return 0


# %% [markdown]
# A FILIP run folder on a small world folder: the run's config names the method, the result holds the late scores
# as its metrics and the global ones beside them, and the side-by-side table shows both. A missing data folder is one
# line and exit code 2.

# %%
from powerclip.model import create_model
tmp = Path(tempfile.mkdtemp())
(tmp / 'filip').mkdir()
torch.manual_seed(0); torch.save(create_model('powerclip-micro')[0].state_dict(), tmp / 'filip' / 'model.pt')
(tmp / 'filip' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\nmethod: filip\nmethod_cfg: {}\n')
with redirect_stdout(StringIO()):
    test_eq(main(['make-world', str(tmp / 'world'), '--n-images', '16']), 0)
    test_eq(main(['run', '--checkpoint', str(tmp / 'filip'), '--data', str(tmp / 'world'), '--tasks', 'retrieval', 'winoground',
                  '--out', str(tmp / 'res'), '--cache', 'none', '--no-progress', '--label', 'FILIP']), 0)
res = json.loads((tmp / 'res' / 'FILIP' / 'world.json').read_text())
test_eq((res['method'], res['scorer'], sorted(res['metrics']), sorted(res['other_scorers']['global'])),
        ('filip', 'late', ['retrieval', 'winoground'], ['retrieval', 'winoground']))
_out = StringIO()
with redirect_stdout(_out): test_eq(main(['table', str(tmp / 'res')]), 0)
assert '| world | retrieval [global] | i2t_R@1 |' in _out.getvalue()
test_eq(main(['run', '--model', 'powerclip-micro', '--data', str(tmp / 'nothing'), '--tasks', 'retrieval', '--cache', 'none']), 2)
