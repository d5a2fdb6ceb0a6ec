"""What the eval notebooks (60-66) cannot check in a cell: the CLI (in process and as `python -m`), files, checkpoints,
the feature cache across runs, the world's benchmark folder, methods with several scorers, the real coco_sample, and
cross-checks against clip_benchmark and scikit-learn."""
import importlib.util, json, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerclip.eval.cli import main
from powerclip.eval.data import (MissingData, load_classification, load_retrieval, load_sugarcrepe, load_winoground,
                                 write_world_benchmark)
from powerclip.eval.metrics import chance_recall, classification_metrics, fit_logreg, linear_probe, retrieval_recall
from powerclip.eval.models import Evaluator, load_model, sha256_file
from powerclip.eval.tasks import evaluate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / 'shared' / 'data'
COCO = DATA / 'coco_sample'
needs_data = pytest.mark.skipif(not COCO.is_dir(), reason=f'real data absent: {COCO}')


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp('world')
    write_world_benchmark(root, n_images=100)
    return root


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_all_tasks_on_world(world, tmp_path, capsys):
    out, cache = tmp_path / 'res', tmp_path / 'cache'
    argv = ['run', '--model', 'powerclip-micro', '--data', str(world), '--out', str(out), '--cache', str(cache),
            '--no-progress']
    rc, stdout, _ = _run(argv, capsys)
    assert rc == 0
    res = json.loads((out / 'random-init' / f'{world.name}.json').read_text())
    assert set(res['metrics']) == {'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground', 'regions',
                                   'long_retrieval'}
    assert res['sha256'] == 'random-init' and res['skipped'] == {}
    assert res['command'].startswith('powerclip-eval run --model powerclip-micro')
    m = res['metrics']
    summary = json.loads((world / 'summary.json').read_text())
    assert m['retrieval']['n_images'] == summary['retrieval_images']
    assert m['retrieval']['n_texts'] == summary['retrieval_captions']
    for kind, n in summary['sugarcrepe'].items():
        if n:
            assert m['sugarcrepe'][f'{kind}_n'] == n
    assert m['zeroshot']['n'] == 100 and m['zeroshot']['n_classes'] == 5
    assert (m['linear_probe']['n_train'], m['linear_probe']['n_val'], m['linear_probe']['n_test']) == (100, 50, 100)
    # every gold object of the test images is a region, named with its attribute (35 colour-shape classes) and without
    reg = m['regions']
    assert reg['n_regions'] == reg['pooled_n_regions'] == reg['crop_n_regions'] == summary['regions']
    assert (reg['classes'], reg['shape/classes'], reg['set']) == (35, 5, 'colour_shape')
    assert reg['chance_top1'] == pytest.approx(100 / 35) and reg['shape/chance_top1'] == pytest.approx(20)
    for task in m.values():
        for k, v in task.items():
            if isinstance(v, float) and not k.startswith(('lambda', 'seconds')):
                assert 0 <= v <= 100, (k, v)
    # the rerun reads every feature from the cache and gives the same numbers
    files = sorted(cache.rglob('*.pt'))
    assert files
    mtimes = [f.stat().st_mtime_ns for f in files]
    rc, _, _ = _run(argv, capsys)
    assert rc == 0 and sorted(cache.rglob('*.pt')) == files and [f.stat().st_mtime_ns for f in files] == mtimes
    res2 = json.loads(next((out / 'random-init').glob('*.json')).read_text())
    strip = lambda m: {t: {k: v for k, v in d.items() if k != 'seconds'} for t, d in m.items()}
    assert strip(res2['metrics']) == strip(m)
    # table of two "checkpoints"
    argv2 = argv + ['--label', 'again']
    assert _run(argv2, capsys)[0] == 0
    rc, md, _ = _run(['table', *map(str, sorted(out.rglob('*.json'))), '--out', str(tmp_path / 'table')], capsys)
    assert rc == 0 and '| dataset | task | metric | again | random-init |' in md
    assert (tmp_path / 'table.csv').read_text().startswith('dataset,task,metric,again,random-init')


def test_cache_hits_in_process(world, tmp_path):
    ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False)
    a, _ = evaluate(ev, world, ['retrieval', 'winoground'])
    ev2 = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False)
    b, _ = evaluate(ev2, world, ['retrieval', 'winoground'])
    assert ev.cache.misses > 0 and ev2.cache.misses == 0 and ev2.cache.hits == ev.cache.misses
    assert a['retrieval']['i2t_R@5'] == b['retrieval']['i2t_R@5']
    # another seed is another checkpoint: its own cache folder
    ev3 = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, seed=1, progress=False)
    evaluate(ev3, world, ['retrieval'])
    assert ev3.cache.hits == 0 and ev3.ckpt_id != ev.ckpt_id


def test_missing_data_messages(world, tmp_path, capsys):
    base = ['run', '--model', 'powerclip-micro', '--out', str(tmp_path), '--cache', 'none', '--no-progress']
    (tmp_path / 'empty').mkdir()
    rc, _, err = _run(base + ['--data', str(tmp_path / 'empty'), '--tasks', 'winoground'], capsys)
    assert rc == 2 and 'data/examples.jsonl' in err and 'huggingface.co/datasets/facebook/winoground' in err
    rc, _, err = _run(base + ['--data', str(tmp_path / 'empty'), '--tasks', 'retrieval'], capsys)
    assert rc == 2 and 'retrieval.json' in err
    rc, _, err = _run(base + ['--data', str(tmp_path / 'empty')], capsys)       # all: nothing found
    assert rc == 2 and 'no data set in a known layout' in err
    rc, _, err = _run(base + ['--data', str(tmp_path / 'nothing')], capsys)
    assert rc == 2 and '--data: ' in err and 'does not exist' in err
    rc, _, err = _run(base + ['--data', str(world), '--tasks', 'bogus'], capsys)
    assert rc == 2 and "--tasks: unknown task 'bogus'" in err
    with pytest.raises(MissingData, match='checkpoint'):
        load_model('powerclip-micro', tmp_path / 'no.pt')


def test_checkpoint_formats(tmp_path):
    from powerclip.model import Encoder, create_model
    torch.manual_seed(5)
    model = create_model('powerclip-micro')[0]
    # the trainer's layout: {'model': Encoder.state_dict() ('model.' prefix), optimizer, numpy RNG states, ...}
    trainer = tmp_path / 'last.pt'
    torch.save(dict(model=Encoder(model).state_dict(), rng=[dict(numpy=np.random.get_state())],
                    config={'a': 1}), trainer)
    plain = tmp_path / 'plain.pt'
    torch.save({'state_dict': {'module.' + k: v for k, v in model.state_dict().items()}}, plain)
    for f in (trainer, plain):
        m = load_model('powerclip-micro', f)
        assert m.ckpt_id == sha256_file(f)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(m.model.state_dict()[k], v)
    with pytest.raises(ValueError, match='does not fit'):
        load_model('powerclip-tiny', plain)
    with pytest.raises(ValueError, match='pass --model'):
        load_model(None, plain)


def test_trainer_checkpoint_with_model_overrides(tmp_path):
    "A trainer run with `model.kwargs` (fewer layers, context 32) loads from the checkpoint alone."
    from powerclip.model import create_model
    kw = dict(vision_cfg=dict(image_size=32, layers=2, width=64, head_width=32, patch_size=8),
              text_cfg=dict(context_length=32, vocab_size=49408, width=32, heads=2, layers=2))
    torch.manual_seed(3)
    model = create_model('powerclip-micro', **kw)[0]
    f = tmp_path / 'last.pt'
    torch.save(dict(model=model.state_dict(),
                    config=dict(model=dict(name='powerclip-micro', pretrained=None, kwargs=kw))), f)
    m = load_model(None, f)
    assert m.spec == dict(name='powerclip-micro', kwargs=kw, pool='tok') and m.model.context_length == 32
    assert m.tokenizer(['a red circle']).shape == (1, 32)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(m.model.state_dict()[k], v)
    with pytest.raises(ValueError, match='does not fit'):
        load_model('powerclip-micro', f,
                   model_kwargs=dict(vision_cfg=dict(image_size=32, layers=1, width=64, head_width=32, patch_size=8)))


