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

from powerclip.checkpoint import LAYOUTS as CHECKPOINT_LAYOUTS
from powerclip.commandline import ArgumentParser, UsageError, check_device, check_number, run_main, usage_errors
from powerclip.eval.benchmarks import BENCHMARKS, _missing, clip_benchmark_cli, select
from powerclip.eval.data import WorldFolderTaken, write_world_benchmark
from powerclip.eval.items import BadData, MissingData
from powerclip.eval.models import CheckpointError, Evaluator, NonFiniteFeatures, checkpoint_file
from powerclip.eval.region_data import VOCABULARIES
from powerclip.eval.tables import PAPER, paper_tables, render_table, results_table, write_paper_tables
from powerclip.eval.tasks import TASKS, evaluate_scorers, find_data, run_suite, skip_report, write_scored
from powerclip.world import WorldConfig

log = logging.getLogger(__name__)

# %%
#| hide
import contextlib
import tempfile
from contextlib import redirect_stdout
from io import StringIO
from fastcore.test import test_eq, test_fail


# %% [markdown]
# # The evaluation command line
#
# > `powerclip-eval` (or `python -m powerclip.eval`): one command line for all of the evaluation.
#
# One checkpoint on one data folder, the paper's suite, the world's benchmark folder, tables, and clip_benchmark's own
# CLI.

# %% [markdown]
# ```
# powerclip-eval run [--model powerclip-tiny] [--checkpoint run/ | ckpt.pt] [--method filip] --data ../shared/data/coco_sample \
#     [--tasks retrieval sugarcrepe | all] [--out results/eval] [--cache ~/.cache/powerclip/features] [--strict] \
#     [--vocab all | ovcoco]                              # the region task's classes (61a_eval_region_data)
# powerclip-eval make-world /tmp/world --n-images 100     # the built-in world's benchmark folder (every task)
# powerclip-eval table results/eval/*/*.json --out results/eval/table   # table.md and table.csv
# powerclip-eval suite --model ViT-B-16 --checkpoint run/model.pt --root ~/benchmarks [--benchmarks table1 table3 | cifar10 ..] \
#     [--device cuda --precision bf16 --workers 8]       # the paper's benchmarks found under ROOT/<data set>/
# powerclip-eval tables results/eval --out results/eval/tables [--paper powerclip-s=PowerCLIP-S]   # Tables 1-5, 9
# powerclip-eval clip-benchmark eval --dataset ... --model powerclip-tiny --pretrained run/model.pt --output 'res/{dataset}.json'
# ```
# `python -m powerclip.eval` is the same (`66a_eval_main`). A checkpoint is a file, a run folder, ours or open_clip's,
# or an open_clip release folder (`62_eval_models`): what the checkpoint records (its config, open_clip's
# `params.txt` or `open_clip_config.json`) names the architecture, its pooling and the method, whose scorers are all
# computed (`--model`, `--pool`, `--method` override them). Results go to `OUT/<label>/<data set>.json`, the label
# being the run's name unless `--label` says otherwise, and never one that another checkpoint's results hold
# (`64_eval_tasks`).
#
# **Mistakes are one line** (`17_commandline`): `powerclip-eval: error: <argument>: <what is wrong> (<what is allowed>)` on
# stderr, exit status 2, found before any model is built: an unknown subcommand or flag, a `--data` or `--root` that
# does not exist or holds no known layout, a `--checkpoint` that does not exist, an unknown `--method`, `--model`,
# task or benchmark, an `--out` that is a file, a `--device` that is not there (`mps` on a machine without it too),
# `--paper` without `=`, a `make-world` folder that is not empty and holds another world or other files (the same
# world again is left as it is: nothing to do); a task named in `--tasks` whose data is absent (with `--tasks all` it
# is skipped and recorded). A checkpoint that cannot be scored stops the same way once it is read (weights that do not
# fit, named by the first tensor whose size differs, in the checkpoint and in the model; non-finite weights:
# `62_eval_models`), and so does
# one whose features or scores turn out non-finite; no result is written then. With `--strict` the first bad item of
# a data folder (a missing or undecodable image, a bad caption: `61_eval_data`) stops the same way, naming the file;
# without it such items are skipped and recorded in the result (`skipped_items`). `--debug` (or `POWERCLIP_DEBUG=1`)
# shows the traceback of any of these.

