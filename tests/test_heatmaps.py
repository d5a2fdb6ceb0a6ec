"""Heatmaps: the CLI end to end (grids for images, texts and checkpoints in each format the project writes; the
grounding table), compositional edits on world and real COCO captions, and bad input."""
import json, re, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from powerclip.eval.models import load_model
from powerclip.heatmaps import caption_edits, grounding_table, main, with_edits
from powerclip.model import create_model
from powerclip.world import WorldConfig, generate, spec_from_text

ROOT = Path(__file__).resolve().parents[1]
COCO = ROOT.parent / 'shared' / 'data' / 'coco_sample'


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    "A trainer-style checkpoint (weights under 'model', config inside) and a plain state dict beside a config.yaml."
    d = tmp_path_factory.mktemp('runs')
    torch.manual_seed(3)
    sd = create_model('powerclip-micro')[0].state_dict()
    (d / 'trainer' / 'checkpoints').mkdir(parents=True)
    torch.save(dict(model=sd, config=dict(model=dict(name='powerclip-micro', kwargs={})), step=7),
               d / 'trainer' / 'checkpoints' / 'last.pt')
    (d / 'plain').mkdir()
    torch.save(sd, d / 'plain' / 'model.pt')
    (d / 'plain' / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\n')
    return d


def _image(path, h=50, w=70, seed=0):
    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype(np.uint8)).save(path)
    return path


def test_both_checkpoint_formats_load_the_same_weights(runs):
    a = load_model(checkpoint=runs / 'trainer' / 'checkpoints' / 'last.pt').model.state_dict()
    b = load_model(checkpoint=runs / 'plain').model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_grids(tmp_path, runs, capsys):
    imgs = [_image(tmp_path / 'x.png'), _image(tmp_path / 'y.jpg', 80, 40, seed=1)]
    args = ['--out', str(tmp_path / 'maps'), '--edits', '--text', 'a small red circle left of a blue square',
            '--text', 'a green cross', '--checkpoint', f"trainer={runs / 'trainer' / 'checkpoints' / 'last.pt'}",
            '--checkpoint', f"plain={runs / 'plain'}", '--checkpoint', 'rnd=random:powerclip-micro']
    for im in imgs:
        args += ['--image', str(im)]
    assert main(args) == 0
    printed = capsys.readouterr().out.split()
    pngs = sorted((tmp_path / 'maps').glob('*.png'))
    assert [p.name for p in pngs] == ['x.png', 'y.png'] and sorted(printed) == sorted(map(str, pngs))
    # 3 columns; rows: caption + swap_att + swap_obj, then 'a green cross' (no edit applies)
    w, h = Image.open(pngs[0]).size
    assert w > 2 * 200 and h > 3 * 200


def test_cli_grounding_table(tmp_path, runs, capsys):
    assert main(['--grounding', '4', '--checkpoint', f"plain={runs / 'plain'}", '--out', str(tmp_path)]) == 0
    rows = json.loads((tmp_path / 'grounding.json').read_text())
    assert ([r['name'] for r in rows]
            == ['plain', 'random init (powerclip-micro)', 'uniform map (chance)', 'centre prior'])
    assert rows[0]['checkpoint'] == str(runs / 'plain') and len(rows[0]['checkpoint_id']) == 64
    u = rows[2]
    assert u['pointing'] == pytest.approx(u['pointing_chance']) and u['mean_iou'] == pytest.approx(u['pointing_chance'])
    for r in rows:
        assert 0 <= r['pointing'] <= r['pointing_any_object'] <= 100 and 0 <= r['mean_iou'] <= 100
        assert 0 <= r['pointing_inverted'] <= 100 and 0 <= r['named_given_object'] <= 100
    assert ('| plain |' in capsys.readouterr().out
            and (tmp_path / 'grounding.md').read_text().startswith('| checkpoint |'))


def test_grounding_table_python_api(runs):
    lm = load_model('powerclip-micro')
    rows, md = grounding_table({'a': str(runs / 'plain'), 'b': lm}, n_scenes=3, baselines=False)
    assert [r['name'] for r in rows] == ['a', 'b'] and md.count('\n| ') == 3
    assert len({r['n_phrases'] for r in rows}) == 1


def test_cli_bad_input(tmp_path, runs, capfd):
    "As a user types them: the first through `python -m` (the entry point), the others through the same `main`."
    r = subprocess.run([sys.executable, '-m', 'powerclip.heatmaps', '--checkpoint', 'random:powerclip-micro'],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and '--grounding' in r.stderr and 'Traceback' not in r.stderr, r.stderr

    def run(*a):
        rc = main(list(a))
        return rc, capfd.readouterr().err
    rc, err = run('--image', 'x.png', '--text', 'a dog')
    assert rc == 2 and '--checkpoint' in err
    rc, err = run('--image', str(tmp_path / 'nope.png'), '--text', 'a dog', '--checkpoint', 'random:powerclip-micro')
    assert rc == 2 and 'not found' in err and err.count('\n') == 1, err
    rc, err = run('--image', str(_image(tmp_path / 'x.png')), '--text', 'a dog', '--checkpoint', f'a={tmp_path}')
    assert rc == 2 and 'no checkpoint in a known layout' in err and err.count('\n') == 1, err


def test_world_edits_stay_in_the_grammar():
    """An edit of a world caption is again a world caption: swap_obj exchanges the first two mentions, swap_att their
    colours."""
    cfg, n_att, n_obj = WorldConfig(), 0, 0
    for i in range(60):
        s = generate(cfg, i, 'test')
        spec, ed = s['spec'], caption_edits(s['parsed'])                        # the gold tree
        assert ed == caption_edits(s['parsed'])                                 # deterministic
        if len(spec.mentions) == 1:
            assert 'swap_obj' not in ed
            continue
        m0, m1 = spec.mentions[:2]
        o = spec_from_text(ed['swap_obj'], cfg)
        n_obj += 1
        assert o.mentions[:2] == (m1, m0) and o.mentions[2:] == spec.mentions[2:] and o.relation == spec.relation
        if 'swap_att' in ed:
            a = spec_from_text(ed['swap_att'], cfg)
            n_att += 1
            changed = [k for k, (x, y) in enumerate(zip(a.mentions, spec.mentions)) if x != y]
            assert len(changed) == 2, (s['text'], ed['swap_att'])                # two mentions exchange their colours
            j, k = changed
            assert (a.mentions[j].colour, a.mentions[k].colour) == (spec.mentions[k].colour, spec.mentions[j].colour)
            assert [x.shape for x in a.mentions] == [x.shape for x in spec.mentions]
            assert [x.size for x in a.mentions] == [x.size for x in spec.mentions]
    assert n_att > 10 and n_obj > 20


@pytest.mark.skipif(not (COCO / 'captions.jsonl').is_file(), reason=f'{COCO} is absent (real COCO captions)')
def test_coco_edits_move_words_only():
    rows = [json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines()[:30]]
    caps = [c for r in rows for c in r['captions']]
    bag = lambda t: sorted(w for w in re.findall(r"\w+|[^\w\s]", t.lower()) if w not in ('a', 'an'))
    n = 0
    for c in caps:
        for kind, v in caption_edits(c).items():
            assert v != c and bag(v) == bag(c), (c, kind, v)
            n += 1
    assert n > len(caps) // 2
    labels = [lab for lab, _ in with_edits(caps[:5])]
    assert labels.count('caption') == 5