def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--help'], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and '--checkpoint' in r.stdout
    # the powerclip-eval console script of settings.ini is the same function
    import configparser, importlib
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / 'settings.ini')
    mod, fn = dict(x.split('=') for x in cfg['DEFAULT']['console_scripts'].split())['powerclip-eval'].split(':')
    assert getattr(importlib.import_module(mod), fn) is main


@needs_data
def test_coco_sample_real(tmp_path, capsys):
    argv = ['run', '--model', 'powerclip-micro', '--data', str(COCO), '--out', str(tmp_path), '--cache',
            str(tmp_path / 'c'), '--no-progress']
    rc, _, _ = _run(argv, capsys)
    assert rc == 0
    res = json.loads((tmp_path / 'random-init' / 'coco_sample.json').read_text())
    r, s = res['metrics']['retrieval'], res['metrics']['sugarcrepe']
    assert (r['n_images'], r['n_texts'], r['skipped']) == (239, 1195, 0)
    assert r['chance_t2i_R@1'] == pytest.approx(100 / 239)
    # the sample's instance masks: crowd regions and regions outside the centred square the model sees are skipped,
    # counted and named (the first 100); the rest are classified among COCO's 80 names, OV-COCO's novel ones apart
    reg, left = res['metrics']['regions'], res['skipped_items']['regions']
    assert set(res['skipped_items']) == {'regions'}
    assert (left['n'], left['counts']) == (168, {'crowd_region': 13, 'outside_view': 155})
    assert (reg['n_regions'], reg['classes'], reg['pooled_n_regions_base'], reg['pooled_n_regions_novel']) == (
        1195, 80, 886, 187)
    assert reg['chance_top1'] == pytest.approx(100 / 80)
    assert (sum(s[f'{c}_n'] for c in ('add_att', 'add_obj', 'replace_att', 'replace_obj', 'replace_rel', 'swap_att',
                                      'swap_obj')) == 211)
    # no classification or Winoground files in coco_sample: skipped with the reason recorded, not silently
    assert set(res['skipped']) == {'zeroshot', 'linear_probe', 'winoground', 'long_retrieval'}
    # the complete SugarCrepe text against the sample's photos: only items with a photo are scored, the rest counted
    rc, _, _ = _run(['run', '--model', 'powerclip-micro', '--data', str(DATA / 'sugarcrepe'), '--images',
                     str(COCO / 'images'),
                     '--tasks', 'sugarcrepe', '--out', str(tmp_path), '--cache', str(tmp_path / 'c'),
                     '--no-progress'], capsys)
    assert rc == 0
    res = json.loads((tmp_path / 'random-init' / 'sugarcrepe.json').read_text())
    full = res['metrics']['sugarcrepe']
    assert sum(v for k, v in full.items() if k.endswith('_n')) == 211
    assert sum(v for k, v in full.items() if k.endswith('_skipped')) == 7511 - 211
    # the result names why and which photos: every item whose photo is not in the sample (the first 100 listed)
    items = res['skipped_items']['sugarcrepe']
    assert (items['n'], items['counts'], items['items_left_out']) == (7300, {'missing_image': 7300}, 7200)
    assert all(i['reason'] == 'missing_image' and not Path(i['file']).exists() and i['group'] in SUGARCREPE
               for i in items['items'])


@pytest.mark.skipif(importlib.util.find_spec('clip_benchmark') is None, reason='clip_benchmark not installed')
def test_retrieval_matches_clip_benchmark():
    from clip_benchmark.metrics.zeroshot_retrieval import recall_at_k
    g = torch.Generator().manual_seed(0)
    for I, per in ((30, 1), (25, 5), (40, 3)):
        sim = torch.rand(I, I * per, generator=g)                 # continuous: no ties, where topk and our rule agree
        ti = torch.arange(I).repeat_interleave(per)
        pos = torch.zeros(I * per, I, dtype=torch.bool)
        pos[torch.arange(I * per), ti] = True
        ours = retrieval_recall(sim, ti, ks=(1, 5, 10))
        for k in (1, 5, 10):
            t2i = 100 * (recall_at_k(sim.T, pos, k) > 0).float().mean().item()
            i2t = 100 * (recall_at_k(sim, pos.T, k) > 0).float().mean().item()
            assert ours[f't2i_R@{k}'] == pytest.approx(t2i) and ours[f'i2t_R@{k}'] == pytest.approx(i2t)


@pytest.mark.skipif(importlib.util.find_spec('sklearn') is None, reason='scikit-learn not installed')
def test_logreg_matches_sklearn():
    from sklearn.linear_model import LogisticRegression
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(300, 6, generator=g), torch.randint(0, 4, (300,), generator=g)
    x = x + F.one_hot(y, 6).float()
    lam = 1e-2
    W, b = fit_logreg(x, y, 4, lam)
    sk = LogisticRegression(C=1 / (len(x) * lam), tol=1e-10, max_iter=5000).fit(x.numpy(), y.numpy())
    # same objective up to sklearn's softmax over-parametrisation: same probabilities
    p_ours = torch.softmax(x.double() @ W + b, 1).numpy()
    np.testing.assert_allclose(p_ours, sk.predict_proba(x.numpy()), atol=2e-3)


def test_always_one_class_and_chance():
    y = torch.tensor([0] * 7 + [1] * 3)
    m = classification_metrics(F.one_hot(torch.zeros(10, dtype=torch.long), 2).float(), y)
    assert m['top1'] == pytest.approx(70.0) and m['mean_per_class_recall'] == pytest.approx(50.0)
    assert chance_recall(239, 5, ks=(1,))['i2t_R@1'] == pytest.approx(100 * 5 / 1195)


def test_karpathy_json_and_missing_images(tmp_path, caplog):
    "Karpathy's dataset_*.json: only the requested split; rows whose photo is absent are counted, not silently lost."
    from PIL import Image
    (tmp_path / 'images' / 'val2014').mkdir(parents=True)
    for n in ('a.jpg', 'b.jpg', 'c.jpg'):
        Image.new('RGB', (8, 8)).save(tmp_path / 'images' / 'val2014' / n)
    rows = [dict(filepath='val2014', filename=n, split=sp, sentences=[dict(raw=f'{n} {k}') for k in range(2)])
            for n, sp in (('a.jpg', 'test'), ('b.jpg', 'train'), ('c.jpg', 'test'), ('gone.jpg', 'test'))]
    f = tmp_path / 'dataset_coco.json'
    f.write_text(json.dumps(dict(images=rows)))
    r = load_retrieval(f)
    assert ([p.name for p in r.images] == ['a.jpg', 'c.jpg'] and r.captions[1] == ['c.jpg 0', 'c.jpg 1']
            and r.skipped == 1)
    assert r.skips.counts() == {'missing_image': 1} and r.skips.items[0][1].endswith('gone.jpg')
    assert '1 bad parts skipped in 3 items (missing_image 1)' in caplog.text
    texts, ti = r.flat()
    assert texts[2] == 'c.jpg 0' and ti.tolist() == [0, 0, 1, 1]


