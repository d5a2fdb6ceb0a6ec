"""powerclip.data beyond the notebook cells: worker processes, dirty shards, resume, ranks."""
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from powerclip.data import BatchNeeds, BatchSpec, DataConfig, Geometry, SampleSkipCounter, make_loader, write_shard
from powerclip.parsing import ParsedCaption
from powerclip.regions import encode_regions


def _jpeg(seed: int) -> bytes:
    a = np.random.default_rng(seed).integers(0, 255, (48, 72, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, 'JPEG')
    return buf.getvalue()


def _good(i: int, tree: bool = True) -> dict:
    text = f'a small dog on a red chair number {i}'
    s = {'__key__': f'{i:09d}', 'jpg': _jpeg(i), 'txt': text, 'json': json.dumps({'key': f'{i:09d}'}),
         'regions.npz': encode_regions(torch.eye(2, 64, dtype=torch.bool), 8, 8, 'test')}
    if tree:
        w = text.split()
        s['tree.json'] = json.dumps(ParsedCaption(text, w, [(0, len(w)), (0, 3), (3, len(w))], ['NP', 'NP', 'PP'],
                                                  'gold', []).to_dict())
    return s


GEO = Geometry(64, 8, 77)
TREE = BatchNeeds(tree=True, node_np=True)                                 # what C2LIP asks for


def _spec(needs=BatchNeeds(), seed=0, **data):
    return BatchSpec(DataConfig(**data), GEO, needs, seed)


def _same(xs, ys):
    return len(xs) == len(ys) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                      for x, y in zip(xs, ys))


