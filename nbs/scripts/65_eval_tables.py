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
#| default_exp eval.tables

# %%
#| export
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from powerclip.eval.benchmarks import BENCHMARKS, ROBUSTNESS, TABLE1
from powerclip.eval.data import SUGARCREPE
from powerclip.eval.tasks import TASKS

# %%
#| hide
import tempfile
from fastcore.test import test_close, test_eq


# %% [markdown]
# # Result tables
#
# > Result JSONs of any number of checkpoints side by side, and laid out as the paper's tables.
#
# One row per data set, task, metric and scorer; the paper's Tables 1-5 and 9; as Markdown and CSV.

# %% [markdown]
# ## Side by side
#
# `results_table` reads any number of result JSONs (`64_eval_tasks`' `write_result`; a folder gives every JSON under
# it) and lays out one row per (data set, task, metric) and one column per checkpoint label. A checkpoint scored in
# several ways (FILIP: late interaction, then global) has its headline scorer's numbers in the rows of the task
# and the others' in rows whose task is suffixed with the scorer, `retrieval [global]`. The metrics of a task are the
# `headline` of its record in the task registry (`64_eval_tasks`), in that order. A task scored in a named vocabulary
# (the region task's `vocabulary`, `--vocab`) says so in its rows, `regions (vocab ovcoco)`: numbers of OV-COCO's 65
# classes and of COCO's 80 are different tasks, so they stand in different rows and never side by side as one
# comparison. `render_table` writes Markdown or CSV.

# %%
#| export
def results_table(paths) -> tuple[list[str], list[list]]:
    "`(header, rows)`: one row per (data set, task, metric), one column per checkpoint label; a folder gives its JSONs."
    files = [q for p in paths for q in (sorted(Path(p).rglob('*.json')) if Path(p).is_dir() else [Path(p)])]
    res = [r for r in (json.loads(q.read_text()) for q in files) if isinstance(r, dict) and 'metrics' in r
           and 'label' in r]
    labels = list(dict.fromkeys(r['label'] for r in res))
    cells = {}
    for r in res:
        scored = [('', r['metrics'])] + [(f' [{s}]', m) for s, m in (r.get('other_scorers') or {}).items()]
        for suffix, metrics in scored:
            for task, m in metrics.items():
                vocab = f" (vocab {m['vocabulary']})" if isinstance(m, dict) and 'vocabulary' in m else ''
                for k in (TASKS[task].headline if task in TASKS else ()):
                    if k in m:
                        cells[(r['dataset'], task + vocab + suffix, k, r['label'])] = m[k]
    keys = list(dict.fromkeys((d, t, k) for d, t, k, _ in cells))
    return ['dataset', 'task', 'metric', *labels], [[*key, *(cells.get((*key, l)) for l in labels)] for key in keys]

def render_table(header: list, rows: list, fmt: str = 'md') -> str:
    "Markdown (`fmt='md'`) or CSV of a header and rows; floats with one decimal, None as an empty cell."
    cell = lambda v: '' if v is None else f'{v:.1f}' if isinstance(v, float) else str(v)
    if fmt == 'csv':
        s = io.StringIO()
        w = csv.writer(s)
        w.writerow(header)
        w.writerows([[cell(v) for v in r] for r in rows])
        return s.getvalue()
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    return '\n'.join(lines + ['| ' + ' | '.join(cell(v) for v in r) + ' |' for r in rows]) + '\n'


# %%
from powerclip.eval.tasks import write_result
_scratch = tempfile.TemporaryDirectory(prefix="powerclip-nb-")  # holds every scratch folder below; see the last cell
tmp = Path(tempfile.mkdtemp(dir=_scratch.name))
_m = dict(retrieval={'i2t_R@1': 10.0, 't2i_R@1': 20.0, 'n_images': 5},
          winoground=dict(text=25.0, image=0.0, group=0.0, n=4))
f1 = write_result(tmp / 'results', _m, {}, model='powerclip-micro', checkpoint=None, ckpt_id='random-init-x',
                  data_root=tmp / 'world', command='notebook')