def test_winoground_needs_both_images(tmp_path):
    from PIL import Image
    (tmp_path / 'data' / 'images').mkdir(parents=True)
    for n in ('x0', 'x1', 'y0'):
        Image.new('RGB', (8, 8)).save(tmp_path / 'data' / 'images' / f'{n}.png')
    rows = [dict(id=0, image_0='x0', image_1='x1', caption_0='a', caption_1='b'),
            dict(id=1, image_0='y0', image_1='y1', caption_0='c', caption_1='d')]
    (tmp_path / 'data' / 'examples.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    items, skips = load_winoground(tmp_path)
    assert len(items) == 1 and items[0][2:] == ('a', 'b')
    assert skips.counts() == {'missing_image': 1} and skips.items[0][1].endswith('y1.png')


def test_image_folder_classification(tmp_path, capsys):
    "root/{train,val,test}/<class>/*.png with templates.txt runs zero-shot and the linear probe."
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (('train', 6), ('val', 3), ('test', 4)):
        for c, colour in (('red_thing', (220, 40, 40)), ('blue_thing', (40, 60, 230))):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.clip(np.array(colour) + rng.normal(0, 20, (16, 16, 3)), 0,
                                        255).astype(np.uint8)).save(tmp_path / split / c / f'{i}.png')
    (tmp_path / 'test' / 'red_thing' / 'notes.txt').write_text('not an image')
    (tmp_path / 'templates.txt').write_text('a photo of a {c}.\na {c}.\n')
    cls = load_classification(tmp_path)
    assert cls.classnames == ['blue thing', 'red thing'] and cls.templates == ['a photo of a {c}.', 'a {c}.']
    assert {k: len(v[0]) for k, v in cls.splits.items()} == dict(train=12, val=6, test=8)
    assert cls.splits['test'][1].tolist() == [0] * 4 + [1] * 4
    rc = main(['run', '--model', 'powerclip-micro', '--data', str(tmp_path), '--tasks', 'zeroshot', 'linear_probe',
               '--out', str(tmp_path / 'res'), '--cache', 'none', '--no-progress'])
    assert rc == 0
    m = json.loads(next((tmp_path / 'res').rglob('*.json')).read_text())['metrics']
    assert m['zeroshot']['n'] == 8 and m['linear_probe']['n_test'] == 8


# ---- the world's benchmark folder, scorers, bad checkpoints -----------------------------------------------------

from powerclip.methods import GlobalScorer, Scorer
from powerclip.parsing import ParsedCaption
from powerclip.world import NEGATIVE_KINDS, Scene, WorldConfig, caption_truth, generate, render, spec_from_text

REAL_SUGARCREPE = DATA / 'sugarcrepe' / 'data'


def test_world_benchmark_loads_back(tmp_path):
    """The one writer's folder read back by the one reader: images are the scenes, negatives false, captions true, trees
    for all."""
    from PIL import Image
    cfg = WorldConfig(seed=11)
    summary = write_world_benchmark(tmp_path, 40, cfg, extras=False)
    assert json.loads((tmp_path / 'summary.json').read_text()) == summary
    assert WorldConfig(**json.loads((tmp_path / 'config.json').read_text())) == cfg
    scenes = json.loads((tmp_path / 'scenes.json').read_text())
    parses = json.loads((tmp_path / 'parses.json').read_text())
    assert len(list((tmp_path / 'images').glob('*.png'))) == 40 and not (tmp_path / 'classification.json').exists()
    items, skipped = load_sugarcrepe(tmp_path)
    for kind in NEGATIVE_KINDS:
        assert len(items[kind]) == summary['sugarcrepe'][kind] > 0 and skipped.count(kind) == 0
        raw = json.loads((tmp_path / 'data' / f'{kind}.json').read_text())
        assert list(raw) == [str(i) for i in range(len(raw))]
        for path, cap, neg in items[kind]:
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
    ret = load_retrieval(tmp_path / 'retrieval.json')
    caps, _ = ret.flat()
    assert len(caps) == len(set(caps)) == summary['retrieval_captions']
    assert summary['retrieval_images'] + summary['retrieval_skipped_images'] == 40
    # the same request again writes nothing; another one rewrites the folder
    mtime = (tmp_path / 'retrieval.json').stat().st_mtime_ns
    assert (write_world_benchmark(tmp_path, 40, cfg, extras=False) == summary
            and (tmp_path / 'retrieval.json').stat().st_mtime_ns == mtime)
    assert write_world_benchmark(tmp_path, 20, cfg, extras=False)['n_images'] == 20


@pytest.mark.skipif(not REAL_SUGARCREPE.exists(), reason=f'real SugarCrepe data not found at {REAL_SUGARCREPE}')
def test_world_benchmark_has_the_real_format(tmp_path):
    write_world_benchmark(tmp_path, 20, extras=False)
    for kind in NEGATIVE_KINDS:
        real = json.loads((REAL_SUGARCREPE / f'{kind}.json').read_text())
        ours = json.loads((tmp_path / 'data' / f'{kind}.json').read_text())
        r0, o0 = next(iter(real.items())), next(iter(ours.items()))
        assert type(r0[0]) is type(o0[0]) and set(r0[1]) == set(o0[1])
        assert all(isinstance(v, str) for v in o0[1].values())


def _run_folder(d, method=None, nan=False):
    "A plain model.pt with the trainer's config.yaml beside it (the layout of every run folder)."
    from powerclip.model import create_model
    torch.manual_seed(4)
    model = create_model('powerclip-micro')[0]
    if nan:
        with torch.no_grad():
            model.visual.proj.fill_(float('nan'))
    d.mkdir(parents=True)
    torch.save(model.state_dict(), d / 'model.pt')
    (d / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\n'
                                   + (f'method: {method}\nmethod_cfg: {{}}\n' if method else ''))
    return d


def test_every_scorer_of_the_method(world, tmp_path, capsys):
    """A FILIP run is scored by late interaction (the headline) and globally; features are cached per scorer; --method
    overrides."""
    run = _run_folder(tmp_path / 'filip', 'filip')
    out, cache = tmp_path / 'res', tmp_path / 'cache'
    base = ['run', '--checkpoint', str(run), '--data', str(world), '--out', str(out), '--cache', str(cache),
            '--no-progress', '--tasks', 'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe']
    rc, stdout, _ = _run(base + ['--label', 'filip'], capsys)
    assert rc == 0 and json.loads(stdout)['scorer'] == 'late'
    res = json.loads((out / 'filip' / f'{world.name}.json').read_text())
    assert (res['method'], res['scorer'], list(res['other_scorers'])) == ('filip', 'late', ['global'])
    assert set(res['metrics']) == {'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe'}
    assert set(res['other_scorers']['global']) == {'retrieval', 'sugarcrepe', 'zeroshot'}      # the probe: once
    names = {f.name.split('-')[0] + '-' + f.name.split('-')[1] for f in cache.rglob('*.pt')}
    assert {'img-late', 'img-global', 'txt-late', 'txt-global'} <= names
    # the same checkpoint as plain CLIP: the global numbers are the ones above
    rc, _, _ = _run(base + ['--label', 'as-clip', '--method', 'clip'], capsys)
    clip = json.loads((out / 'as-clip' / f'{world.name}.json').read_text())
    assert rc == 0 and (clip['scorer'], clip['other_scorers']) == ('global', {})
    strip = lambda m: {t: {k: v for k, v in d.items() if k != 'seconds'} for t, d in m.items()}
    assert (strip(clip['metrics'])
            == {**strip(res['other_scorers']['global']), 'linear_probe': strip(res['metrics'])['linear_probe']})
    rc, md, _ = _run(['table', str(out)], capsys)
    assert rc == 0 and '| retrieval [global] |' in md


def test_bad_checkpoints_are_one_line(world, tmp_path, capsys):
    base = ['run', '--data', str(world), '--tasks', 'retrieval', '--out', str(tmp_path / 'res'), '--cache', 'none',
            '--no-progress']
    rc, _, err = _run(base + ['--checkpoint', str(_run_folder(tmp_path / 'nan', 'clip', nan=True))], capsys)
    assert rc == 2 and 'non-finite weights' in err and 'visual.proj (NaN)' in err and len(err.strip().splitlines()) == 1
    rc, _, err = _run(base + ['--checkpoint', str(_run_folder(tmp_path / 'ok')), '--method', 'nosuch'], capsys)
    assert rc == 2 and 'unknown method' in err and len(err.strip().splitlines()) == 1
    rc, _, err = _run(base + ['--checkpoint', str(tmp_path / 'empty')], capsys)
    assert rc == 2 and 'checkpoint' in err


class _Constant(Scorer):
    "Every image-text pair scores the same: a stand-in for a collapsed model."
    name = 'constant'
    def image_features(self, model, images): return {'x': torch.zeros(len(images), 1)}
    def text_features(self, model, tokens): return {'x': torch.zeros(len(tokens), 1)}
    def scores(self, img, txt): return torch.zeros(len(img['x']), len(txt['x']))