@pytest.fixture(scope='module')
def dirty(tmp_path_factory):
    "4 shards: 12 good samples, 5 bad ones, one truncated shard, plus a shard name that does not exist."
    root = tmp_path_factory.mktemp('shards')
    write_shard(root / '00000.tar', [_good(0), dict(_good(100), jpg=b'\xff\xd8garbage'), _good(1), _good(2)])
    write_shard(root / '00001.tar', [_good(3), dict(_good(101), txt=''), _good(4), _good(5)])
    write_shard(root / '00002.tar', [_good(6), {k: v for k, v in _good(102).items() if k != 'jpg'}, _good(7),
                                     dict(_good(103), **{'tree.json': 'not json'}), _good(8)])
    write_shard(root / '00003.tar', [_good(9), _good(10), _good(11),
                                     dict(_good(104),
                                          **{'regions.npz': encode_regions(np.zeros((2, 64), bool), 8, 8)})])
    write_shard(root / 'full.tar', [_good(i) for i in range(200, 206)])
    data = (root / 'full.tar').read_bytes()
    (root / 'full.tar').unlink()
    (root / '00004.tar').write_bytes(data[:len(data) // 2 + 300])                       # truncated download
    return str(root / '{00000..00005}.tar')                                              # 00005 is missing


@pytest.mark.parametrize('workers', [0, 2])
def test_dirty_shards_counted_not_fatal(dirty, workers):
    spec = _spec(BatchNeeds(tree=True, regions=3, region_source='stored'), source='wds', shards=dirty, batch_size=1,
                 workers=workers, shuffle_buffer=4)
    ld = make_loader(spec, epoch=0)
    batches = list(ld)
    keys = sorted(int(b['index'][0]) for b in batches)
    counts = ld.skipped()
    assert counts == dict(shard_error=2, no_image=1, bad_image=1, no_caption=1, bad_tree=1, no_regions=1,
                          bad_regions=0), counts                                          # summed over processes
    assert len(keys) == len(set(keys)) and 12 <= len(keys) < 18                           # 12 good + part of 00004
    b = batches[0]
    assert b['image'].shape == (1, 3, 64, 64) and b['tokens'].shape == (1, 77)
    assert b['region_masks'].shape == (1, 3, 64) and b['region_valid'].tolist() == [[True, True, False]]


def test_parse_on_the_fly_and_refuse(tmp_path):
    write_shard(tmp_path / 'a.tar', [_good(0, tree=False), _good(1)])
    data = dict(source='wds', shards=str(tmp_path / 'a.tar'), batch_size=1, workers=0, shuffle_buffer=0)
    b = list(make_loader(_spec(TREE, **data)))
    assert len(b) == 2 and b[0]['node_valid'].sum() >= 1                                  # parsed by spaCy
    ld = make_loader(_spec(TREE, **data, parse_missing=False))
    assert len(list(ld)) == 1 and ld.skipped()['bad_tree'] == 1


def test_no_tree_needed_no_caption_parsed(tmp_path, monkeypatch):
    "A method that asks for tokens only (CLIP) gets them from the raw caption: no caption is parsed, no tree read."
    import powerclip.data as pdata
    def no_parse(*a, **k):
        raise AssertionError('a caption was parsed')
    monkeypatch.setattr(pdata, 'parse_caption', no_parse)
    monkeypatch.setattr(pdata, 'tree_tokens', no_parse)
    write_shard(tmp_path / 'a.tar', [_good(0, tree=False), _good(1), dict(_good(2), **{'tree.json': 'not json'})])
    ld = make_loader(_spec(source='wds', shards=str(tmp_path / 'a.tar'), batch_size=1, workers=0, shuffle_buffer=0))
    b = list(ld)
    assert len(b) == 3 and set(b[0]) == {'image', 'tokens', 'index'} and sum(ld.skipped().values()) == 0
    tokens = {int(x['index'][0]): x['tokens'][0] for x in b}
    assert torch.equal(tokens[pdata.key_index('000000000')],
                       pdata.caption_tokens('a small dog on a red chair number 0', 77))


def test_world_workers_and_resume():
    needs = BatchNeeds(tree=True, regions=3)
    cfg = _spec(needs, seed=3, batch_size=4, workers=1, world_length=24)
    one = list(make_loader(cfg, epoch=2))
    two = list(make_loader(_spec(needs, seed=3, batch_size=4, workers=2, world_length=24), epoch=2))
    assert len(one) == 6 and _same(one, two)
    assert _same(list(make_loader(cfg, epoch=2, start_step=4)), one[4:])
    assert not torch.equal(list(make_loader(cfg, epoch=3))[0]['index'], one[0]['index'])
    ranks = [list(make_loader(cfg, epoch=2, rank=r, world_size=2)) for r in range(2)]
    assert _same(ranks[0], one[0::2]) and _same(ranks[1], one[1::2])


def _with_positions(spec, epoch=0, position=None):
    ld = make_loader(spec, epoch, position=position)
    return [(b, ld.state()) for b in ld], ld


# CLIP's
KNOWN_BAD = dict(shard_error=2, no_image=1, bad_image=1, no_caption=1, bad_tree=0, no_regions=0, bad_regions=0)


@pytest.mark.parametrize('workers,buffer', [(0, 1000), (2, 1000), (2, 3), (3, 0)])
def test_wds_resume_exact_with_bad_samples(dirty, workers, buffer):
    "Stopped after every step and resumed from the position reached: the same batches, the same skip counts."
    spec = _spec(source='wds', shards=dirty, batch_size=2, workers=workers, shuffle_buffer=buffer)
    run, ld = _with_positions(spec, epoch=1)
    full = [b for b, _ in run]
    assert ld.skipped() == KNOWN_BAD                                       # every bad sample, once
    assert len(full) >= 5
    for s in range(1, len(full)):
        rest, ld2 = _with_positions(spec, epoch=1, position=run[s - 1][1])
        assert _same([b for b, _ in rest], full[s:]), s
        assert ld2.skipped() == ld.skipped() and ld2.state() == ld.state()
        # counts do not depend on prefetching
        assert run[s - 1][1].skipped == _with_positions(spec, epoch=1)[0][s - 1][1].skipped


def test_wds_ranks_and_epoch_cap(tmp_path):
    for s in range(4):
        write_shard(tmp_path / f'{s}.tar', [_good(10 * s + i) for i in range(6)])
    data = dict(source='wds', shards=str(tmp_path / '{0..3}.tar'), batch_size=2, workers=2, shuffle_buffer=4)
    cfg = _spec(TREE, **data)
    full = list(make_loader(cfg, epoch=1))
    assert len(full) == 12
    # ranks split the shards: disjoint samples, together all of them
    ranks = [torch.cat([b['index'] for b in make_loader(cfg, epoch=1, rank=r, world_size=2)]) for r in range(2)]
    assert not set(ranks[0].tolist()) & set(ranks[1].tolist()) and len(ranks[0]) + len(ranks[1]) == 24
    # samples_per_epoch caps the epoch and gives it a length; a capped epoch resumes exactly too
    capped = _spec(TREE, **data, samples_per_epoch=10)
    run, ld = _with_positions(capped, epoch=1)
    assert len(make_loader(capped, epoch=1)) == 5 and len(run) == 5
    rest = make_loader(capped, epoch=1, position=run[1][1])
    assert len(rest) == 3 and _same(list(rest), [b for b, _ in run[2:]])
    with pytest.raises(ValueError, match='position'):
        make_loader(capped, epoch=1, start_step=2)


def test_skip_counter():
    c = SampleSkipCounter()
    c.add('bad_image', 'k')
    c.add('bad_image', 'k2')
    assert c.take()['bad_image'] == 2 and c.total() == 0
    with pytest.raises(ValueError, match='unknown skip reason'):
        c.add('nope')
