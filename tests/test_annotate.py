"""data_prep/annotate_shards.py end to end: dirty and truncated shards, 2 processes, kill and resume, the command
line's errors, and the caption rule it shares with the trainer."""
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

from data_prep.annotate_shards import (AnnotateConfig, UsageError, annotate_shard, expand_inputs, hold_output, main,
                                      read_groups, run)
from powerclip.parsing import ParsedCaption, tree_problems
from powerclip.regions import decode_regions

ROOT = Path(__file__).resolve().parents[1]
COCO = ROOT.parent / 'shared' / 'data' / 'coco_sample'


def _jpeg(seed: int, size=(60, 80)) -> bytes:
    a = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    a[: size[0] // 2] //= 3                                  # two halves, so superpixels have an edge to find
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, 'JPEG')
    return buf.getvalue()


def _sample(key: str, seed: int, text='a brown dog sitting on a red chair', **over) -> dict:
    s = {'__key__': key, 'jpg': _jpeg(seed), 'txt': text, 'json': json.dumps({'key': key, 'status': 'success'})}
    s.update(over)
    return {k: v for k, v in s.items() if v is not None}


def _write(path: Path, samples: list[dict]):
    "A shard as img2dataset writes it (webdataset's TarWriter: members sorted by extension within a sample)."
    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)


def _cut_inside(path: Path, member_index: int, into: int = 100):
    "Truncate `path` `into` bytes into the data of its `member_index`-th member."
    with tarfile.open(path) as tf:
        m = tf.getmembers()[member_index]
    data = path.read_bytes()
    path.write_bytes(data[: m.offset_data + into])


# the expected accounting of the dirty shard 00000.tar
DIRTY_BAD = {'k0002': 'bad_image', 'k0003': 'missing_txt', 'k0004': 'bad_json', 'k0005': 'bad_txt', 'k0006': 'bad_txt',
             'k0001': 'duplicate_key', 'k0008': 'missing_image'}


@pytest.fixture(scope='module')
def shards(tmp_path_factory) -> Path:
    "Four shards: a dirty one, a clean one, a truncated one, and one of empty captions only."
    d = tmp_path_factory.mktemp('in')
    _write(d / '00000.tar', [
        _sample('k0000', 0), _sample('k0001', 1),
        _sample('k0002', 2, jpg=b'\xff\xd8 not a jpeg'),             # undecodable image
        _sample('k0003', 3, txt=None),                                # missing caption
        _sample('k0004', 4, json='{"key": '),                         # bad json
        _sample('k0005', 5, text='   '),                              # empty caption
        _sample('k0006', 6, txt=b'\xff\xfe caf\xe9'),                 # not UTF-8
        _sample('k0007', 7, json=None),                               # no json: kept, counted
        _sample('k0001', 8),                                          # duplicate key
        _sample('k0008', 9, jpg=None),                                # no image
    ])
    _write(d / '00001.tar',
           [_sample(f'k01{i:02d}', 10 + i, text=f'two cats on a sofa near window {i}') for i in range(6)])
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
    assert {b['key']: b['detail'] for b in a['bad'] if b['reason'] == 'bad_txt'} == {
        'k0005': 'empty caption', 'k0006': 'not UTF-8: invalid start byte at byte 0 of 7'}
    assert (a['written'], a['no_json'], a['truncated']) == (3, 1, False)
    assert st['00001']['written'] == 6 and st['00001']['n_bad'] == 0
    c = st['00002']                                          # cut inside sample 3: samples 0-2 kept, 3 listed
    assert c['truncated'] and 'unexpected end' in c['read_error']
    assert c['written'] == 3 and [(b['key'], b['reason']) for b in c['bad']] == [('k0203', 'truncated')]
    assert st['00003']['written'] == 0 and st['00003']['bad_by_reason'] == {'bad_txt': 2}
    assert summary['written'] == 12 and summary['n_bad'] == 10 and summary['samples_read'] == 22
    assert summary['truncated_shards'].keys() == {'00002.tar'} and not summary['failed']
    assert json.loads((out / 'summary.json').read_text())['written'] == 12