# %%
#| export
def _int_at_least(lo: int):
    "An argparse type: an integer of at least `lo` (`check_number`), else one line saying what was expected."
    def parse(s: str) -> int:
        try:
            n = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f'{s!r} is not an integer') from None
        try:
            return check_number('value', n, lo, integer=True)
        except ValueError:
            raise argparse.ArgumentTypeError(f'{n} (an integer >= {lo})') from None
    return parse

_positive = _int_at_least(1)
_nonnegative = _int_at_least(0)

def _json_dict(s: str) -> dict:
    try:
        d = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f'not JSON ({e})') from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError('a JSON object {..} of open_clip model kwargs')
    return d

def _model_args(r):
    "The options of `run` and `suite` that pick the checkpoint and how to run it."
    r.add_argument('--model', default=None, help="architecture: 'powerclip-tiny', 'powerclip-micro', 'ViT-B-16', .. "
                   "(default: the one the checkpoint's config, params.txt or open_clip_config.json names)")
    r.add_argument('--model-kwargs', default=None, type=_json_dict, help='JSON open_clip '
                                                                         'model_kwargs overriding the config')
    r.add_argument('--pool', default=None, choices=('tok', 'avg', 'map'), help="pooling of both towers: 'tok' class "
                   "token / EOT, 'avg' mean of the patch and caption tokens, 'map' the trained MAP head (default: the "
                   "one the checkpoint was trained with, else the architecture's)")
    r.add_argument('--checkpoint', default=None, help='checkpoint file, run folder (ours or open_clip\'s logs/NAME: '
                   'its latest epoch_N.pt) or open_clip release folder; omitted = random init (tests)')
    r.add_argument('--method', default=None, help="training method whose scorers to use, e.g. 'filip' (default: the "
                   "one the run's config names; none known: the global cosine)")
    r.add_argument('--label', default=None, help="the result's column label (default: the run folder's name, else the "
                   "checkpoint file's stem; another checkpoint's label gets '-<sha8>' appended)")
    r.add_argument('--out', default='results/eval', help='folder for the result JSONs, OUT/<label>/<data set>.json')
    r.add_argument('--cache', default=str(Path.home() / '.cache' / 'powerclip' / 'features'),
                   help="feature cache; 'none' disables")
    r.add_argument('--seed', type=int, default=0, help='random-init seed when no checkpoint is given')
    r.add_argument('--batch-size', type=_positive, default=64)
    r.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    r.add_argument('--precision', choices=('fp32', 'bf16'), default='fp32', help='bf16: torch.autocast in '
                                                                                 'bfloat16 (features cached apart)')
    r.add_argument('--workers', type=_nonnegative, default=0, help='DataLoader workers for clip_benchmark data sets')
    r.add_argument('--strict', action='store_true', help='stop at the first bad item (missing or undecodable image, '
                   'bad caption; for regions only a broken annotation: bad polygon or RLE, degenerate, bad box) '
                   'instead of skipping and counting it')
    r.add_argument('--no-progress', action='store_true')