def test_world_evaluation_counts_ties_against(world):
    """The demo's world numbers follow the one tie rule: a model whose scores are all equal gets 0 everywhere (topk gave
    hits)."""
    from dataclasses import replace
    from powerclip.eval.world_scores import evaluate_world
    lm = load_model('powerclip-micro')
    ev = Evaluator.of(replace(lm, scorers={'constant': _Constant(), 'global': GlobalScorer()}), progress=False)
    res = evaluate_world(ev, world)
    assert res['scorer'] == 'constant'
    assert all(v == 0 for k, v in res.items() if k != 'scorer' and not k.startswith('global:') and v == v)
    assert 0 < res['global:hn_mean'] < 100                       # the same model's global cosines are not tied


# ---- CLIP's benchmarks through clip_benchmark -------------------------------------------------------------------

from powerclip.eval.benchmarks import (BENCHMARKS, ROBUSTNESS, TABLE1, _NoDownload, clip_classnames,
                                       clip_templates, open_benchmark)
from powerclip.eval.data import SUGARCREPE
from powerclip.eval.tables import PAPER, paper_tables

FROM_DATA = {'cifar10', 'cifar100', 'food101', 'sun397', 'cars', 'fgvc_aircraft', 'dtd', 'stl10', 'vtab/resisc45'}


def test_every_classification_benchmark_has_clip_names_and_templates():
    """The 17 sets of Table 1 and the 6 of Table 3: CLIP's templates from the package; class names from it or, as in
    clip_benchmark, from the data."""
    assert len(TABLE1) == 17 and len(ROBUSTNESS) == 6
    paper_cols = ['Food101', 'CIFAR10', 'CIFAR100', 'SUN397', 'Cars', 'VOC07', 'Aircraft', 'DTD', 'OxfordPets',
                  'Caltech101', 'Flowers', 'STL10', 'EuroSAT', 'RESISC45', 'GTSRB', 'Country', 'PCam']
    assert [BENCHMARKS[n].column for n in TABLE1] == paper_cols
    assert ([BENCHMARKS[n].column for n in ROBUSTNESS]
            == ['ImgNet-1k', 'ImgNet-V2', 'ImgNet-A', 'ImgNet-R', 'ImgNet-O', 'ImgNet-S'])
    for n in TABLE1 + ROBUSTNESS:
        t = clip_templates(n)
        assert t and all('{c}' in x for x in t), n
        names = clip_classnames(n)
        if n in FROM_DATA:
            assert names is None, n
        else:
            # CLIP's ImageNet list has 2 repeated names (crane, maillot)
            assert names and all(isinstance(x, str) and x for x in names), n
        # every data set names the files a user must provide
        assert BENCHMARKS[n].files and (BENCHMARKS[n].marker or n == 'vtab/resisc45'), n
    assert clip_classnames('imagenet-r')[:2] == ['goldfish', 'great white shark']
    assert len(clip_templates('cifar10')) == 18 and len(clip_templates('imagenet1k')) == 80


def test_clip_benchmark_never_downloads(tmp_path):
    "clip_benchmark's SugarCrepe branch runs wget whatever `download` says: under the guard it raises instead."
    from clip_benchmark.datasets.builder import build_dataset
    with _NoDownload('sugar_crepe'):
        with pytest.raises(MissingData, match='wget'):
            build_dataset('sugar_crepe/add_att', root=str(tmp_path), transform=None, download=False,
                          task='image_caption_selection')
    assert not any(tmp_path.iterdir())
    with pytest.raises(MissingData, match='cifar-10-batches-py'):
        open_benchmark('cifar10', tmp_path / 'cifar10')
    (tmp_path / 'imagenet-a').mkdir()                  # present but empty: clip_benchmark's own error, as MissingData
    with pytest.raises(MissingData, match='imagenet-a'):
        open_benchmark('imagenet-a', tmp_path / 'imagenet-a')


def _bench_root(world, root):
    "A benchmark root built from the world (a test fixture only): a webdataset export, SugarCrepe in clip_benchmark's "
    "layout, Winoground and a Flickr8k-format Karpathy file."
    import shutil
    shutil.copytree(world / 'wds_shape', root / 'cifar10')
    sc = root / 'sugar_crepe'
    sc.mkdir(parents=True)
    for c in SUGARCREPE:
        if (world / 'data' / f'{c}.json').is_file():
            shutil.copy(world / 'data' / f'{c}.json', sc / f'{c}.json')
    shutil.copytree(world / 'images', sc / 'val2017')
    shutil.copytree(world / 'data', root / 'winoground' / 'data')
    fk = root / 'flickr8k'
    fk.mkdir()
    rows = json.loads((world / 'retrieval.json').read_text())
    lines = ['image,caption'] + [f"{r['image'][:-4]}.jpg,{c}" for r in rows for c in r['caption']]
    for r in rows:
        from PIL import Image
        Image.open(world / 'images' / r['image']).convert('RGB').save(fk / (r['image'][:-4] + '.jpg'))
    (fk / 'flickr8k_test_karpathy.txt').write_text('\n'.join(lines) + '\n')
    return root


def test_suite_and_paper_tables(world, tmp_path, capsys):
    root = _bench_root(world, tmp_path / 'bench')
    out = tmp_path / 'res'
    base = ['--model', 'powerclip-micro', '--out', str(out), '--cache', str(tmp_path / 'cache'), '--no-progress',
            '--label', 'rand']
    rc, stdout, _ = _run(['suite', '--root', str(root), *base], capsys)
    assert rc == 0
    rep = json.loads(stdout)
    assert set(rep['results']) == {'cifar10', 'flickr8k', 'sugar_crepe', 'winoground'}
    assert ('food-101/meta/test.json' in rep['skipped']['food101']
            and 'not the Karpathy' not in rep['skipped']['mscoco_captions'])
    res = {p.stem: json.loads(p.read_text()) for p in (out / 'rand').glob('*.json')}
    # SugarCrepe: the seven runs of clip_benchmark are one data set here, its JSON holds every category
    sc = res['sugar_crepe']['metrics']['sugarcrepe']
    cats = [c for c in SUGARCREPE if (root / 'sugar_crepe' / f'{c}.json').is_file()]
    assert len(cats) >= 5 and all(c in sc for c in cats)
    direct, _ = load_sugarcrepe(world)
    assert {c: sc[f'{c}_n'] for c in cats} == {c: len(direct[c]) for c in cats}
    # the webdataset export read by clip_benchmark gives the numbers our own reader gives on the same images
    zs = res['cifar10']['metrics']['zeroshot']
    assert zs['layout'] == 'wds' and zs['n'] == 100 and res['cifar10']['metrics']['linear_probe']['n_test'] == 100
    rc, _, _ = _run(['run', '--data', str(world), '--tasks', 'zeroshot', *base[:-2], '--label', 'json'], capsys)
    assert rc == 0
    assert json.loads((out / 'json' / f'{world.name}.json').read_text())['metrics']['zeroshot']['top1'] == zs['top1']
    fl = res['flickr8k']['metrics']['retrieval']
    assert (fl['karpathy_size_ok'] is False
            and fl['n_images'] == json.loads((world / 'summary.json').read_text())['retrieval_images'])
    # naming an absent benchmark stops with what to put where
    rc, _, err = _run(['suite', '--root', str(root), '--benchmarks', 'food101', *base], capsys)
    assert rc == 2 and 'food-101/meta/test.json' in err and 'wds_food101_test' in err
    # tables: the paper's layouts, this checkpoint as a row, the paper's numbers only in 'paper:' columns
    rc, md, _ = _run(['tables', str(out / 'rand'), '--out', str(tmp_path / 'tables'), '--paper',
                      'rand=PowerCLIP-S'], capsys)
    assert rc == 0
    t1 = (tmp_path / 'tables' / 'table1.csv').read_text().splitlines()
    head, row = t1[0].split(','), t1[1].split(',')
    assert head[:3] == ['checkpoint', 'Food101', 'CIFAR10'] and head[18] == 'Avg' and head[19] == 'paper: Food101'
    assert row[0] == 'rand' and row[1] == '' and float(row[2]) == pytest.approx(zs['top1'], abs=0.051) and row[18] == ''
    assert float(row[19]) == PAPER['table1']['PowerCLIP-S'][0]
    for t in ('table2', 'table4', 'table5', 'table9'):
        assert (tmp_path / 'tables' / f'{t}.md').is_file(), t
    assert not (tmp_path / 'tables' / 'table3.md').exists()          # no ImageNet result: no Table 3
    t4 = paper_tables(sorted((out / 'rand').glob('*.json')))['table4']
    assert t4[0][:4] == ['checkpoint', 'Obj', 'Att', 'Rel']
    assert t4[1][0][3] == (pytest.approx(sc['replace_rel']) if 'replace_rel' in cats else None)
    rc, _, err = _run(['tables', str(out / 'rand'), '--paper', 'rand=NoSuch'], capsys)
    assert rc == 2 and "--paper: unknown paper method 'NoSuch'" in err