def test_output_samples(reference, shards):
    out, _, _ = reference
    outs, st = _outputs(out), _stats(out)
    assert set(outs['00000.tar']) == {'k0000', 'k0001', 'k0007'} and outs['00003.tar'] == {}
    # the original members are copied byte for byte
    src = {}
    with tarfile.open(shards / '00001.tar') as tf:
        for m in tf.getmembers():
            src[m.name] = tf.extractfile(m).read()
    for k, g in outs['00001.tar'].items():
        assert g['jpg'] == src[f'{k}.jpg'] and g['txt'] == src[f'{k}.txt'] and g['json'] == src[f'{k}.json']
    n_masks = 0
    for shard in outs.values():
        for k, g in shard.items():
            assert set(g) >= {'jpg', 'txt', 'tree.json', 'regions.npz'}
            d = json.loads(g['tree.json'])
            tree = ParsedCaption.from_dict(d)
            assert tree.text == g['txt'].decode() and tree_problems(tree) == []     # the caption as given
            assert [tree.text[s:e] for s, e in d['offsets']] == tree.words           # stored word offsets
            assert tree.spans[0] == (0, len(tree.words))
            masks, meta = decode_regions(g['regions.npz'])
            assert (meta['grid_h'], meta['grid_w'], meta['method']) == (14, 14, 'slic')
            assert masks.shape[1] == 196 and masks.any(1).all()
            n_masks += len(masks)
    assert n_masks == sum(s['regions']['masks'] for s in st.values()) > 12


def test_resume_redoes_only_unfinished(shards, reference, tmp_path):
    ref_out, cfg, _ = reference
    out = tmp_path / 'out'
    out.mkdir()
    # the traces a killed run leaves: a half-written temp shard, and a renamed shard whose stats never came
    (out / '00001.tar.1234-deadbeef.partial').write_bytes(b'half a shard')
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
    assert (s['finished_now'], s['skipped_finished'], s['written']) == (0, 4, 12)
    # other settings: the finished shards are not replaced unless asked (issue 47), then all are redone
    with pytest.raises(UsageError, match='other settings'):
        run(expand_inputs([str(shards)]), AnnotateConfig(**{**cfg2.__dict__, 'regions': 'none'}), progress=False)
    s = run(expand_inputs([str(shards)]), AnnotateConfig(**{**cfg2.__dict__, 'regions': 'none', 'overwrite': True}),
            progress=False)
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
    assert '12 written, 10 bad' in r.stdout and 'TRUNCATED 00002.tar' in r.stdout
    assert _outputs(tmp_path) == _outputs(ref_out)          # 2 processes write what 1 process wrote


def _children() -> dict[int, list[int]]:
    "{ppid: [pid, ...]} of every process (Linux /proc)."
    kids = {}
    for d in Path('/proc').iterdir():
        if not d.name.isdigit():
            continue
        try:
            st = (d / 'stat').read_text()
        except OSError:
            continue
        kids.setdefault(int(st[st.rindex(')') + 2:].split()[1]), []).append(int(d.name))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, out, todo = _children(), set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    "Running (a zombie waiting for a parent that does not reap it counts as ended)."
    try:
        st = Path(f'/proc/{pid}/stat').read_text()
    except OSError:
        return False
    return st[st.rindex(')') + 2] != 'Z'


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads the process tree from /proc')
def test_kill_main_process_ends_its_workers_and_the_rerun_matches(tmp_path):
    """SIGKILL only the main process of a 2-worker run while a worker writes a shard: the workers and the
    resource tracker end (a bounded wait of 2 minutes); the same command then finishes, with shards byte-identical to an
    uninterrupted run."""
    src = tmp_path / 'in'
    src.mkdir()
    for s in range(4):
        _write(src / f'{s:05d}.tar', [_sample(f's{s}_{i:03d}', 100 * s + i) for i in range(30)])
    out = tmp_path / 'out'
    args = (src, '--out', out, '--workers', 2, '--regions', 'slic', '--parser', 'spacy', '--no-progress')
    with open(tmp_path / 'log', 'w') as log:
        p = subprocess.Popen([sys.executable, '-m', 'data_prep.annotate_shards', *map(str, args)], cwd=ROOT,
                             stdout=log, stderr=log)
    t0, tree = time.time(), set()
    while p.poll() is None and time.time() - t0 < 240:          # two workers up, one of them writing a shard
        tree = _descendants(p.pid)
        if len(tree) >= 3 and list(out.glob('*.tar.*.partial')):
            break
        time.sleep(0.05)
    assert p.poll() is None, f'the run ended before it could be killed: {(tmp_path / "log").read_text()[-2000:]}'
    tree = _descendants(p.pid)                                  # 2 workers + the resource tracker
    assert len(tree) >= 3, tree
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.time()
    # a bounded wait, not a speed test: left alone, an orphaned worker would never end (they end at once, by
    # PR_SET_PDEATHSIG; the resource tracker when its pipe closes), so the bound is generous for a busy machine
    while any(_alive(q) for q in tree) and time.time() - t0 < 120:
        time.sleep(0.1)
    left = [q for q in tree if _alive(q)]
    for q in left:
        os.kill(q, signal.SIGKILL)                   # (only so a failure leaves nothing behind)
    assert not left, f'processes left after the main process was killed: {left}'
    assert list(out.glob('*.partial')), 'killed mid-shard: a partial file stays until the re-run'
    r = _cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['written'] == 120 and summary['n_bad'] == 0 and not list(out.glob('*.partial'))
    ref = tmp_path / 'ref'
    run(expand_inputs([str(src)]), AnnotateConfig(out=str(ref), regions='slic', parser='spacy'), progress=False)
    tars = lambda d: {q.name: q.read_bytes() for q in sorted(d.glob('*.tar'))}
    assert tars(out) == tars(ref) and len(tars(ref)) == 4