def parse_args(argv=None):
    common = ArgumentParser(add_help=False)
    common.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    p = ArgumentParser(prog='powerclip-eval', description='Evaluate an open_clip checkpoint '
                                                          'on local benchmark files.', parents=[common])
    sub = p.add_subparsers(dest='cmd', required=True)
    r = sub.add_parser('run', help='evaluate one checkpoint on one data root', parents=[common])
    _model_args(r)
    r.add_argument('--data', required=True, help='data root (coco_sample, a world folder, a SugarCrepe or Winoground '
                                                 'folder, a webdataset export)')
    r.add_argument('--images', default=None, help='image folder when it is not DATA/images (e.g. '
                                                  'COCO val2017 for SugarCrepe)')
    r.add_argument('--tasks', nargs='+', default=['all'], help=f"some of {' '.join(TASKS)}, or all")
    r.add_argument('--name', default=None, help='data set name in the results (default: the data folder name)')
    r.add_argument('--vocab', default='all', choices=VOCABULARIES, help="the region task's classes: 'all' (every "
                   "category of the instances file) or 'ovcoco' (OV-COCO's 48 base + 17 novel, its generalized "
                   "setting)")
    s = sub.add_parser('suite', help="one checkpoint on the paper's benchmarks under a root "
                                     "(one folder per data set)", parents=[common])
    _model_args(s)
    s.add_argument('--root', required=True, help="benchmark root: ROOT/<clip_benchmark name, '/' as '-'>/, e.g. "
                                                 "ROOT/cifar10, ROOT/vtab-resisc45")
    s.add_argument('--benchmarks', nargs='+', default=['all'], help='data set names, table ids (table1 .. table5, '
                   'table9) or all; naming some makes an absent one an error')
    tb = sub.add_parser('tables', help="the paper's Tables 1-5 and 9 from result JSONs (Markdown and CSV)",
                        parents=[common])
    tb.add_argument('results', nargs='+', help='result JSONs or folders holding them')
    tb.add_argument('--out', default=None, help='folder for table1.md, table1.csv, ..')
    tb.add_argument('--paper', nargs='*', default=[], metavar='LABEL=METHOD',
                    help="add the paper's reported numbers of METHOD (CLIP, PowerCLIP-R, PowerCLIP-S, PowerCLIP) "
                         "beside row LABEL, in columns 'paper: ..'")
    cb = sub.add_parser('clip-benchmark', help="clip_benchmark's own CLI (eval/build) with the project's configs "
                                               "registered and no downloads")
    cb.add_argument('args', nargs=argparse.REMAINDER, help="clip_benchmark's arguments, e.g. eval --dataset "
                                                           "wds/cifar10 --dataset_root ROOT/{dataset_cleaned} ..")
    w = sub.add_parser('make-world', help="write the built-in world's benchmark folder (every task)", parents=[common])
    w.add_argument('out')
    w.add_argument('--n-images', type=_positive, default=100)
    w.add_argument('--seed', type=_nonnegative, default=0)   # numpy's seeds are non-negative: one line, not theirs
    t = sub.add_parser('table', help='side-by-side table of result JSONs', parents=[common])
    t.add_argument('results', nargs='+')
    t.add_argument('--out', default=None, help='write OUT.md and OUT.csv')
    return p.parse_args(argv)


# %% [markdown]
# ### Validation
#
# Everything a user typed is checked here, before any model is built.

# %%
#| export
LAYOUTS = ('retrieval.json, captions.jsonl or dataset_*.json (retrieval); data/<category>.json (SugarCrepe); '
           'classification.json or train|val|test/<class>/ folders (zero-shot, probe); test/nshards.txt (webdataset); '
           'data/examples.jsonl (Winoground)')

def _folder_arg(flag: str, path, what: str):
    "An output folder: it may not exist yet, but it may not be a file."
    if path is not None and Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f'{flag}: {path} is a file ({what})')

def _check_model_args(a):
    "The checkpoint, architecture, method, label, folders and device of `run` / `suite`."
    if a.checkpoint is not None:
        if not Path(a.checkpoint).exists():
            raise UsageError(f'--checkpoint: {a.checkpoint} does not exist (a checkpoint file, or a folder holding '
                             f'{CHECKPOINT_LAYOUTS})')
        try:
            checkpoint_file(a.checkpoint)
        except MissingData as e:
            raise UsageError(f'--checkpoint: {e}') from None
    if a.model is not None:
        import open_clip
        from powerclip.model import register_configs
        register_configs()
        if a.model not in open_clip.list_models():
            raise UsageError(f"--model: unknown architecture {a.model!r} (an open_clip config, e.g. ViT-B-16, or ours: "
                             "powerclip-micro, powerclip-tiny)")
    if a.method is not None:
        from powerclip.methods import get_method
        try:
            get_method(a.method)
        except KeyError as e:
            raise UsageError(f'--method: {e.args[0]}') from None
    if a.label is not None and (not a.label.strip() or '/' in a.label or a.label in ('.', '..')):
        raise UsageError(f'--label: {a.label!r} is not a folder name (no "/", not empty)')
    _folder_arg('--out', a.out, 'a folder for the result JSONs')
    if a.cache != 'none':
        _folder_arg('--cache', a.cache, "a folder for the feature cache, or 'none'")
    check_device('--device', a.device)     # inside usage_errors(): its ValueError is the one line

def _check_paths(flag: str, paths: list, what: str):
    missing = [x for x in paths if not Path(x).exists()]
    if missing:
        raise UsageError(f'{flag}: {missing[0]} does not exist ({what})')


# %% [markdown]
# ### The commands

# %%
#| export
def _make_evaluator(a) -> Evaluator:
    "The checkpoint loaded (a checkpoint that cannot be scored is the user's: one line)."
    kw = dict(model_kwargs=a.model_kwargs, method=a.method, pool=a.pool, batch_size=a.batch_size,
              progress=not a.no_progress, precision=a.precision, workers=a.workers)
    try:
        return Evaluator.build(a.model, a.checkpoint, None if a.cache == 'none' else a.cache, a.seed, a.device, **kw)
    except CheckpointError as e:
        raise UsageError(f"{'--checkpoint' if a.checkpoint else '--model'}: {e}") from e