f2 = write_result(tmp / 'results', _m, {}, model='powerclip-micro', checkpoint=tmp / 'filip.pt', ckpt_id='abc',
                  data_root=tmp / 'world',
                  label='filip', command='notebook', method='filip', scorer='late',
                  other_scorers={'global': dict(retrieval={'i2t_R@1': 5.0})})
test_eq(json.loads(f1.read_text())['sha256'], 'random-init')
header, rows = results_table([tmp / 'results'])
test_eq(header, ['dataset', 'task', 'metric', 'filip', 'random-init'])
test_eq(rows[:2], [['world', 'retrieval', 'i2t_R@1', 10.0, 10.0], ['world', 'retrieval', 't2i_R@1', 20.0, 20.0]])
test_eq(rows[-1], ['world', 'retrieval [global]', 'i2t_R@1', 5.0, None])
print(render_table(header, rows))
test_eq(render_table(header, rows, 'csv').splitlines()[-1], 'world,retrieval [global],i2t_R@1,5.0,')
# region numbers name their vocabulary: OV-COCO's 65 classes and COCO's 80 in rows of their own
for _lab, _v in (('a', 'ovcoco'), ('b', 'all')):
    write_result(tmp / 'regions', dict(regions=dict(pooled_top1=5.0, chance_ap50_novel=2.0, vocabulary=_v)), {},
                 model='powerclip-micro', checkpoint=None, ckpt_id=_lab, data_root=tmp / 'coco', label=_lab,
                 command='notebook')
test_eq(results_table([tmp / 'regions'])[1],
        [['coco', 'regions (vocab ovcoco)', 'pooled_top1', 5.0, None],
         ['coco', 'regions (vocab ovcoco)', 'chance_ap50_novel', 2.0, None],
         ['coco', 'regions (vocab all)', 'pooled_top1', None, 5.0],
         ['coco', 'regions (vocab all)', 'chance_ap50_novel', None, 2.0]])

# %% [markdown]
# ## The paper's layouts
#
# `paper_tables` reads result JSONs (any number of checkpoints, one row each, labelled by `--label`; the headline
# scorer's numbers) and lays them out as the paper's Tables 1-5 and 9: Table 1 the 17 zero-shot top-1 accuracies and
# their mean; Table 2 image→text then text→image R@1/5/10 on MS-COCO, Flickr8K, Flickr30K and the means over the six settings; Table 3 the six
# ImageNet top-1 accuracies with ID (ImageNet-1k), OOD (mean of the other five) and All (mean of six); Table 4
# SugarCrepe's object / attribute / relation means (Obj = mean of add_obj, replace_obj, swap_obj; Att = mean of
# add_att, replace_att, swap_att; Rel = replace_rel) and the seven categories; Table 5 Winoground's text, image
# and group scores; Table 9 the linear-probe accuracies; Table 15 (the supplement's OV-COCO table) AP50 on the base
# and novel classes and on all, read from the region task (`63a_eval_regions`: AP50 with ground-truth boxes, pooled
# embeddings) of the first data folder named `ov_coco`, `coco`, `coco_sample` or `world` that has it. The paper's Table 15
# is a detector's AP50 and ours is not (`60_eval_metrics` says how they relate): its numbers stand in their own columns
# for the layout, not as a target. An average is given only when every number it averages
# is there. The paper's numbers (`PAPER`, copied from the main paper's tables for its CLIP and PowerCLIP rows) are
# never mixed into measured cells: `paper={label: method}` adds separate columns headed `paper: <column>`.
# Each table is one function of `PAPER_LAYOUTS`, which reads the metrics it needs by data set, task and metric.

# %%
#| export
SUGARCREPE_GROUPS = dict(Obj=('add_obj', 'replace_obj', 'swap_obj'), Att=('add_att', 'replace_att', 'swap_att'),
                         Rel=('replace_rel',))
