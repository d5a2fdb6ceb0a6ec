"""What the 22_world notebook cannot check in a cell: worker processes, a fresh interpreter. (The world's benchmark
folder on disk: tests/test_eval.py.)"""
import hashlib, importlib.util, json, os, subprocess, sys
from pathlib import Path

import torch

from powerclip.world import CLIP_MEAN, CLIP_STD, WorldConfig, WorldDataset, collate_world, generate

ROOT = Path(__file__).resolve().parents[1]


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_two_workers_yield_the_single_process_samples():
    ds = WorldDataset(WorldConfig(seed=3), length=48)
    kw = dict(batch_size=8, collate_fn=collate_world, shuffle=False)
    single = list(torch.utils.data.DataLoader(ds, num_workers=0, **kw))
    multi = list(torch.utils.data.DataLoader(ds, num_workers=2, **kw))
    assert len(single) == len(multi) == 6
    for a, b in zip(single, multi):
        _assert_batches_equal(a, b)
    # and resuming in the middle (a sampler that starts at sample 24) sees exactly the same samples
    resumed = list(torch.utils.data.DataLoader(torch.utils.data.Subset(ds, range(24, 48)), num_workers=2, **kw))
    for a, b in zip(single[3:], resumed):
        _assert_batches_equal(a, b)


def test_samples_do_not_depend_on_the_interpreter():
    "A fresh interpreter with another hash seed makes the same samples (no set or dict-order randomness)."
    code = ("import json, hashlib; from powerclip.world import WorldConfig, generate; "
            "print(json.dumps([(s['text'], hashlib.sha1(s['image'].tobytes() + s['masks'].tobytes()).hexdigest()) "
            "for s in (generate(WorldConfig(seed=5), i, 'test') for i in range(20))]))")
    here = [[s['text'], hashlib.sha1(s['image'].tobytes() + s['masks'].tobytes()).hexdigest()]
            for s in (generate(WorldConfig(seed=5), i, 'test') for i in range(20))]
    h = '1' if os.environ.get('PYTHONHASHSEED') != '1' else '2'
    there = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, 'PYTHONHASHSEED': h}).stdout
    assert json.loads(there) == here


def test_clip_constants_match_open_clip():
    "Read open_clip/constants.py on its own: importing open_clip costs many seconds on 2 cores."
    spec = importlib.util.find_spec('open_clip')
    path = Path(spec.submodule_search_locations[0]) / 'constants.py'
    cspec = importlib.util.spec_from_file_location('_open_clip_constants', path)
    consts = importlib.util.module_from_spec(cspec)
    cspec.loader.exec_module(consts)
    assert tuple(CLIP_MEAN) == tuple(consts.OPENAI_DATASET_MEAN) and tuple(CLIP_STD) == tuple(consts.OPENAI_DATASET_STD)