NO_IMAGE_ROOT = ('zeroshot', 'linear_probe', 'winoground')   # loaders that never read --images

def _check_images_used(a, found: dict):
    """`--images` where it would be silently ignored is refused: `captions.jsonl` data always reads DATA/images, and
    the classification and Winoground loaders have their own image folders."""
    if a.images is None:
        return
    if 'retrieval' in found and (Path(a.data) / 'captions.jsonl').is_file():
        raise UsageError(f'--images: {a.data}/captions.jsonl reads its photos from {a.data}/images, never from '
                         f'--images; drop --images (or name --tasks that use it: sugarcrepe, regions)')
    if all(t in NO_IMAGE_ROOT for t in found):
        raise UsageError(f'--images: not used by {", ".join(found)} (they read their own image folders); drop it')

def _cmd_run(a, cmd: str) -> int:
    with usage_errors():
        _check_model_args(a)
        if not Path(a.data).exists():
            raise UsageError(f'--data: {a.data} does not exist (a data folder: {LAYOUTS})')
        if a.images is not None and not Path(a.images).is_dir():
            raise UsageError(f'--images: {a.images} is not a folder')
        if a.name is not None and (not a.name.strip() or '/' in a.name):
            raise UsageError(f'--name: {a.name!r} is not a file name')
        tasks = list(TASKS) if a.tasks == ['all'] else a.tasks
        bad = [t for t in tasks if t not in TASKS]
        if bad:
            raise UsageError(f'--tasks: unknown task {bad[0]!r} ({", ".join(TASKS)}, or all)')
        try:
            # before the model: fail fast
            found = find_data(a.data, tasks, a.images, require=a.tasks != ['all'], strict=a.strict,
                              options=dict(vocabulary=a.vocab))
        except (MissingData, BadData) as e:
            raise UsageError(f'--data: {e}') from None
        if not found[0]:
            raise UsageError(f'--data: {a.data} holds no data set in a known layout ({LAYOUTS})')
        _check_images_used(a, found[0])
    for task, why in found[1].items():
        log.warning('%s skipped: %s', task, why)
    ev = _make_evaluator(a)
    with usage_errors(NonFiniteFeatures, BadData, MissingData):
        by, skipped = evaluate_scorers(ev, a.data, found=found)
    items = skip_report(found[0])
    f = write_scored(a.out, ev, by, skipped, checkpoint=a.checkpoint, data_root=a.data, name=a.name, label=a.label,
                     command=cmd, skipped_items=items)
    log.info('features: %d cache hits, %d computed', ev.cache.hits, ev.cache.misses)
    print(json.dumps(dict(result=str(f), label=f.parent.name, scorer=ev.headline, metrics=by[ev.headline],
                          skipped=list(skipped), skipped_items={t: r['counts'] for t, r in items.items()}), indent=1))
    return 0

def _cmd_suite(a, cmd: str) -> int:
    with usage_errors():
        _check_model_args(a)
        if not Path(a.root).is_dir():
            raise UsageError(f'--root: {a.root} is not a folder (a benchmark root, ROOT/<data set>/)')
        try:
            names = select(a.benchmarks)
        except ValueError as e:
            raise UsageError(f'--benchmarks: {e}') from None
        if a.benchmarks != ['all']:            # named: fail fast, before the model loads
            for n in names:
                b, r = BENCHMARKS[n], Path(a.root) / BENCHMARKS[n].folder
                if ('zeroshot' in b.tasks and not (r / 'test' / 'nshards.txt').is_file()
                    and not (b.marker and (r / b.marker).exists())):
                    raise UsageError(f'--benchmarks: {_missing(b, r)}')
        elif not any((Path(a.root) / BENCHMARKS[n].folder).is_dir() for n in names):
            raise UsageError(f'--root: no benchmark folder under {a.root} (ROOT/<data set>/: '
                             f'{", ".join(BENCHMARKS[n].folder for n in names[:6])}, ..)')
    ev = _make_evaluator(a)
    with usage_errors(NonFiniteFeatures, BadData, MissingData):
        written, skipped = run_suite(ev, a.root, names, a.out, a.label, a.checkpoint, require=a.benchmarks != ['all'],
                                     command=cmd, strict=a.strict)
    if not written:
        raise UsageError(f'--root: none of the benchmarks was found under {a.root}: {skipped}')
    print(json.dumps(dict(results={k: str(v) for k, v in written.items()}, skipped=skipped), indent=1))
    return 0