_RET = [(d, k) for d in ('mscoco_captions', 'flickr8k', 'flickr30k') for k in (1, 5, 10)]

def _mean(xs): return None if not xs or any(x is None for x in xs) else float(np.mean(xs))

def _table1(get) -> tuple[list[str], list]:
    cells = [get(BENCHMARKS[n].folder, 'zeroshot', 'top1') for n in TABLE1]
    return [BENCHMARKS[n].column for n in TABLE1] + ['Avg'], cells + [_mean(cells)]

def _table2(get) -> tuple[list[str], list]:
    i2t = [get(d, 'retrieval', f'i2t_R@{k}') for d, k in _RET]
    t2i = [get(d, 'retrieval', f't2i_R@{k}') for d, k in _RET]
    avg = [_mean([c for (d, kk), c in zip(_RET * 2, i2t + t2i) if kk == k]) for k in (1, 5, 10)]
    head = ([f'I2T {BENCHMARKS[d].column} R@{k}' for d, k in _RET]
            + [f'T2I {BENCHMARKS[d].column} R@{k}' for d, k in _RET])
    return head + ['Avg R@1', 'Avg R@5', 'Avg R@10'], i2t + t2i + avg

def _table3(get) -> tuple[list[str], list]:
    cells = [get(BENCHMARKS[n].folder, 'zeroshot', 'top1') for n in ROBUSTNESS]
    return ([BENCHMARKS[n].column for n in ROBUSTNESS] + ['IN', 'OOD', 'All'],
            cells + [cells[0], _mean(cells[1:]), _mean(cells)])

def _table4(get) -> tuple[list[str], list]:
    cats = [get('sugar_crepe', 'sugarcrepe', c) for c in SUGARCREPE]
    val = dict(zip(SUGARCREPE, cats))
    return (list(SUGARCREPE_GROUPS) + list(SUGARCREPE),
            [_mean([val[c] for c in cs]) for cs in SUGARCREPE_GROUPS.values()] + cats)

def _table5(get) -> tuple[list[str], list]:
    return ['Text', 'Image', 'Group'], [get('winoground', 'winoground', k) for k in ('text', 'image', 'group')]

def _table9(get) -> tuple[list[str], list]:
    return ['CF10', 'CF100', 'IN1k'], [get(n, 'linear_probe', 'acc') for n in ('cifar10', 'cifar100', 'imagenet1k')]

# the paper's tables, each a function of `get(data set folder, task, metric)` -> (header, cells of one checkpoint)
REGION_FOLDERS = ('ov_coco', 'coco', 'coco_sample', 'world')   # where Table 15 looks for the region task, in this order

def _table15(get) -> tuple[list[str], list]:
    "OV-COCO's AP50 on base and novel classes and all: here the region task's AP50 with ground-truth boxes, pooled."
    d = next((d for d in REGION_FOLDERS if get(d, 'regions', 'pooled_ap50') is not None), REGION_FOLDERS[0])
    return ['AP50 base', 'AP50 novel', 'AP50'], [get(d, 'regions', f'pooled_ap50{g}') for g in ('_base', '_novel', '')]

PAPER_LAYOUTS = dict(table1=_table1, table2=_table2, table3=_table3, table4=_table4, table5=_table5, table9=_table9,
                     table15=_table15)

def _table_row(table: str, by: dict) -> tuple[list[str], list]:
    "Header and cells of one checkpoint; `by` maps data set folder -> metrics dict."
    if table not in PAPER_LAYOUTS:
        raise ValueError(f'unknown table {table!r}')
    return PAPER_LAYOUTS[table](lambda d, task, k: (by.get(d) or {}).get(task, {}).get(k))

PAPER_TABLES = tuple(PAPER_LAYOUTS)
PAPER_SOURCE = ('PowerCLIP main paper (papers/000_*), Tables 1-5 and 9, and its supplement (papers/001_*), Table 15 (a '
                'detector trained on OV-COCO, where the measured columns are AP50 with ground-truth boxes): numbers as '
                'reported, for comparison only')