def test_one_run_at_a_time_per_output(shards, tmp_path):
    out = tmp_path / 'o'
    cfg = AnnotateConfig(out=str(out), parser='spacy')
    with hold_output(out):
        with pytest.raises(UsageError, match='being written by another run'):
            run(expand_inputs([str(shards / '00001.tar')]), cfg, progress=False)
        # a writer left from an earlier run (its lock is gone) does not commit into a directory another run holds
        with pytest.raises(RuntimeError, match='held by another run'):
            annotate_shard(shards / '00001.tar', cfg, run='1234-earlier')
        assert not list(out.glob('*.tar')) and not list(out.glob('*.partial'))
    assert run(expand_inputs([str(shards / '00001.tar')]), cfg, progress=False)['written'] == 6


@pytest.mark.parametrize('argv,name', [
    (['{shards}/nope.tar', '--out', '{out}'], 'shards'),
    (['{tmp}/none/*.tar', '--out', '{out}'], 'shards'),
    (['{shards}/00001.tar', '--out', '{file}'], '--out'),
    (['{shards}/00001.tar', '--out', '{file}/sub'], '--out'),
    (['{shards}/00001.tar', '--out', '{out}', '--grid', '14y'], '--grid'),
    (['{shards}/00001.tar', '--out', '{out}', '--workers', '0'], '--workers'),
    (['{shards}/00001.tar', '--out', '{out}', '--regions', 'sam2'], '--regions sam2'),
    (['{shards}/00001.tar'], 'the following arguments are required: --out'),
])
def test_usage_errors_are_one_line_before_any_work(shards, tmp_path, capsys, argv, name):
    (tmp_path / 'file').write_text('not a directory')
    argv = [a.format(shards=shards, tmp=tmp_path, out=tmp_path / 'out', file=tmp_path / 'file') for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert err.out == '' and len(err.err.strip().splitlines()) == 1, err.err
    assert err.err.startswith(f'annotate_shards: error: {name}'), err.err
    assert not (tmp_path / 'out').exists()                       # nothing was written
    with pytest.raises(UsageError):                               # --debug: the traceback
        main(argv + ['--debug'])


def test_cli_exit_status_and_debug(shards, tmp_path):
    r = _cli(shards / 'nope.tar', '--out', tmp_path / 'out')
    assert r.returncode == 2 and r.stdout == '' and r.stderr.startswith('annotate_shards: error: shards:')
    assert len(r.stderr.strip().splitlines()) == 1 and 'KeyError' not in r.stderr
    r = _cli(shards / 'nope.tar', '--out', tmp_path / 'out', '--debug')
    assert r.returncode == 1 and 'Traceback' in r.stderr and 'UsageError' in r.stderr


CAPTIONS = {'c0': 'a brown dog on a red chair', 'c1': '', 'c2': '  \n ', 'c3': b'\xff\xfe caf\xe9',
            'c4': b'caf\xe9 noir',
            'c5': '!!! \U0001f600\U0001f389 ... ?!', 'c6': 'http://example.com/x.jpg', 'c7': '&amp; &quot;',
            'c8': 'Ein Hund \U0001f436 auf dem Sofa', 'c9': b'caf\xc3\xa9 au lait', 'd0': '42',
            'd1': "the person doesn't"}


def test_trainer_and_annotator_skip_the_same_captions(tmp_path):
    "The same raw shard through the annotator and through the trainer's reader: the same samples survive."
    from powerclip.data import BatchNeeds, BatchSpec, DataConfig, Geometry, key_index, make_loader
    src = tmp_path / 'in'
    src.mkdir()
    _write(src / '00000.tar', [_sample(k, i, txt=t) for i, (k, t) in enumerate(CAPTIONS.items())])
    st = run([src / '00000.tar'], AnnotateConfig(out=str(tmp_path / 'out'), parser='spacy'), progress=False)
    bad = json.loads((tmp_path / 'out' / '00000.stats.json').read_text())['bad']
    assert ({b['key'] for b in bad} == {'c1', 'c2', 'c3', 'c4', 'c5', 'c6', 'c7'}
            and {b['reason'] for b in bad} == {'bad_txt'})
    written = set(_outputs(tmp_path / 'out')['00000.tar'])
    assert written == {'c0', 'c8', 'c9', 'd0', 'd1'} and st['written'] == 5
    spec = BatchSpec(DataConfig(source='wds', shards=str(src / '00000.tar'), batch_size=1, workers=0, shuffle_buffer=0),
                     Geometry(64, 8, 77), BatchNeeds(tree=True))   # tree: the trainer parses, as a PowerCLIP run would
    ld = make_loader(spec)
    got = {int(b['index'][0]) for b in ld}
    assert got == {key_index(k) for k in written}
    assert ld.skipped()['no_caption'] == len(bad)


def test_truncation_at_member_boundary(shards, tmp_path):
    "A tar cut exactly between members (no read error) is still reported, by its missing end-of-archive blocks."
    p = tmp_path / 'cut.tar'
    data = (shards / '00001.tar').read_bytes()
    with tarfile.open(shards / '00001.tar') as tf:
        m = tf.getmembers()[5]   # last member of sample 1
    p.write_bytes(data[: m.offset_data + (m.size + 511) // 512 * 512])
    bad, g, keys = [], read_groups(p, lambda *a: bad.append(a)), []
    with pytest.raises(StopIteration) as stop:
        while True:
            keys.append(next(g)[0])
    n_members, truncated, error = stop.value.value
    assert keys == ['k0100'] and [b[:2] for b in bad] == [('k0101', 'truncated')]
    assert truncated and 'end-of-archive' in error and n_members == 6


@pytest.mark.skipif(not (COCO / 'images').is_dir(), reason=f'shared data absent: {COCO}')
def test_coco_sample_shards(tmp_path):
    "10 real COCO photos with their first caption, packed as img2dataset would, annotated with superpixels."
    rows = [json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines()[:10]]
    src = tmp_path / 'in'
    src.mkdir()
    for s in range(2):
        _write(src / f'{s:05d}.tar',
               [{'__key__': f'{s:05d}{i:04d}', 'jpg': (COCO / 'images' / r['file_name']).read_bytes(),
                                       'txt': r['captions'][0],
                 'json': json.dumps({'url': r['flickr_url'], 'caption': r['captions'][0]})}
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


def test_finished_shards_of_other_settings_or_inputs_are_refused(shards, reference, tmp_path, capsys):
    "Issue 47: a rerun with `--regions slic` forgotten, or another command's shard of the same name, replaces nothing."
    ref_out = reference[0]
    out = tmp_path / 'out'
    out.mkdir()
    for ext in ('.tar', '.stats.json'):                        # 00001 finished with --regions slic --parser spacy
        (out / f'00001{ext}').write_bytes((ref_out / f'00001{ext}').read_bytes())
    st = json.loads((out / '00001.stats.json').read_text())
    assert st['input_path'] == str((shards / '00001.tar').resolve()) and st['settings']['regions'] == 'slic'
    before = {q.name: q.read_bytes() for q in out.iterdir()}
    other = tmp_path / 'b'
    other.mkdir()
    _write(other / '00001.tar', [_sample('b0', 50)])            # another command's input of the same name
    cases = [[str(shards / '00001.tar'), '--parser', 'spacy'],                     # --regions slic forgotten
             [str(shards / '00001.tar'), '--regions', 'slic'],                     # another parser (auto)
             [str(other / '00001.tar'), '--regions', 'slic', '--parser', 'spacy']]  # another input
    for argv, why in zip(cases, ['other settings', 'other settings', 'another input']):
        assert main([*argv, '--out', str(out), '--no-progress']) == 2
        err = capsys.readouterr()
        assert err.out == '' and len(err.err.strip().splitlines()) == 1, err.err
        assert why in err.err and '--overwrite' in err.err and '00001.tar' in err.err, err.err
        assert {q.name: q.read_bytes() for q in out.iterdir() if q.name != '.annotate.lock'} == \
            {k: v for k, v in before.items() if k != '.annotate.lock'}
    # --overwrite replaces it, and the stats then name the new input
    assert main([*cases[2], '--out', str(out), '--no-progress', '--overwrite']) == 0
    assert json.loads((out / '00001.stats.json').read_text())['input_path'] == str((other / '00001.tar').resolve())
    assert set(_outputs(out)['00001.tar']) == {'b0'}


def test_a_file_that_is_not_a_shard_is_a_shard_error(shards, tmp_path, capsys):
    "Issue 47: a 0-byte or non-tar `.tar` is a failed shard (one line, exit 1), never '1 annotated now'."
    src = tmp_path / 'in'
    src.mkdir()
    (src / 'empty.tar').write_bytes(b'')
    (src / 'text.tar').write_text('this is not a tar archive\n' * 40)
    out = tmp_path / 'out'
    assert main([str(src), str(shards / '00001.tar'), '--out', str(out), '--parser', 'spacy', '--no-progress']) == 1
    cap = capsys.readouterr()
    assert 'Traceback' not in cap.err and 'Traceback' not in cap.out
    assert '(1 annotated now, 0 already finished, 2 failed)' in cap.out, cap.out
    failed = [line for line in cap.out.splitlines() if line.startswith('FAILED')]
    assert len(failed) == 2 and all('not a tar shard' in line for line in failed), failed
    assert sorted(q.name for q in out.glob('*.tar')) == ['00001.tar']      # nothing written for them
    assert json.loads((out / 'summary.json').read_text())['failed'].keys() == {'empty.tar', 'text.tar'}


# ----------------------------------------------------------------------------------------------- pack_coco_sample.py
@pytest.fixture
def coco_like(tmp_path) -> Path:
    "A folder as ../shared/data/coco_sample: 8 tiny photos, 5 captions each (40 samples)."
    d = tmp_path / 'coco'
    (d / 'images').mkdir(parents=True)
    rows = []
    for i in range(8):
        (d / 'images' / f'{i}.jpg').write_bytes(_jpeg(i, (20, 24)))
        rows.append(dict(image_id=i, file_name=f'{i}.jpg', captions=[f'a dog number {i} {j}' for j in range(5)]))
    (d / 'captions.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    return d


def _pack(argv):
    from data_prep import pack_coco_sample
    from powerclip.commandline import run_main
    return run_main(pack_coco_sample.main, [str(a) for a in argv], 'pack_coco_sample.py')


def _keys(out: Path) -> list[str]:
    return sorted(k for sh in _outputs(out).values() for k in sh)


def test_pack_refuses_a_non_empty_out(coco_like, tmp_path, capsys):
    "Issue 47: `--shards 2` into a folder of 8 shards left 6 stale ones (every sample twice)."
    out = tmp_path / 'raw'
    assert _pack([coco_like, '--out', out, '--shards', 8, '--size', 16]) == 0
    assert len(list(out.glob('*.tar'))) == 8 and len(_keys(out)) == 40
    capsys.readouterr()
    before = {q.name: q.read_bytes() for q in out.iterdir()}
    assert _pack([coco_like, '--out', out, '--shards', 2, '--size', 16]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and '--out' in err and '--overwrite' in err, err
    assert {q.name: q.read_bytes() for q in out.iterdir()} == before
    assert _pack([coco_like, '--out', out, '--shards', 2, '--size', 16, '--overwrite']) == 0
    assert sorted(q.name for q in out.iterdir()) == ['00000.tar', '00001.tar']
    assert _keys(out) == sorted(set(_keys(out))) and len(_keys(out)) == 40     # each sample once


def test_pack_writes_no_empty_shard(coco_like, tmp_path, capsys):
    "Issue 47: `--shards 100` for 40 samples wrote 60 empty shards."
    out = tmp_path / 'raw'
    assert _pack([coco_like, '--out', out, '--shards', 100, '--size', 16]) == 0
    tars = list(out.glob('*.tar'))
    assert len(tars) == 40 and all(len(g) == 1 for g in _outputs(out).values())
    lines = capsys.readouterr().out.strip().splitlines()
    assert any('--shards 100' in line and '40 shards' in line for line in lines), lines


def test_pack_interrupted_leaves_no_cut_shard(coco_like, tmp_path, monkeypatch, capsys):
    "Issue 47: a Ctrl-C while a shard is written left it cut short under its final name."
    import powerclip.data
    real, calls = powerclip.data.write_shard, []

    def cut_on_third(path, samples):
        calls.append(Path(path))
        real(path, samples)
        if len(calls) == 3:                                    # Ctrl-C half way through the third shard
            Path(path).write_bytes(Path(path).read_bytes()[:700])
            raise KeyboardInterrupt
    monkeypatch.setattr(powerclip.data, 'write_shard', cut_on_third)
    out = tmp_path / 'raw'
    assert _pack([coco_like, '--out', out, '--shards', 4, '--size', 16]) == 130
    assert sorted(q.name for q in out.iterdir()) == ['00000.tar', '00001.tar']   # the cut one is gone, not kept
    assert len(_keys(out)) == 20