def _cmd_tables(a) -> int:
    with usage_errors():
        _check_paths('results', a.results, 'result JSONs or folders of them')
        _folder_arg('--out', a.out, 'a folder for the tables')
        bad = [x for x in a.paper if '=' not in x or not all(x.split('=', 1))]
        if bad:
            raise UsageError(f'--paper: {bad[0]!r} is not LABEL=METHOD')
        paper = dict(x.split('=', 1) for x in a.paper)
        bad = sorted({m for m in paper.values() if not any(m in t for t in PAPER.values())})
        if bad:
            raise UsageError(f'--paper: unknown paper method {bad[0]!r} (CLIP, PowerCLIP-R, PowerCLIP-S, PowerCLIP)')
        files = [f for x in map(Path, a.results) for f in (sorted(x.rglob('*.json')) if x.is_dir() else [x])]
        tables = paper_tables(files, paper)
        if not tables:
            raise UsageError(f'results: no result of a paper benchmark among {len(files)} files')
    if a.out:
        write_paper_tables(files, a.out, paper)
    for table, (header, rows) in tables.items():
        print(f'### {table}\n\n' + render_table(header, rows))
    return 0

def _cmd_table(a) -> int:
    with usage_errors():
        _check_paths('results', a.results, 'result JSONs or folders of them')
        if a.out and Path(a.out).is_dir():
            raise UsageError(f'--out: {a.out} is a folder (a file stem: OUT.md and OUT.csv are written)')
        header, rows = results_table(a.results)
        if not rows:
            raise UsageError(f'results: no result JSON with metrics among {a.results}')
    md = render_table(header, rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out + '.md').write_text(md)
        Path(a.out + '.csv').write_text(render_table(header, rows, 'csv'))
    print(md)
    return 0

def _main(argv: list) -> int:
    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    with usage_errors():
        a = parse_args(argv)
    if a.cmd == 'clip-benchmark':
        return clip_benchmark_cli([x for x in a.args if x != '--debug'])
    if a.cmd == 'make-world':
        with usage_errors():
            _folder_arg('out', a.out, 'a folder for the world benchmark')
        try:      # the same world again: nothing to do; anything else in the folder: one line, nothing touched
            summary = write_world_benchmark(a.out, a.n_images, WorldConfig(seed=a.seed), replace=False)
        except WorldFolderTaken as e:
            raise UsageError(f'out: {e}') from None
        print(json.dumps(summary))
        return 0
    if a.cmd == 'table':
        return _cmd_table(a)
    if a.cmd == 'tables':
        return _cmd_tables(a)
    cmd = shlex.join(['powerclip-eval', *argv])
    return _cmd_run(a, cmd) if a.cmd == 'run' else _cmd_suite(a, cmd)

def main(argv=None) -> int:
    """`powerclip-eval`: `run_main` of the subcommands (a mistake: one line on stderr, exit status 2; `--debug`: the
    traceback)."""
    return run_main(_main, sys.argv[1:] if argv is None else list(argv), 'powerclip-eval')


# %% [markdown]
# A FILIP run folder on a small world folder: the run's config names the method, the result holds the late scores
# as its metrics and the global ones beside them, and the side-by-side table shows both. Mistakes are one line and
# exit code 2, before any model is built.

# %%
from powerclip.model import create_model
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
(tmp / 'filip').mkdir()
torch.manual_seed(0)
torch.save(create_model('powerclip-micro')[0].state_dict(), tmp / 'filip' / 'model.pt')
(tmp / 'filip' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: '
                                           '{}\nmethod: filip\nmethod_cfg: {}\n')
with redirect_stdout(StringIO()):
    test_eq(main(['make-world', str(tmp / 'world'), '--n-images', '16']), 0)
    test_eq(main(['make-world', str(tmp / 'world'), '--n-images', '16']), 0)        # the same world: nothing to do
    test_eq(main(['run', '--checkpoint', str(tmp / 'filip'), '--data', str(tmp / 'world'), '--tasks', 'retrieval',
                  'winoground', '--out', str(tmp / 'res'), '--cache', 'none', '--no-progress']), 0)