PAPER = {   # method -> numbers in the column order of `PAPER_LAYOUTS` (Table 4: Obj, Att, Rel only; Table 9:
            # 'PowerCLIP' is the paper's single row)
    'table1': {'CLIP': [42.3, 57.7, 25.0, 44.1, 17.0, 50.5, 1.7, 16.5, 53.9, 73.5, 26.0, 82.0, 18.7, 26.5, 9.4,
                        4.5, 48.0, 35.1],
               'PowerCLIP-R': [50.3, 74.7, 43.5, 48.7, 22.9, 53.2, 2.9, 21.5, 58.7, 75.7, 32.4, 88.4, 30.8, 37.5, 9.8,
                               4.6, 50.0, 41.5],
               'PowerCLIP-S': [51.2, 81.3, 40.1, 50.5, 23.5, 56.0, 1.6, 21.3, 61.0, 72.9, 32.5, 90.5, 29.0, 33.9, 7.8,
                               5.4, 59.7, 42.2]},
    'table2': {'CLIP': [34.6, 62.0, 72.7, 55.7, 81.6, 89.9, 58.5, 83.8, 89.1, 23.5, 47.8, 59.7, 40.5, 68.9, 80.2, 43.2,
                        70.4, 80.4, 42.7, 69.1, 78.7],
               'PowerCLIP-R': [36.7, 64.0, 75.0, 58.5, 84.8, 91.4, 61.7, 84.8, 91.9, 26.3, 51.1, 62.7, 44.8, 72.7, 82.4,
                               46.6, 74.3, 82.7, 45.8, 72.0, 81.0],
               'PowerCLIP-S': [37.3, 64.9, 75.6, 58.6, 84.4, 91.5, 62.4, 88.5, 94.2, 27.0, 52.9, 64.0, 46.3, 74.1, 83.2,
                               50.4, 76.6, 84.6, 47.0, 73.6, 82.2]},
    'table3': {'CLIP': [36.1, 30.7, 8.0, 47.6, 38.4, 24.9, 36.1, 29.0, 31.0],
               'PowerCLIP-R': [40.3, 34.8, 11.2, 53.2, 40.2, 28.7, 40.3, 33.6, 34.7],
               'PowerCLIP-S': [40.8, 35.1, 11.9, 53.5, 40.5, 28.9, 40.8, 34.0, 35.1]},
    'table4': {'CLIP': [73.9, 68.8, 64.5], 'PowerCLIP-R': [75.6, 70.3, 67.9], 'PowerCLIP-S': [76.1, 70.4, 67.1]},
    'table5': {'CLIP': [24.8, 8.0, 4.3], 'PowerCLIP-R': [22.5, 9.5, 6.5], 'PowerCLIP-S': [24.8, 16.0, 10.2]},
    'table9': {'CLIP': [88.0, 67.4, 62.3], 'PowerCLIP': [91.3, 72.3, 65.8]},
    'table15': {'CLIP': [22.8, 1.4, 17.2], 'FLIP': [24.1, 0.9, 18.0], 'FILIP': [21.6, 3.2, 16.8],
                'SPARC': [20.8, 7.1, 17.2], 'C-PGS': [23.1, 2.3, 17.7], 'PowerCLIP': [27.6, 15.3, 24.4]},
}

def paper_tables(paths, paper: dict | None = None) -> dict:
    "`{table: (header, rows)}`, one row per checkpoint label; `paper` `{label: method}` adds `paper: ..` columns."
    res = [json.loads(Path(p).read_text()) for p in paths]
    by = {}
    for r in res:
        by.setdefault(r['label'], {})[r['dataset']] = r['metrics']
    out = {}
    for table in PAPER_TABLES:
        rows, header = [], None
        for label, d in by.items():
            header, cells = _table_row(table, d)
            if all(c is None for c in cells):
                continue
            rows.append([label, *cells])
        if not rows:
            continue
        header = ['checkpoint', *header]
        if paper:
            n = len(next(iter(PAPER[table].values())))
            header += [f'paper: {h}' for h in header[1:1 + n]]
            rows = [r
                    + (PAPER[table].get(paper.get(r[0]), [None] * n) if paper.get(r[0]) else [None] * n) for r in rows]
        out[table] = (header, rows)
    return out