def test_bf16_precision_cached_apart(world, tmp_path):
    ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False)
    ev16 = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False, precision='bf16')
    a, _ = evaluate(ev, world, ['retrieval'])
    b, _ = evaluate(ev16, world, ['retrieval'])
    assert ev16.cache.hits == 0 and ev16.cache.misses == ev.cache.misses     # bf16 features are not fp32's
    assert abs(a['retrieval']['t2i_R@10'] - b['retrieval']['t2i_R@10']) < 15


def test_clip_benchmark_cli_sugarcrepe_trap(world, tmp_path, capsys):
    "clip_benchmark's own CLI on the world's SugarCrepe (its layout), a project config registered with open_clip: one "
    "file per category when --output is templated; a fixed --output (which would keep one category) is refused."
    import shutil
    from powerclip.model import create_model
    torch.manual_seed(0)
    model = create_model('powerclip-micro')[0]
    ck = tmp_path / 'micro.pt'
    torch.save(model.state_dict(), ck)
    root = tmp_path / 'sc'
    root.mkdir()
    cats = [c for c in ('add_att', 'swap_obj', 'replace_att')
            if json.loads((world / 'data' / f'{c}.json').read_text())][:2]
    for c in cats:
        shutil.copy(world / 'data' / f'{c}.json', root / f'{c}.json')
    shutil.copytree(world / 'images', root / 'val2017')
    args = ['clip-benchmark', 'eval', '--dataset', *[f'sugar_crepe/{c}' for c in cats], '--dataset_root', str(root),
            '--model', 'powerclip-micro', '--pretrained', str(ck), '--no_amp', '--batch_size', '16',
            '--num_workers', '0']
    rc, _, err = _run(args + ['--output', str(tmp_path / 'one.json')], capsys)
    assert rc == 2 and '{dataset}' in err and not (tmp_path / 'one.json').exists()
    absent = next(c for c in SUGARCREPE if not (root / f'{c}.json').exists())
    rc, _, err = _run(args[:5] + [f'sugar_crepe/{absent}'] + args[5:]
                      + ['--output', str(tmp_path / '{dataset}.json')], capsys)
    assert rc == 2 and f'{absent}.json' in err                   # a category without its file: named, nothing fetched
    (tmp_path / 'out').mkdir()
    rc, _, err = _run(args + ['--output', str(tmp_path / 'out' / '{dataset}.json')], capsys)
    assert rc == 0, err
    files = sorted((tmp_path / 'out').glob('*.json'))
    assert [f.stem for f in files] == sorted(f'sugar_crepe_{c}' for c in cats)
    # the same checkpoint through our evaluator: the same accuracies (continuous scores, no ties)
    ev = Evaluator.build('powerclip-micro', ck, progress=False)
    ours, _ = evaluate(ev, world, ['sugarcrepe'])
    for c in cats:
        theirs = json.loads((tmp_path / 'out' / f'sugar_crepe_{c}.json').read_text())['metrics']
        assert 100 * theirs['acc'] == pytest.approx(ours['sugarcrepe'][c], abs=1e-4), c   # theirs: a float32 mean


# ---- issue 14: a broken model never gets a score ----------------------------------------------------------------

from powerclip.eval.models import NonFiniteFeatures, NonFiniteWeights
from powerclip.eval.tasks import find_data, _run_tasks
from powerclip.eval.world_scores import evaluate_world


def _broken_state(kind):
    "A micro model's state dict with every float tensor NaN, one tensor NaN, or one value infinite."
    from powerclip.model import create_model
    torch.manual_seed(4)
    sd = create_model('powerclip-micro')[0].state_dict()
    if kind == 'all_nan':
        return {k: torch.full_like(v, float('nan')) if v.is_floating_point() else v for k, v in sd.items()}
    if kind == 'one_nan_tensor':
        sd['transformer.resblocks.0.attn.in_proj_weight'].fill_(float('nan'))
    if kind == 'one_inf':
        sd['visual.conv1.weight'].view(-1)[7] = float('inf')
    return sd


@needs_data
@pytest.mark.parametrize('kind, trainer',
                         [('all_nan', False), ('one_nan_tensor', False), ('one_inf', False), ('all_nan', True)])
