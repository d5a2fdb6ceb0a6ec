"What the 22_world notebook cannot check in a cell: worker processes, a fresh interpreter, files on disk."
import hashlib, importlib.util, json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from powerclip.parsing import ParsedCaption
from powerclip.world import (NEGATIVE_KINDS, CLIP_MEAN, CLIP_STD, Scene, WorldConfig, WorldDataset, caption_truth,
                             collate_world, generate, spec_from_text, read_sugarcrepe, render, write_test_splits)

ROOT = Path(__file__).resolve().parents[1]
REAL_SUGARCREPE = ROOT.parent / 'shared' / 'data' / 'sugarcrepe' / 'data'


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]): assert torch.equal(a[k], b[k]), k
        else: assert a[k] == b[k], k


def test_two_workers_yield_the_single_process_samples():
    ds = WorldDataset(WorldConfig(seed=3), length=48)
    kw = dict(batch_size=8, collate_fn=collate_world, shuffle=False)
    single = list(torch.utils.data.DataLoader(ds, num_workers=0, **kw))
    multi = list(torch.utils.data.DataLoader(ds, num_workers=2, **kw))
    assert len(single) == len(multi) == 6
    for a, b in zip(single, multi): _assert_batches_equal(a, b)
    # and resuming in the middle (a sampler that starts at sample 24) sees exactly the same samples
    resumed = list(torch.utils.data.DataLoader(torch.utils.data.Subset(ds, range(24, 48)), num_workers=2, **kw))
    for a, b in zip(single[3:], resumed): _assert_batches_equal(a, b)


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
    consts = importlib.util.module_from_spec(cspec); cspec.loader.exec_module(consts)
    assert tuple(CLIP_MEAN) == tuple(consts.OPENAI_DATASET_MEAN) and tuple(CLIP_STD) == tuple(consts.OPENAI_DATASET_STD)


def test_written_split_loads_back(tmp_path):
    cfg = WorldConfig(seed=11)
    summary = write_test_splits(tmp_path, cfg, n_images=40)
    assert json.loads((tmp_path / 'summary.json').read_text()) == summary
    assert WorldConfig(**json.loads((tmp_path / 'config.json').read_text())) == cfg
    scenes = json.loads((tmp_path / 'scenes.json').read_text())
    parses = json.loads((tmp_path / 'parses.json').read_text())
    assert len(list((tmp_path / 'images').glob('*.png'))) == 40
    for kind in NEGATIVE_KINDS:
        items = read_sugarcrepe(tmp_path, kind)
        assert len(items) == summary['sugarcrepe'][kind] > 0
        raw = json.loads((tmp_path / 'data' / f'{kind}.json').read_text())
        assert list(raw) == [str(i) for i in range(len(raw))]
        for path, cap, neg in items:
            d = scenes[path.name]
            scene = Scene.from_dict(d['scene'])
            img = np.asarray(Image.open(path).convert('RGB'))
            assert np.array_equal(img, render(scene, cfg)[0])
            assert np.array_equal(img, generate(cfg, d['index'], 'test')['image'])
            assert caption_truth(spec_from_text(cap, cfg), scene, cfg) is True
            assert caption_truth(spec_from_text(neg, cfg), scene, cfg) is False
            for t in (cap, neg):
                p = ParsedCaption.from_dict(parses[t])
                assert p.text == t and p.parser == 'gold' and p.spans[0] == (0, len(p.words))
    retrieval = json.loads((tmp_path / 'retrieval.json').read_text())
    caps = [c for r in retrieval for c in r['caption']]
    assert len(caps) == len(set(caps)) == summary['retrieval_captions']
    assert summary['retrieval_images'] + summary['retrieval_skipped_images'] == 40


@pytest.mark.skipif(not REAL_SUGARCREPE.exists(), reason=f'real SugarCrepe data not found at {REAL_SUGARCREPE}')
def test_written_split_has_the_real_benchmark_format(tmp_path):
    write_test_splits(tmp_path, WorldConfig(), n_images=20)
    for kind in NEGATIVE_KINDS:
        real = json.loads((REAL_SUGARCREPE / f'{kind}.json').read_text())
        ours = json.loads((tmp_path / 'data' / f'{kind}.json').read_text())
        r0, o0 = next(iter(real.items())), next(iter(ours.items()))
        assert type(r0[0]) is type(o0[0]) and set(r0[1]) == set(o0[1])
        assert all(isinstance(v, str) for v in o0[1].values())