def write_paper_tables(paths, out_dir, paper: dict | None = None) -> dict:
    "`out_dir/<table>.md` and `.csv` for each table with numbers; returns `{table: md path}`."
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for table, (header, rows) in paper_tables(paths, paper).items():
        note = f'\n{PAPER_SOURCE}.\n' if paper else ''
        (out_dir / f'{table}.md').write_text(f'### {table}\n\n' + render_table(header, rows) + note)
        (out_dir / f'{table}.csv').write_text(render_table(header, rows, 'csv'))
        files[table] = out_dir / f'{table}.md'
    return files


# %% [markdown]
# A hand case: two checkpoints, with made-up metrics whose averages are known. Checkpoint `a` has all six ImageNet
# numbers (10, 20, .., 60): ID 10, OOD 40, All 35; `b` lacks ImageNet-O, so its OOD and All stay empty. SugarCrepe
# categories at 10·k in the order of `SUGARCREPE` give Obj = mean(20, 40, 70) = 43.3, Att = mean(10, 30, 60) = 33.3, Rel = 50.

# %%
def _fake(label, dataset, metrics, d):
    f = d / label / f'{dataset}.json'
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(dict(label=label, dataset=dataset, metrics=metrics)))
    return f
_d = tmp / 'fake_results'
_files = [_fake(l, BENCHMARKS[n].folder, dict(zeroshot=dict(top1=10.0 * (k + 1))), _d)
          for l in ('a', 'b') for k, n in enumerate(ROBUSTNESS) if not (l == 'b' and n == 'imagenet-o')]
_files.append(_fake('a', 'sugar_crepe', dict(sugarcrepe={c: 10.0 * (k + 1) for k, c in enumerate(SUGARCREPE)}), _d))
_files.append(_fake('a', 'winoground', dict(winoground=dict(text=30.0, image=20.0, group=10.0)), _d))
_t = paper_tables(_files, paper=dict(a='PowerCLIP-S'))
test_eq(sorted(_t), ['table3', 'table4', 'table5'])
_h, _rows = _t['table3']
test_eq(_h[:10],
        ['checkpoint', 'ImgNet-1k', 'ImgNet-V2', 'ImgNet-A', 'ImgNet-R', 'ImgNet-O', 'ImgNet-S', 'IN', 'OOD', 'All'])
test_eq(_rows[0][7:10], [10.0, 40.0, 35.0])
test_eq(_rows[1][7:10], [10.0, None, None])
test_eq(_rows[0][10:], PAPER['table3']['PowerCLIP-S'])
test_eq(_rows[1][10:], [None] * 9)   # paper columns only for the mapped row
test_close(_t['table4'][1][0][1:4], [130 / 3, 100 / 3, 50.0])
# Table 15 from the region task on coco_sample: base, novel, all, with the paper's columns beside a mapped row
_f15 = _fake('a', 'coco_sample',
             dict(regions=dict(pooled_ap50_base=30.0, pooled_ap50_novel=10.0, pooled_ap50=25.0)), _d)
_t15 = paper_tables([_f15], paper=dict(a='PowerCLIP'))['table15']
test_eq(_t15[0],
        ['checkpoint', 'AP50 base', 'AP50 novel', 'AP50', 'paper: AP50 base', 'paper: AP50 novel', 'paper: AP50'])
test_eq(_t15[1], [['a', 30.0, 10.0, 25.0, 27.6, 15.3, 24.4]])
print(render_table(*_t['table3']))

# %% [markdown]
# Every scratch folder made above lives under one temporary folder, removed here, so running the notebook
# leaves nothing behind (a training run's checkpoints take hundreds of MB).

# %%
_scratch.cleanup()