def test_broken_checkpoint_never_scores(kind, trainer, tmp_path, capsys):
    "The issue's case: NaN (or Inf) weights on the real COCO sample gave R@1 = 100; now: one line, exit 2, no result."
    run = tmp_path / 'run'
    run.mkdir()
    cfg = dict(model=dict(name='powerclip-micro', kwargs={}), method='clip')
    if trainer:
        torch.save(dict(model=_broken_state(kind), config=cfg, step=10), run / 'last.pt')
    else:
        torch.save(_broken_state(kind), run / 'model.pt')
        (run / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\nmethod: clip\n')
    out = tmp_path / 'res'
    rc, stdout, err = _run(['run', '--checkpoint', str(run / ('last.pt' if trainer else 'model.pt')), '--data',
                            str(COCO), '--out', str(out), '--cache', str(tmp_path / 'cache'), '--no-progress'], capsys)
    assert rc == 2 and stdout == '' and len(err.strip().splitlines()) == 1, err
    assert err.startswith('powerclip-eval: error: --checkpoint: ') and 'non-finite weights' in err
    named = {'one_nan_tensor': 'transformer.resblocks.0.attn.in_proj_weight (NaN)',
             'one_inf': 'visual.conv1.weight (Inf)'}.get(kind, '38 of 38')
    assert named in err
    assert not list(out.rglob('*.json')) and not (tmp_path / 'cache').exists()
    with pytest.raises(NonFiniteWeights):
        load_model(checkpoint=run / ('last.pt' if trainer else 'model.pt'))


def test_nonfinite_features_stop_every_task_and_the_world(world):
    """Past the loader (NaN put into a loaded model): every task type and the world evaluation stop, none returns a
    number."""
    lm = load_model('powerclip-micro')
    with torch.no_grad():
        for q in lm.model.parameters():
            q.fill_(float('nan'))
    ev = Evaluator.of(lm, progress=False)
    found, skipped = find_data(world)
    assert set(found) == {'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground', 'regions',
                          'long_retrieval'}
    assert not skipped
    for task, args in found.items():
        with pytest.raises(NonFiniteFeatures, match='non-finite'):
            _run_tasks(ev, {task: args}, 'global')
    with pytest.raises(NonFiniteFeatures, match='non-finite image features'):
        evaluate_world(ev, world)


def test_nan_scores_are_never_hits():
    "The metrics' own defence, whatever produced the scores: NaN scores give 0 on every metric; the probe refuses NaN."
    from powerclip.eval.metrics import hard_negative_accuracy, winoground_scores
    nan = float('nan')
    assert all(v == 0
               for v in retrieval_recall(torch.full((6, 12), nan), torch.arange(6).repeat_interleave(2)).values())
    m = classification_metrics(torch.full((8, 5), nan), torch.arange(8) % 5, ks=(1, 3))
    assert m['top1'] == m['top3'] == m['mean_per_class_recall'] == 0
    assert hard_negative_accuracy(torch.full((4,), nan), torch.zeros(4))['acc'] == 0
    assert hard_negative_accuracy(torch.zeros(4), torch.full((4,), nan))['acc'] == 0
    assert all(winoground_scores(torch.full((3, 2, 2), nan))[k] == 0 for k in ('text', 'image', 'group'))
    ok = (torch.randn(12, 4), torch.arange(12) % 3)
    with pytest.raises(ValueError, match='non-finite'):
        linear_probe(ok, ok, (torch.full((6, 4), nan), torch.arange(6) % 3), 3)


def _overflow_bf16_run(d):
    """Finite weights whose image features are finite in float32 but overflow to inf/NaN in bfloat16 (see
    62_eval_models)."""
    from powerclip.model import create_model
    torch.manual_seed(4)
    model = create_model('powerclip-micro')[0]
    with torch.no_grad():
        v = model.visual
        v.ln_post.weight.zero_()
        v.ln_post.bias.zero_()
        v.ln_post.bias[0] = 1.0
        v.proj.zero_()
        v.proj[0] = 3.4e38                        # < float32 max (3.40e38), > bfloat16 max (3.39e38)
    d.mkdir(parents=True)
    torch.save(model.state_dict(), d / 'model.pt')
    (d / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\nmethod: clip\n')
    return d


def test_bf16_overflow_stops_with_one_line(world, tmp_path, capsys):
    run = _overflow_bf16_run(tmp_path / 'overflow')
    base = ['run', '--checkpoint', str(run), '--data', str(world), '--out', str(tmp_path / 'res'), '--cache', 'none',
            '--no-progress']
    rc, stdout, err = _run(base + ['--precision', 'bf16'], capsys)
    assert rc == 2 and stdout == '' and len(err.strip().splitlines()) == 1, err
    assert 'non-finite image features' in err and 'precision bf16' in err and 'try --precision fp32' in err
    assert not list((tmp_path / 'res').rglob('*.json'))
    # float32: finite features (all zero after normalising an overflowing norm), every score tied: ties count against
    rc, stdout, _ = _run(base + ['--tasks', 'retrieval', 'sugarcrepe', 'winoground'], capsys)
    assert rc == 0
    m = json.loads(stdout)['metrics']
    assert (m['retrieval']['i2t_R@10'] == m['retrieval']['t2i_R@10'] == m['sugarcrepe']['mean']
            == m['winoground']['group'] == 0)


# ---- issue 14: bad files are skipped, counted and named (or stop, in strict mode) --------------------------------

def _corrupt(f: Path, how: str):
    b = f.read_bytes()
    if how == 'truncated':
        f.write_bytes(b[:len(b) // 2])
    elif how == 'scrambled':
        f.write_bytes(b[:2] + np.random.default_rng(0).integers(0, 256, len(b) - 2, dtype=np.uint8).tobytes())
    elif how == 'zero_byte':
        f.write_bytes(b'')
    elif how == 'missing':
        f.unlink()


@needs_data
def test_bad_photos_and_captions_in_retrieval(tmp_path, capsys):
    """Real COCO photos, each kind of bad file and caption: skipped, counted by reason, named; the ground truth stays
    consistent."""
    import shutil
    rows = [json.loads(l) for l in (COCO / 'captions.jsonl').read_text().splitlines()][:12]
    d = tmp_path / 'coco_bad'
    (d / 'images').mkdir(parents=True)
    for r in rows:
        shutil.copy(COCO / 'images' / r['file_name'], d / 'images' / r['file_name'])
    name = [r['file_name'] for r in rows]
    for k, how in enumerate(('truncated', 'scrambled', 'zero_byte', 'missing'), 8):
        _corrupt(d / 'images' / name[k], how)
    rows[0]['captions'][1] = None
    rows[1]['captions'][0] = ''
    rows[2]['captions'][4] = 42
    rows[3]['captions'][2] = '... !!'
    # nothing usable: the photo is dropped
    rows[4]['captions'] = [None, '', ' ', '?', 3]
    (d / 'captions.jsonl').write_text(''.join(json.dumps({**r, 'sugarcrepe': []}) + '\n' for r in rows))
    out = tmp_path / 'res'
    base = ['run', '--model', 'powerclip-micro', '--data', str(d), '--tasks', 'retrieval', '--cache', 'none',
            '--no-progress']
    rc, stdout, _ = _run(base + ['--out', str(out)], capsys)
    assert rc == 0
    res = json.loads((out / 'random-init' / 'coco_bad.json').read_text())
    r, items = res['metrics']['retrieval'], res['skipped_items']['retrieval']
    assert (r['n_images'], r['n_texts']) == (7, 7 * 5 - 4) and r['skipped'] == items['n'] == 14
    assert items['counts'] == dict(missing_image=1, bad_image=3, bad_caption=4 + 5, no_caption=1)
    by = lambda reason: sorted(Path(i['file']).name for i in items['items'] if i['reason'] == reason)
    assert by('bad_image') == sorted(name[8:11]) and by('missing_image') == [name[11]] and by('no_caption') == [name[4]]
    assert sorted(set(by('bad_caption'))) == sorted(name[:5])
    details = {i['detail'] for i in items['items']}
    assert ({'caption 1: no caption', 'caption 0: empty caption', 'caption 4: caption is int, not text (42)',
             'caption 2: no letter or digit'} <= details)
    assert any('truncated' in x for x in details) and 'zero bytes' in details
    assert json.loads(stdout)['skipped_items'] == {'retrieval': items['counts']}
    # the numbers are those of the clean set: the same photos and captions written without the bad ones
    clean = tmp_path / 'coco_clean'
    shutil.copytree(d / 'images', clean / 'images')
    keep = [dict(file_name=name[i],
                 captions=[c for c in rows[i]['captions'] if isinstance(c, str) and any(ch.isalnum() for ch in c)],
                 sugarcrepe=[]) for i in range(8) if i != 4]
    (clean / 'captions.jsonl').write_text(''.join(json.dumps(k) + '\n' for k in keep))
    rc, stdout2, _ = _run(['run', '--model', 'powerclip-micro', '--data', str(clean), '--tasks', 'retrieval', '--cache',
                           'none', '--no-progress', '--out', str(tmp_path / 'res2')], capsys)
    strip = lambda m: {k: v for k, v in m.items() if k not in ('seconds', 'skipped')}
    assert rc == 0 and strip(json.loads(stdout2)['metrics']['retrieval']) == strip(r)
    # strict: the first bad item stops the run, one line naming its file, before a model is built; nothing written
    rc, _, err = _run(base + ['--out', str(tmp_path / 'strict'), '--strict'], capsys)
    assert (rc == 2 and len(err.strip().splitlines()) == 1 and name[0] in err and 'bad caption' in err
            and '[strict mode]' in err)
    assert not (tmp_path / 'strict').exists()


def test_bad_items_in_every_task(world, tmp_path, capsys):
    """A world folder with a bad image, caption, SugarCrepe negative, class image and Winoground image: each task skips
    and names it."""
    import shutil
    d = tmp_path / 'w'
    shutil.copytree(world, d, ignore=shutil.ignore_patterns('wds_shape'))
    ret = json.loads((d / 'retrieval.json').read_text())
    _corrupt(d / 'images' / ret[0]['image'], 'truncated')                    # shared by retrieval and SugarCrepe
    ret[1]['caption'][0] = None
    (d / 'retrieval.json').write_text(json.dumps(ret))
    kind = next(k for k in SUGARCREPE if (d / 'data' / f'{k}.json').is_file()
                and len(json.loads((d / 'data' / f'{k}.json').read_text())) > 3)
    sc = json.loads((d / 'data' / f'{kind}.json').read_text())
    keys = [k for k, v in sc.items() if v['filename'] != ret[0]['image']]
    sc[keys[0]]['negative_caption'] = ''
    sc[keys[1]]['caption'] = None
    (d / 'data' / f'{kind}.json').write_text(json.dumps(sc))
    cls = json.loads((d / 'classification.json').read_text())
    _corrupt(d / cls['splits']['test'][0]['image'], 'zero_byte')
    _corrupt(d / cls['splits']['train'][0]['image'], 'missing')
    wg = [json.loads(l) for l in (d / 'data' / 'examples.jsonl').read_text().splitlines()]
    _corrupt(d / 'data' / 'images' / f"{wg[0]['image_1']}.png", 'scrambled')
    out = tmp_path / 'res'
    rc, _, _ = _run(['run', '--model', 'powerclip-micro', '--data', str(d), '--out', str(out), '--cache', 'none',
                     '--no-progress'], capsys)
    assert rc == 0
    res = json.loads((out / 'random-init' / 'w.json').read_text())
    items, m = res['skipped_items'], res['metrics']
    files = lambda task, reason: [Path(i['file']).name for i in items[task]['items'] if i['reason'] == reason]
    assert (files('retrieval', 'bad_image') == [ret[0]['image']]
            and files('retrieval', 'bad_caption') == [ret[1]['image']])
    assert (m['retrieval']['n_images'] == len(ret) - 1
            and m['retrieval']['n_texts'] == sum(map(len, (r['caption'] for r in ret[1:]))) - 1)
    assert (files('sugarcrepe', 'bad_negative') == [sc[keys[0]]['filename']]
            and files('sugarcrepe', 'bad_caption') == [sc[keys[1]]['filename']])
    assert ret[0]['image'] in files('sugarcrepe', 'bad_image')
    n_kind = sum(1 for v in sc.values() if v['filename'] != ret[0]['image']) - 2
    assert m['sugarcrepe'][f'{kind}_n'] == n_kind and m['sugarcrepe'][f'{kind}_skipped'] == len(sc) - n_kind
    assert items['zeroshot']['counts'] == items['linear_probe']['counts'] == dict(missing_image=1, bad_image=1)
    assert m['zeroshot']['n'] == len(cls['splits']['test']) - 1 and m['zeroshot']['skipped'] == 1
    assert (m['linear_probe']['n_train'] + m['linear_probe']['n_val']
            == len(cls['splits']['train']) + len(cls['splits']['val']) - 1)
    assert files('winoground', 'bad_image') == [f"{wg[0]['image_1']}.png"] and m['winoground']['n'] == len(wg) - 1
    rc, _, err = _run(['run', '--model', 'powerclip-micro', '--data', str(d), '--tasks', 'winoground', '--strict',
                       '--out', str(tmp_path / 'strict'), '--cache', 'none'], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and f"{wg[0]['image_1']}.png: bad image" in err


def test_bad_annotation_files_are_one_line(tmp_path, capsys):
    "An annotation file that is not JSON, or rows without their keys: one line naming the file."
    (tmp_path / 'images').mkdir()
    (tmp_path / 'retrieval.json').write_text('[{"image": "a.jpg", "caption": ["x"]')
    rc, _, err = _run(['run', '--model', 'powerclip-micro', '--data', str(tmp_path), '--tasks', 'retrieval', '--cache',
                       'none'], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and 'retrieval.json: not valid JSON' in err
    (tmp_path / 'retrieval.json').write_text('[{"img": "a.jpg", "caption": ["x"]}]')
    rc, _, err = _run(['run', '--model', 'powerclip-micro', '--data', str(tmp_path), '--tasks', 'retrieval', '--cache',
                       'none'], capsys)
    assert rc == 2 and "retrieval.json: an item without 'image'" in err


# ---- issue 14: results of two checkpoints never overwrite each other ---------------------------------------------

def test_results_of_two_checkpoints_never_overwrite(world, tmp_path, capsys, caplog):
    from powerclip.model import create_model
    runs = {}
    for seed, where in enumerate(('a/run', 'b/run', 'c/other')):
        d = tmp_path / where
        d.mkdir(parents=True)
        torch.manual_seed(seed)
        sd = create_model('powerclip-micro')[0].state_dict()
        if where == 'c/other':
            (d / 'checkpoints').mkdir()
            torch.save(dict(model=sd, config=dict(model=dict(name='powerclip-micro'), method='clip')),
                       d / 'checkpoints' / 'last.pt')
            runs[where] = d / 'checkpoints' / 'last.pt'
        else:
            torch.save(sd, d / 'model.pt')
            (d / 'config.yaml').write_text('model:\n  name: powerclip-micro\nmethod: clip\n')
            runs[where] = d / 'model.pt'
    out = tmp_path / 'res'
    labels = []
    for where, ck in runs.items():
        rc, stdout, _ = _run(['run', '--checkpoint', str(ck), '--data', str(world), '--tasks', 'retrieval', '--out',
                              str(out), '--cache', 'none', '--no-progress'], capsys)
        assert rc == 0
        labels.append(json.loads(stdout)['label'])
    sha8 = sha256_file(runs['b/run'])[:8]
    assert labels == ['run', f'run-{sha8}', 'other']
    assert f"written under 'run-{sha8}'" in caplog.text
    results = {p.parent.name: json.loads(p.read_text()) for p in out.glob('*/*.json')}
    assert {k: r['sha256'] for k, r in results.items()} == {l: sha256_file(runs[w]) for l, w in zip(labels, runs)}
    # the same checkpoint again replaces its own result, under its own label
    rc, stdout, _ = _run(['run', '--checkpoint', str(runs['a/run'].parent), '--data', str(world), '--tasks',
                          'retrieval', '--out', str(out), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 0 and json.loads(stdout)['label'] == 'run' and len(list(out.glob('*/*.json'))) == 3
    # an explicit label that another checkpoint holds is kept apart too
    rc, stdout, _ = _run(['run', '--checkpoint', str(runs['c/other']), '--data', str(world), '--tasks', 'retrieval',
                          '--label', 'run', '--out', str(out), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 0 and json.loads(stdout)['label'] == f"run-{sha256_file(runs['c/other'])[:8]}"
    rc, md, _ = _run(['table', str(out)], capsys)
    assert rc == 0 and md.splitlines()[0].count('|') == 3 + 4 + 1      # dataset, task, metric + four columns


# ---- issue 14: clip_benchmark's zero-shot task under the pinned stack ---------------------------------------------

def test_clip_benchmark_zeroshot_matches_ours(world, tmp_path, capsys, monkeypatch):
    """clip_benchmark's own zero-shot run (its webdataset reader, classifier and accuracy) through our CLI equals our
    evaluator."""
    from powerclip.eval.benchmarks import open_wds
    from powerclip.eval.tasks import task_zeroshot
    from powerclip.model import create_model
    from clip_benchmark.metrics import zeroshot_classification
    torch.manual_seed(6)
    ck = tmp_path / 'micro.pt'
    torch.save(create_model('powerclip-micro')[0].state_dict(), ck)
    def numpy_24(*a, **k):
        raise TypeError('only 0-dimensional arrays can be converted to Python scalars')
    # what clip_benchmark 1.6.2 does under NumPy 2.4
    monkeypatch.setattr(zeroshot_classification, 'accuracy', numpy_24)
    out = tmp_path / 'cb'
    rc, _, err = _run(['clip-benchmark', 'eval', '--dataset', 'wds/shape', '--dataset_root', str(world / 'wds_shape'),
                       '--task', 'zeroshot_classification', '--model', 'powerclip-micro', '--pretrained',
                       str(ck), '--no_amp',
                       '--batch_size', '32', '--num_workers', '0', '--output', str(out / '{dataset}.json')], capsys)
    assert rc == 0, err
    assert zeroshot_classification.accuracy is numpy_24                           # patched only while it ran
    theirs = json.loads((out / 'shape.json').read_text())['metrics']        # clip_benchmark's {dataset} drops 'wds/'
    ours = task_zeroshot(Evaluator.build('powerclip-micro', ck, progress=False), open_wds(world / 'wds_shape'))
    assert ours['n'] == 100
    assert 100 * theirs['acc1'] == pytest.approx(ours['top1'], abs=1e-9)
    assert 100 * theirs['mean_per_class_recall'] == pytest.approx(ours['mean_per_class_recall'], abs=1e-6)
    # a diverged checkpoint is refused before clip_benchmark loads it
    bad = tmp_path / 'nan.pt'
    torch.save(_broken_state('one_nan_tensor'), bad)
    rc, _, err = _run(['clip-benchmark', 'eval', '--dataset', 'wds/shape', '--dataset_root', str(world / 'wds_shape'),
                       '--model', 'powerclip-micro', '--pretrained', str(bad), '--output', str(out / 'x.json')], capsys)
    assert rc == 2 and 'non-finite weights' in err and len(err.strip().splitlines()) == 1


# ---- issue 14: no false "initialized randomly" -------------------------------------------------------------------

def test_no_false_random_init_line(tmp_path, caplog, capsys):
    import logging
    run = _run_folder(tmp_path / 'run', 'clip')           # (open_clip says 'initialized randomly' here, rightly)
    caplog.set_level(logging.INFO)
    caplog.clear()
    load_model(checkpoint=run)
    assert 'initialized randomly' not in caplog.text and 'random initialisation' not in caplog.text
    caplog.clear()
    load_model('powerclip-micro', seed=2)
    assert 'initialized randomly' not in caplog.text
    assert [r.getMessage() for r in caplog.records if 'random' in r.getMessage()] == \
        ['no checkpoint given: powerclip-micro is a random initialisation (seed 2), an untrained model']
    # the command line in a fresh process, as a user sees it
    r = (subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--checkpoint', str(run), '--data',
                        str(tmp_path / 'w'),
                        '--tasks', 'retrieval', '--out', str(tmp_path / 'res'), '--cache', 'none', '--no-progress'],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
         if write_world_benchmark(tmp_path / 'w', 8, extras=False) else None)
    assert r.returncode == 0, r.stderr
    assert 'initialized randomly' not in r.stderr and 'random initialisation' not in r.stderr


# ---- the command line convention (powerclip.commandline) ---------------------------------------------------------

def test_usage_errors_are_one_line_before_any_model(world, tmp_path, capsys, monkeypatch):
    import powerclip.model
    from powerclip.commandline import UsageError
    def no_model(*a, **k):
        raise AssertionError('a model was built before the arguments were checked')
    monkeypatch.setattr(powerclip.model, 'create_model', no_model)
    (tmp_path / 'afile').write_text('x')
    (tmp_path / 'empty').mkdir()
    f, e, w, nope = str(tmp_path / 'afile'), str(tmp_path / 'empty'), str(world), str(tmp_path / 'nope')
    cases = [
        (['nosuch'], "argument cmd: invalid choice: 'nosuch'"),
        (['run', '--data', w, '--nosuch'], 'unrecognized arguments: --nosuch'),
        (['run'], 'the following arguments are required: --data'),
        (['run', '--data', nope], f'--data: {nope} does not exist'),
        (['run', '--data', e], 'no data set in a known layout'),
        (['run', '--data', w, '--checkpoint', nope], f'--checkpoint: {nope} does not exist'),
        (['run', '--data', w, '--checkpoint', e], 'no checkpoint in a known layout'),
        (['run', '--data', w, '--checkpoint', f], f'--checkpoint: {f}: not a checkpoint torch can read'),
        (['run', '--data', w, '--method', 'nosuch'], "--method: unknown method 'nosuch'; registered: ["),
        (['run', '--data', w, '--model', 'nosuch'], "--model: unknown architecture 'nosuch'"),
        (['run', '--data', w, '--out', f], f'--out: {f} is a file'),
        (['run', '--data', w, '--cache', f], f'--cache: {f} is a file'),
        (['run', '--data', w, '--tasks', 'retrieval', 'bogus'], "--tasks: unknown task 'bogus'"),
        (['run', '--data', w, '--batch-size', '0'], 'argument --batch-size: 0 (an integer >= 1)'),
        (['run', '--data', w, '--model-kwargs', '[1]'], 'argument --model-kwargs: a JSON object'),
        (['run', '--data', w, '--device', 'nodevice'], "--device: 'nodevice' is not a device"),
        (['run', '--data', w, '--precision', 'fp8'], "argument --precision: invalid choice: 'fp8'"),
        (['run', '--data', w, '--label', 'a/b'], "--label: 'a/b' is not a folder name"),
        (['run', '--data', w, '--images', nope], f'--images: {nope} is not a folder'),
        (['suite', '--root', nope], f'--root: {nope} is not a folder'),
        (['suite', '--root', e], f'--root: no benchmark folder under {e}'),
        (['suite', '--root', e, '--benchmarks', 'nosuch'], "--benchmarks: unknown benchmark 'nosuch'"),
        (['suite', '--root', e, '--benchmarks', 'cifar10'], '--benchmarks: cifar10 (CIFAR10): not found under'),
        (['tables', nope], f'results: {nope} does not exist'),
        (['tables', w, '--paper', 'x'], "--paper: 'x' is not LABEL=METHOD"),
        (['table', nope], f'results: {nope} does not exist'),
        (['make-world', f], f'out: {f} is a file'),
        (['make-world', str(tmp_path / 'w'), '--n-images', '0'], 'argument --n-images: 0 (an integer >= 1)'),
        (['clip-benchmark', 'eval', '--nosuch'], 'unrecognized arguments: --nosuch'),
        (['clip-benchmark', 'eval', '--dataset', 'wds/x', '--model', 'powerclip-micro', '--pretrained',
          'laion400m_e32'],
         "--pretrained: 'laion400m_e32' is not a local checkpoint file"),
        (['clip-benchmark', 'eval', '--model', 'nosuch', '--pretrained', f], "--model: unknown architecture 'nosuch'"),
    ]
    for argv, says in cases:
        rc, stdout, err = _run(argv, capsys)
        assert (rc == 2 and err.startswith('powerclip-eval: error: ') and err.count('\n') == 1
                and says in err), (argv, rc, err)
    with pytest.raises(UsageError, match='does not exist'):          # --debug: the traceback
        main(['run', '--data', nope, '--debug'])
    # and as a process: exit status 2, one line on stderr, nothing on stdout
    r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--data', e], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stdout == '' and r.stderr.count('\n') == 1 and 'known layout' in r.stderr, r.stderr


def test_bad_file_inside_a_webdataset_is_one_line(world, tmp_path, capsys):
    """clip_benchmark's reader cannot skip a bad member of a shard: one line naming the shard and the key, not a bare
    DecodingError."""
    import io, shutil, tarfile
    d = tmp_path / 'wds'
    shutil.copytree(world / 'wds_shape', d)
    with tarfile.open(d / 'test' / '0.tar') as tf:
        members = [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(d / 'test' / '0.tar', 'w') as tf:
        for name, b in members:
            if name == '000003.png':
                b = b[:len(b) // 2]
            info = tarfile.TarInfo(name)
            info.size = len(b)
            tf.addfile(info, io.BytesIO(b))
    rc, _, err = _run(['run', '--model', 'powerclip-micro', '--data', str(d), '--tasks', 'zeroshot', '--out',
                       str(tmp_path / 'res'), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and 'test/0.tar' in err and 'key 000003' in err, err
    assert not (tmp_path / 'res').exists()


def test_suite_writes_nothing_for_a_model_that_overflows(world, tmp_path, capsys):
    "The suite scores every benchmark before it writes: a checkpoint whose features overflow leaves no result at all."
    root = _bench_root(world, tmp_path / 'bench')
    run = _overflow_bf16_run(tmp_path / 'overflow')
    rc, stdout, err = _run(['suite', '--root', str(root), '--checkpoint', str(run), '--precision', 'bf16', '--out',
                            str(tmp_path / 'res'), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 2 and stdout == '' and len(err.strip().splitlines()) == 1 and 'precision bf16' in err
    assert not list((tmp_path / 'res').rglob('*.json'))