res = json.loads((tmp / 'res' / 'filip' / 'world.json').read_text())
test_eq((res['label'], res['method'], res['scorer'], sorted(res['metrics']), sorted(res['other_scorers']['global'])),
        ('filip', 'filip', 'late', ['retrieval', 'winoground'], ['retrieval', 'winoground']))
_out = StringIO()
with redirect_stdout(_out):
    test_eq(main(['table', str(tmp / 'res')]), 0)
assert '| world | retrieval [global] | i2t_R@1 |' in _out.getvalue()

def _err(argv):
    "Exit status and stderr of a call."
    err = StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()
for _argv, _says in [(['run', '--model', 'powerclip-micro', '--data', str(tmp / 'nothing')], '--data: '),
                     (['run', '--checkpoint', str(tmp / 'no.pt'), '--data', str(tmp / 'world')], '--checkpoint: '),
                     (['run', '--method', 'nosuch', '--data', str(tmp / 'world')], '--method: unknown method'),
                     (['run', '--data', str(tmp / 'world'), '--tasks', 'bogus'], "--tasks: unknown task 'bogus'"),
                     (['make-world', str(tmp / 'world'), '--n-images', '8'], 'out: ' + str(tmp / 'world') + ' holds '
                      'another world (n_images 16'),
                     (['make-world', str(tmp / 'filip')], 'holds files that are not a world folder'),
                     (['run', '--model', 'powerclip-micro', '--data', str(tmp / 'world'), '--device', 'mps'],
                      "--device: 'mps' is a device torch knows but this machine lacks"),
                     (['evaluate'], "invalid choice: 'evaluate'")]:
    _rc, _msg = _err(_argv)
    assert (_rc == 2 and _msg.startswith('powerclip-eval: error: ') and _msg.count('\n') == 1
            and _says in _msg), (_argv, _rc, _msg)
# --debug: the traceback
test_fail(lambda: main(['run', '--data', str(tmp / 'nothing'), '--debug']), contains='does not exist')

# %% [markdown]
# ## Evaluating a trained model
#
# The evaluation package is notebooks `60`-`66a`: metrics with one tie rule (`60_eval_metrics`), readers of benchmark
# folders and the world's benchmark writer (`61_eval_data`), the one model loader and the method's scorers
# (`62_eval_models`), the paper's benchmarks through clip_benchmark (`63_eval_benchmarks`), the tasks, the suite and
# the result files (`64_eval_tasks`), the tables (`65_eval_tables`), and this command line. The comparison, the
# heatmaps and `powerclip-eval` all go through it.
#
# **Where the data goes.** Nothing is downloaded. Put each data set under `ROOT/<clip_benchmark name>/` (for example
# `ROOT/cifar10`, `ROOT/vtab-resisc45`, `ROOT/imagenet-a`), in clip_benchmark's webdataset export (`test/nshards.txt`,
# `test/*.tar`, `classnames.txt`, `zeroshot_classification_templates.txt`) or in the raw layout its builders read
# (`63_eval_benchmarks`). Retrieval needs Karpathy's test splits: `mscoco_captions/coco_test_karpathy.json` with
# `val2014/`, or `dataset_coco.json` with `images/`; `flickr8k/flickr8k_test_karpathy.txt` with the photos beside it.
# SugarCrepe goes in `sugar_crepe/{add_att,...,swap_obj}.json` with `sugar_crepe/val2017/`; Winoground in
# `winoground/data/examples.jsonl` with `winoground/data/images/`. A data set that is missing stops with a message
# naming the files to put where.
#
# ```bash
# powerclip-eval suite --checkpoint runs/paper --root ROOT --label powerclip-r --device cuda --precision bf16 \
#     --workers 8
# powerclip-eval tables results/eval --out results/eval/tables --paper powerclip-r=PowerCLIP-R   # Tables 1-5, 9
# powerclip-eval run --checkpoint runs/demo/seed0/CLIP --data ../shared/data/coco_sample   # model, method from config
# powerclip-eval make-world runs/eval_world --n-images 200
# powerclip-eval run --checkpoint runs/compare/seed0/FILIP --data runs/eval_world
# powerclip-eval table results/eval --out results/eval/table                       # side by side, every scorer
# ```
#
# `make eval-compare` runs every task type on the seed-0 runs of the comparison (`70_compare`): the real COCO sample
# (retrieval, SugarCrepe; it needs `../shared/data`) and a held-out world folder (retrieval, hard negatives,
# zero-shot, linear probe, Winoground), with the tables side by side in `runs/eval/`.

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
