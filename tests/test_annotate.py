"""data_prep/annotate_shards.py end to end: dirty and truncated shards, 2 processes, kill and resume."""
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from data_prep.annotate_shards import AnnotateConfig, expand_inputs, read_groups, run
from powerclip.parsing import ParsedCaption
from powerclip.regions import decode_regions

ROOT = Path(__file__).resolve().parents[1]
COCO = ROOT.parent / 'shared' / 'data' / 'coco_sample'


def _jpeg(seed: int, size=(60, 80)) -> bytes:
    a = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    a[: size[0] // 2] //= 3                                  # two halves, so superpixels have an edge to find
    buf = io.BytesIO(); Image.fromarray(a).save(buf, 'JPEG'); return buf.getvalue()


def _sample(key: str, seed: int, text='a brown dog sitting on a red chair', **over) -> dict:
    s = {'__key__': key, 'jpg': _jpeg(seed), 'txt': text, 'json': json.dumps({'key': key, 'status': 'success'})}
    s.update(over)
    return {k: v for k, v in s.items() if v is not None}


def _write(path: Path, samples: list[dict]):
    "A shard as img2dataset writes it (webdataset's TarWriter: members sorted by extension within a sample)."
    with wds.TarWriter(str(path)) as w:
        for s in samples: w.write(s)


def _cut_inside(path: Path, member_index: int, into: int = 100):
    "Truncate `path` `into` bytes into the data of its `member_index`-th member."
    with tarfile.open(path) as tf: m = tf.getmembers()[member_index]
    data = path.read_bytes(); path.write_bytes(data[: m.offset_data + into])


# the expected accounting of the dirty shard 00000.tar
DIRTY_BAD = {'k0002': 'bad_image', 'k0003': 'missing_txt', 'k0004': 'bad_json', 'k0006': 'bad_txt',
             'k0001': 'duplicate_key', 'k0008': 'missing_image'}


@pytest.fixture(scope='module')
def shards(tmp_path_factory) -> Path:
    "Four shards: a dirty one, a clean one, a truncated one, and one with an empty caption and no json."
    d = tmp_path_factory.mktemp('in')
    _write(d / '00000.tar', [
        _sample('k0000', 0), _sample('k0001', 1),
        _sample('k0002', 2, jpg=b'\xff\xd8 not a jpeg'),             # undecodable image
        _sample('k0003', 3, txt=None),                                # missing caption
        _sample('k0004', 4, json='{"key": '),                         # bad json
        _sample('k0005', 5, text='   '),                              # empty caption: kept, counted
        _sample('k0006', 6, txt=b'\xff\xfe caf\xe9'),                 # not UTF-8
        _sample('k0007', 7, json=None),                               # no json: kept, counted
        _sample('k0001', 8),                                          # duplicate key
        _sample('k0008', 9, jpg=None),                                # no image
    ])
    _write(d / '00001.tar', [_sample(f'k01{i:02d}', 10 + i, text=f'two cats on a sofa near window {i}') for i in range(6)])
    _write(d / '00002.tar', [_sample(f'k02{i:02d}', 20 + i) for i in range(6)])
    _cut_inside(d / '00002.tar', 3 * 3 + 1)                           # inside sample 3's 2nd member
    _write(d / '00003.tar', [_sample(f'k03{i:02d}', 30 + i, text='') for i in range(2)])
    return d


def _outputs(out: Path) -> dict:
    "{shard name: {key: {ext: bytes}}} of an output directory."
    res = {}
    for p in sorted(out.glob('*.tar')):
        groups = {}
        with tarfile.open(p) as tf:
            for m in tf.getmembers():
                k, ext = m.name.split('.', 1)
                groups.setdefault(k, {})[ext] = tf.extractfile(m).read()
        res[p.name] = groups
    return res


def _stats(out: Path) -> dict:
    return {p.name.split('.')[0]: json.loads(p.read_text()) for p in out.glob('*.stats.json')}


@pytest.fixture(scope='module')
def reference(shards, tmp_path_factory):
    "One in-process run with superpixel regions; other tests compare against it."
    out = tmp_path_factory.mktemp('ref')
    cfg = AnnotateConfig(out=str(out), regions='slic', parser='spacy')
    summary = run(expand_inputs([str(shards)]), cfg, progress=False)
    return out, cfg, summary


def test_counts_and_reasons(reference):
    out, _, summary = reference
    st = _stats(out)
    assert set(st) == {'00000', '00001', '00002', '00003'}
    for s in st.values():                                    # nothing vanishes: every sample is written or listed
        assert s['samples_read'] == s['written'] + s['n_bad'], s
    a = st['00000']
    assert {b['key']: b['reason'] for b in a['bad']} == DIRTY_BAD
    assert (a['written'], a['empty_captions'], a['no_json'], a['truncated']) == (4, 1, 1, False)
    assert st['00001']['written'] == 6 and st['00001']['n_bad'] == 0
    c = st['00002']                                          # cut inside sample 3: samples 0-2 kept, 3 listed
    assert c['truncated'] and 'unexpected end' in c['read_error']
    assert c['written'] == 3 and [(b['key'], b['reason']) for b in c['bad']] == [('k0203', 'truncated')]
    assert st['00003']['written'] == 2 and st['00003']['empty_captions'] == 2
    assert summary['written'] == 15 and summary['n_bad'] == 7 and summary['samples_read'] == 22
    assert summary['truncated_shards'].keys() == {'00002.tar'} and not summary['failed']
    assert json.loads((out / 'summary.json').read_text())['written'] == 15


def test_output_samples(reference, shards):
    out, _, _ = reference
    outs, st = _outputs(out), _stats(out)
    assert set(outs['00000.tar']) == {'k0000', 'k0001', 'k0005', 'k0007'}
    # the original members are copied byte for byte
    src = {}
    with tarfile.open(shards / '00001.tar') as tf:
        for m in tf.getmembers(): src[m.name] = tf.extractfile(m).read()
    for k, g in outs['00001.tar'].items():
        assert g['jpg'] == src[f'{k}.jpg'] and g['txt'] == src[f'{k}.txt'] and g['json'] == src[f'{k}.json']
    n_masks = 0
    for shard in outs.values():
        for k, g in shard.items():
            assert set(g) >= {'jpg', 'txt', 'tree.json', 'regions.npz'}
            tree = ParsedCaption.from_dict(json.loads(g['tree.json']))
            assert tree.text == ' '.join(g['txt'].decode().split())
            assert tree.spans[0] == (0, len(tree.words))
            masks, meta = decode_regions(g['regions.npz'])
            assert (meta['grid_h'], meta['grid_w'], meta['method']) == (14, 14, 'slic')
            assert masks.shape[1] == 196 and masks.any(1).all()
            n_masks += len(masks)
    assert n_masks == sum(s['regions']['masks'] for s in st.values()) > 15
    assert ParsedCaption.from_dict(json.loads(outs['00003.tar']['k0300']['tree.json'])).words == []


def test_resume_redoes_only_unfinished(shards, reference, tmp_path):
    ref_out, cfg, _ = reference
    out = tmp_path / 'out'; out.mkdir()
    # the traces a killed run leaves: a half-written temp shard, and a renamed shard whose stats never came
    (out / '00001.tar.partial').write_bytes(b'half a shard')
    (out / '00000.tar').write_bytes(b'not finished')
    # a shard finished by an earlier run with the same settings
    for ext in ('.tar', '.stats.json'):
        (out / f'00003{ext}').write_bytes((ref_out / f'00003{ext}').read_bytes())
    before = (out / '00003.stats.json').stat().st_mtime_ns
    cfg2 = AnnotateConfig(**{**cfg.__dict__, 'out': str(out)})
    s = run(expand_inputs([str(shards)]), cfg2, progress=False)
    assert (s['finished_now'], s['skipped_finished']) == (3, 1)
    assert (out / '00003.stats.json').stat().st_mtime_ns == before
    assert not list(out.glob('*.partial'))
    assert _outputs(out) == _outputs(ref_out)                # the redone shards are exactly the reference
    # nothing left to do on a second run
    s = run(expand_inputs([str(shards)]), cfg2, progress=False)
    assert (s['finished_now'], s['skipped_finished'], s['written']) == (0, 4, 15)
    # other settings: the finished shards do not match them, so they are redone
    s = run(expand_inputs([str(shards)]), AnnotateConfig(**{**cfg2.__dict__, 'regions': 'none'}), progress=False)
    assert s['finished_now'] == 4
    assert all('regions.npz' not in g for sh in _outputs(out).values() for g in sh.values())


def _cli(*args, **kw):
    return subprocess.run([sys.executable, '-m', 'data_prep.annotate_shards', *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, **kw)


def test_cli_two_processes(shards, reference, tmp_path):
    ref_out = reference[0]
    r = _cli(f'{shards}/{{00000..00003}}.tar', '--out', tmp_path, '--workers', 2, '--regions', 'slic',
             '--parser', 'spacy', '--no-progress')
    assert r.returncode == 0, r.stderr[-3000:]
    assert '15 written, 7 bad' in r.stdout and 'TRUNCATED 00002.tar' in r.stdout
    assert _outputs(tmp_path) == _outputs(ref_out)          # 2 processes write what 1 process wrote


def test_kill_and_resume(tmp_path):
    "SIGKILL the tool after its first finished shard; the same command then finishes the rest."
    src = tmp_path / 'in'; src.mkdir()
    for s in range(6): _write(src / f'{s:05d}.tar', [_sample(f's{s}_{i:03d}', 100 * s + i) for i in range(40)])
    out = tmp_path / 'out'
    args = (src, '--out', out, '--workers', 1, '--regions', 'slic', '--parser', 'spacy', '--no-progress')
    p = subprocess.Popen([sys.executable, '-m', 'data_prep.annotate_shards', *map(str, args)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    t0 = time.time()
    while not list(out.glob('*.stats.json')) and p.poll() is None and time.time() - t0 < 240: time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL); p.wait()
    done_before = {q.name for q in out.glob('*.stats.json')}
    assert done_before, 'no shard finished before the kill'
    for q in out.glob('*.stats.json'):                      # every shard that counts as finished is whole
        with tarfile.open(out / q.name.replace('.stats.json', '.tar')) as tf: assert len(tf.getmembers()) == 40 * 5
    r = _cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['skipped_finished'] == len(done_before) and summary['finished_now'] == 6 - len(done_before)
    assert summary['written'] == 240 and summary['n_bad'] == 0 and not list(out.glob('*.partial'))


def test_errors_are_clear(shards, tmp_path):
    with pytest.raises(SystemExit, match='sam2-checkpoint'):
        run(expand_inputs([str(shards)]), AnnotateConfig(out=str(tmp_path), regions='sam2'), progress=False)
    s = run([shards / 'nope.tar'], AnnotateConfig(out=str(tmp_path)), progress=False)
    assert s['failed'] == {'nope.tar': 'input shard does not exist'}
    with pytest.raises(SystemExit, match='share file names'):
        (tmp_path / 'a').mkdir(); expand_inputs([str(shards / '00000.tar'), str(tmp_path / 'a' / '00000.tar')])


def test_truncation_at_member_boundary(shards, tmp_path):
    "A tar cut exactly between members (no read error) is still reported, by its missing end-of-archive blocks."
    p = tmp_path / 'cut.tar'
    data = (shards / '00001.tar').read_bytes()
    with tarfile.open(shards / '00001.tar') as tf: m = tf.getmembers()[5]   # last member of sample 1
    p.write_bytes(data[: m.offset_data + (m.size + 511) // 512 * 512])
    bad, g, keys = [], read_groups(p, lambda *a: bad.append(a)), []
    with pytest.raises(StopIteration) as stop:
        while True: keys.append(next(g)[0])
    n_members, truncated, error = stop.value.value
    assert keys == ['k0100'] and [b[:2] for b in bad] == [('k0101', 'truncated')]
    assert truncated and 'end-of-archive' in error and n_members == 6


@pytest.mark.skipif(not (COCO / 'images').is_dir(), reason=f'shared data absent: {COCO}')
def test_coco_sample_shards(tmp_path):
    "10 real COCO photos with their first caption, packed as img2dataset would, annotated with superpixels."
    rows = [json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines()[:10]]
    src = tmp_path / 'in'; src.mkdir()
    for s in range(2):
        _write(src / f'{s:05d}.tar', [{'__key__': f'{s:05d}{i:04d}', 'jpg': (COCO / 'images' / r['file_name']).read_bytes(),
                                       'txt': r['captions'][0], 'json': json.dumps({'url': r['flickr_url'], 'caption': r['captions'][0]})}
                                      for i, r in enumerate(rows[5 * s: 5 * s + 5])])
    summary = run(expand_inputs([str(src)]), AnnotateConfig(out=str(tmp_path / 'out'), regions='slic', parser='spacy'),
                  progress=False)
    assert (summary['written'], summary['n_bad']) == (10, 0)
    for shard in _outputs(tmp_path / 'out').values():
        for g in shard.values():
            tree = ParsedCaption.from_dict(json.loads(g['tree.json']))
            assert len(tree.words) >= 3 and len(tree.spans) >= 2     # real captions give real trees
            masks, _ = decode_regions(g['regions.npz'])
            assert len(masks) >= 3 and masks.any(1).all()
