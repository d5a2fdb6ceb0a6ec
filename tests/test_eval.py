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
    argv = ['run', '--model', 'powerclip-micro', '--data', str(world), '--out', str(out), '--cache', str(cache), '--no-progress']
    rc, stdout, _ = _run(argv, capsys)
    assert rc == 0
    res = json.loads((out / 'random-init' / f'{world.name}.json').read_text())
    assert set(res['metrics']) == {'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe', 'winoground'}
    assert res['sha256'] == 'random-init' and res['skipped'] == {}
    assert res['command'].startswith('powerclip-eval run --model powerclip-micro')
    m = res['metrics']
    summary = json.loads((world / 'summary.json').read_text())
    assert m['retrieval']['n_images'] == summary['retrieval_images']
    assert m['retrieval']['n_texts'] == summary['retrieval_captions']
    for kind, n in summary['sugarcrepe'].items():
        if n: assert m['sugarcrepe'][f'{kind}_n'] == n
    assert m['zeroshot']['n'] == 100 and m['zeroshot']['n_classes'] == 5
    assert (m['linear_probe']['n_train'], m['linear_probe']['n_val'], m['linear_probe']['n_test']) == (100, 50, 100)
    for task in m.values():
        for k, v in task.items():
            if isinstance(v, float) and not k.startswith(('lambda', 'seconds')): assert 0 <= v <= 100, (k, v)
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
    rc, _, err = _run(base + ['--data', str(tmp_path / 'nothing'), '--tasks', 'winoground'], capsys)
    assert rc == 2 and 'data/examples.jsonl' in err and 'huggingface.co/datasets/facebook/winoground' in err
    rc, _, err = _run(base + ['--data', str(tmp_path / 'nothing'), '--tasks', 'retrieval'], capsys)
    assert rc == 2 and 'retrieval.json' in err
    rc, _, err = _run(base + ['--data', str(tmp_path / 'nothing')], capsys)       # all: nothing found
    assert rc == 2 and 'no task found its data' in err
    rc, _, err = _run(base + ['--data', str(world), '--tasks', 'bogus'], capsys)
    assert rc == 2 and 'unknown tasks' in err
    with pytest.raises(MissingData, match='checkpoint'):
        load_model('powerclip-micro', tmp_path / 'no.pt')


def test_checkpoint_formats(tmp_path):
    from powerclip.model import Encoder, create_model
    torch.manual_seed(5)
    model = create_model('powerclip-micro')[0]
    # the trainer's layout: {'model': Encoder.state_dict() ('model.' prefix), optimizer, numpy RNG states, ...}
    trainer = tmp_path / 'last.pt'
    torch.save(dict(model=Encoder(model).state_dict(), rng=[dict(numpy=np.random.get_state())], config={'a': 1}), trainer)
    plain = tmp_path / 'plain.pt'
    torch.save({'state_dict': {'module.' + k: v for k, v in model.state_dict().items()}}, plain)
    for f in (trainer, plain):
        m = load_model('powerclip-micro', f)
        assert m.ckpt_id == sha256_file(f)
        for k, v in model.state_dict().items(): torch.testing.assert_close(m.model.state_dict()[k], v)
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
    torch.save(dict(model=model.state_dict(), config=dict(model=dict(name='powerclip-micro', pretrained=None, kwargs=kw))), f)
    m = load_model(None, f)
    assert m.spec == dict(name='powerclip-micro', kwargs=kw) and m.model.context_length == 32
    assert m.tokenizer(['a red circle']).shape == (1, 32)
    for k, v in model.state_dict().items(): torch.testing.assert_close(m.model.state_dict()[k], v)
    with pytest.raises(ValueError, match='does not fit'):
        load_model('powerclip-micro', f, model_kwargs=dict(vision_cfg=dict(image_size=32, layers=1, width=64, head_width=32, patch_size=8)))


def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--help'], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and '--checkpoint' in r.stdout
    # the powerclip-eval console script of settings.ini is the same function
    import configparser, importlib
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    mod, fn = dict(x.split('=') for x in cfg['DEFAULT']['console_scripts'].split())['powerclip-eval'].split(':')
    assert getattr(importlib.import_module(mod), fn) is main


@needs_data
def test_coco_sample_real(tmp_path, capsys):
    argv = ['run', '--model', 'powerclip-micro', '--data', str(COCO), '--out', str(tmp_path), '--cache', str(tmp_path / 'c'), '--no-progress']
    rc, _, _ = _run(argv, capsys)
    assert rc == 0
    res = json.loads((tmp_path / 'random-init' / 'coco_sample.json').read_text())
    r, s = res['metrics']['retrieval'], res['metrics']['sugarcrepe']
    assert (r['n_images'], r['n_texts'], r['skipped']) == (239, 1195, 0)
    assert r['chance_t2i_R@1'] == pytest.approx(100 / 239)
    assert sum(s[f'{c}_n'] for c in ('add_att', 'add_obj', 'replace_att', 'replace_obj', 'replace_rel', 'swap_att', 'swap_obj')) == 211
    # no classification or Winoground files in coco_sample: skipped with the reason recorded, not silently
    assert set(res['skipped']) == {'zeroshot', 'linear_probe', 'winoground'}
    # the complete SugarCrepe text against the sample's photos: only items with a photo are scored, the rest counted
    rc, _, _ = _run(['run', '--model', 'powerclip-micro', '--data', str(DATA / 'sugarcrepe'), '--images', str(COCO / 'images'),
                     '--tasks', 'sugarcrepe', '--out', str(tmp_path), '--cache', str(tmp_path / 'c'), '--no-progress'], capsys)
    assert rc == 0
    full = json.loads((tmp_path / 'random-init' / 'sugarcrepe.json').read_text())['metrics']['sugarcrepe']
    assert sum(v for k, v in full.items() if k.endswith('_n')) == 211
    assert sum(v for k, v in full.items() if k.endswith('_skipped')) == 7511 - 211


@pytest.mark.skipif(importlib.util.find_spec('clip_benchmark') is None, reason='clip_benchmark not installed')
def test_retrieval_matches_clip_benchmark():
    from clip_benchmark.metrics.zeroshot_retrieval import recall_at_k
    g = torch.Generator().manual_seed(0)
    for I, per in ((30, 1), (25, 5), (40, 3)):
        sim = torch.rand(I, I * per, generator=g)                 # continuous: no ties, where topk and our rule agree
        ti = torch.arange(I).repeat_interleave(per)
        pos = torch.zeros(I * per, I, dtype=torch.bool); pos[torch.arange(I * per), ti] = True
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
    for n in ('a.jpg', 'b.jpg', 'c.jpg'): Image.new('RGB', (8, 8)).save(tmp_path / 'images' / 'val2014' / n)
    rows = [dict(filepath='val2014', filename=n, split=sp, sentences=[dict(raw=f'{n} {k}') for k in range(2)])
            for n, sp in (('a.jpg', 'test'), ('b.jpg', 'train'), ('c.jpg', 'test'), ('gone.jpg', 'test'))]
    f = tmp_path / 'dataset_coco.json'; f.write_text(json.dumps(dict(images=rows)))
    r = load_retrieval(f)
    assert [p.name for p in r.images] == ['a.jpg', 'c.jpg'] and r.captions[1] == ['c.jpg 0', 'c.jpg 1'] and r.skipped == 1
    assert 'skipped 1 of 3' in caplog.text
    texts, ti = r.flat()
    assert texts[2] == 'c.jpg 0' and ti.tolist() == [0, 0, 1, 1]


def test_winoground_needs_both_images(tmp_path):
    from PIL import Image
    (tmp_path / 'data' / 'images').mkdir(parents=True)
    for n in ('x0', 'x1', 'y0'): Image.new('RGB', (8, 8)).save(tmp_path / 'data' / 'images' / f'{n}.png')
    rows = [dict(id=0, image_0='x0', image_1='x1', caption_0='a', caption_1='b'),
            dict(id=1, image_0='y0', image_1='y1', caption_0='c', caption_1='d')]
    (tmp_path / 'data' / 'examples.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    items = load_winoground(tmp_path)
    assert len(items) == 1 and items[0][2:] == ('a', 'b')


def test_image_folder_classification(tmp_path, capsys):
    "root/{train,val,test}/<class>/*.png with templates.txt runs zero-shot and the linear probe."
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (('train', 6), ('val', 3), ('test', 4)):
        for c, colour in (('red_thing', (220, 40, 40)), ('blue_thing', (40, 60, 230))):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.clip(np.array(colour) + rng.normal(0, 20, (16, 16, 3)), 0, 255).astype(np.uint8)).save(tmp_path / split / c / f'{i}.png')
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
    "The one writer's folder read back by the one reader: images are the scenes, negatives false, captions true, trees for all."
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
        assert len(items[kind]) == summary['sugarcrepe'][kind] > 0 and skipped[kind] == 0
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
    assert write_world_benchmark(tmp_path, 40, cfg, extras=False) == summary and (tmp_path / 'retrieval.json').stat().st_mtime_ns == mtime
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
        with torch.no_grad(): model.visual.proj.fill_(float('nan'))
    d.mkdir(parents=True)
    torch.save(model.state_dict(), d / 'model.pt')
    (d / 'config.yaml').write_text('model:\n  name: powerclip-micro\n  kwargs: {}\n' + (f'method: {method}\nmethod_cfg: {{}}\n' if method else ''))
    return d


def test_every_scorer_of_the_method(world, tmp_path, capsys):
    "A FILIP run is scored by late interaction (the headline) and globally; features are cached per scorer; --method overrides."
    run = _run_folder(tmp_path / 'filip', 'filip')
    out, cache = tmp_path / 'res', tmp_path / 'cache'
    base = ['run', '--checkpoint', str(run), '--data', str(world), '--out', str(out), '--cache', str(cache), '--no-progress',
            '--tasks', 'retrieval', 'sugarcrepe', 'zeroshot', 'linear_probe']
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
    assert strip(clip['metrics']) == {**strip(res['other_scorers']['global']), 'linear_probe': strip(res['metrics'])['linear_probe']}
    rc, md, _ = _run(['table', str(out)], capsys)
    assert rc == 0 and '| retrieval [global] |' in md


def test_bad_checkpoints_are_one_line(world, tmp_path, capsys):
    base = ['run', '--data', str(world), '--tasks', 'retrieval', '--out', str(tmp_path / 'res'), '--cache', 'none', '--no-progress']
    rc, _, err = _run(base + ['--checkpoint', str(_run_folder(tmp_path / 'nan', 'clip', nan=True))], capsys)
    assert rc == 2 and 'non-finite image features' in err and len(err.strip().splitlines()) == 1
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
    "The demo's world numbers follow the one tie rule: a model whose scores are all equal gets 0 everywhere (topk gave hits)."
    from dataclasses import replace
    from powerclip.eval.tasks import evaluate_world
    lm = load_model('powerclip-micro')
    ev = Evaluator.of(replace(lm, scorers={'constant': _Constant(), 'global': GlobalScorer()}), progress=False)
    res = evaluate_world(ev, world)
    assert res['scorer'] == 'constant'
    assert all(v == 0 for k, v in res.items() if k != 'scorer' and not k.startswith('global:') and v == v)
    assert 0 < res['global:hn_mean'] < 100                       # the same model's global cosines are not tied


# ---- CLIP's benchmarks through clip_benchmark -------------------------------------------------------------------

from powerclip.eval.benchmarks import BENCHMARKS, ROBUSTNESS, TABLE1, _NoDownload, clip_classnames, clip_templates, open_benchmark
from powerclip.eval.data import SUGARCREPE
from powerclip.eval.tables import PAPER, paper_tables

FROM_DATA = {'cifar10', 'cifar100', 'food101', 'sun397', 'cars', 'fgvc_aircraft', 'dtd', 'stl10', 'vtab/resisc45'}


def test_every_classification_benchmark_has_clip_names_and_templates():
    "The 17 sets of Table 1 and the 6 of Table 3: CLIP's templates from the package; class names from it or, as in clip_benchmark, from the data."
    assert len(TABLE1) == 17 and len(ROBUSTNESS) == 6
    paper_cols = ['Food101', 'CIFAR10', 'CIFAR100', 'SUN397', 'Cars', 'VOC07', 'Aircraft', 'DTD', 'OxfordPets', 'Caltech101',
                  'Flowers', 'STL10', 'EuroSAT', 'RESISC45', 'GTSRB', 'Country', 'PCam']
    assert [BENCHMARKS[n].column for n in TABLE1] == paper_cols
    assert [BENCHMARKS[n].column for n in ROBUSTNESS] == ['ImgNet-1k', 'ImgNet-V2', 'ImgNet-A', 'ImgNet-R', 'ImgNet-O', 'ImgNet-S']
    for n in TABLE1 + ROBUSTNESS:
        t = clip_templates(n)
        assert t and all('{c}' in x for x in t), n
        names = clip_classnames(n)
        if n in FROM_DATA: assert names is None, n
        else: assert names and all(isinstance(x, str) and x for x in names), n   # CLIP's ImageNet list has 2 repeated names (crane, maillot)
        # every data set names the files a user must provide
        assert BENCHMARKS[n].files and (BENCHMARKS[n].marker or n == 'vtab/resisc45'), n
    assert clip_classnames('imagenet-r')[:2] == ['goldfish', 'great white shark']
    assert len(clip_templates('cifar10')) == 18 and len(clip_templates('imagenet1k')) == 80


def test_clip_benchmark_never_downloads(tmp_path):
    "clip_benchmark's SugarCrepe branch runs wget whatever `download` says: under the guard it raises instead."
    from clip_benchmark.datasets.builder import build_dataset
    with _NoDownload('sugar_crepe'):
        with pytest.raises(MissingData, match='wget'):
            build_dataset('sugar_crepe/add_att', root=str(tmp_path), transform=None, download=False, task='image_caption_selection')
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
    sc = root / 'sugar_crepe'; sc.mkdir(parents=True)
    for c in SUGARCREPE:
        if (world / 'data' / f'{c}.json').is_file(): shutil.copy(world / 'data' / f'{c}.json', sc / f'{c}.json')
    shutil.copytree(world / 'images', sc / 'val2017')
    shutil.copytree(world / 'data', root / 'winoground' / 'data')
    fk = root / 'flickr8k'; fk.mkdir()
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
    base = ['--model', 'powerclip-micro', '--out', str(out), '--cache', str(tmp_path / 'cache'), '--no-progress', '--label', 'rand']
    rc, stdout, _ = _run(['suite', '--root', str(root), *base], capsys)
    assert rc == 0
    rep = json.loads(stdout)
    assert set(rep['results']) == {'cifar10', 'flickr8k', 'sugar_crepe', 'winoground'}
    assert 'food-101/meta/test.json' in rep['skipped']['food101'] and 'not the Karpathy' not in rep['skipped']['mscoco_captions']
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
    assert fl['karpathy_size_ok'] is False and fl['n_images'] == json.loads((world / 'summary.json').read_text())['retrieval_images']
    # naming an absent benchmark stops with what to put where
    rc, _, err = _run(['suite', '--root', str(root), '--benchmarks', 'food101', *base], capsys)
    assert rc == 2 and 'food-101/meta/test.json' in err and 'wds_food101_test' in err
    # tables: the paper's layouts, this checkpoint as a row, the paper's numbers only in 'paper:' columns
    rc, md, _ = _run(['tables', str(out / 'rand'), '--out', str(tmp_path / 'tables'), '--paper', 'rand=PowerCLIP-S'], capsys)
    assert rc == 0
    t1 = (tmp_path / 'tables' / 'table1.csv').read_text().splitlines()
    head, row = t1[0].split(','), t1[1].split(',')
    assert head[:3] == ['checkpoint', 'Food101', 'CIFAR10'] and head[18] == 'Avg' and head[19] == 'paper: Food101'
    assert row[0] == 'rand' and row[1] == '' and float(row[2]) == pytest.approx(zs['top1'], abs=0.051) and row[18] == ''
    assert float(row[19]) == PAPER['table1']['PowerCLIP-S'][0]
    for t in ('table2', 'table4', 'table5', 'table9'): assert (tmp_path / 'tables' / f'{t}.md').is_file(), t
    assert not (tmp_path / 'tables' / 'table3.md').exists()          # no ImageNet result: no Table 3
    t4 = paper_tables(sorted((out / 'rand').glob('*.json')))['table4']
    assert t4[0][:4] == ['checkpoint', 'Obj', 'Att', 'Rel']
    assert t4[1][0][3] == (pytest.approx(sc['replace_rel']) if 'replace_rel' in cats else None)
    rc, _, err = _run(['tables', str(out / 'rand'), '--paper', 'rand=NoSuch'], capsys)
    assert rc == 2 and 'unknown paper methods' in err


def test_bf16_precision_cached_apart(world, tmp_path):
    ev = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False)
    ev16 = Evaluator.build('powerclip-micro', None, cache_dir=tmp_path, progress=False, precision='bf16')
    a, _ = evaluate(ev, world, ['retrieval']); b, _ = evaluate(ev16, world, ['retrieval'])
    assert ev16.cache.hits == 0 and ev16.cache.misses == ev.cache.misses     # bf16 features are not fp32's
    assert abs(a['retrieval']['t2i_R@10'] - b['retrieval']['t2i_R@10']) < 15


def test_clip_benchmark_cli_sugarcrepe_trap(world, tmp_path, capsys):
    "clip_benchmark's own CLI on the world's SugarCrepe (its layout), a project config registered with open_clip: one "
    "file per category when --output is templated; a fixed --output (which would keep one category) is refused."
    import shutil
    from powerclip.model import create_model
    torch.manual_seed(0)
    model = create_model('powerclip-micro')[0]
    ck = tmp_path / 'micro.pt'; torch.save(model.state_dict(), ck)
    root = tmp_path / 'sc'; root.mkdir()
    cats = [c for c in ('add_att', 'swap_obj', 'replace_att') if json.loads((world / 'data' / f'{c}.json').read_text())][:2]
    for c in cats: shutil.copy(world / 'data' / f'{c}.json', root / f'{c}.json')
    shutil.copytree(world / 'images', root / 'val2017')
    args = ['clip-benchmark', 'eval', '--dataset', *[f'sugar_crepe/{c}' for c in cats], '--dataset_root', str(root),
            '--model', 'powerclip-micro', '--pretrained', str(ck), '--no_amp', '--batch_size', '16', '--num_workers', '0']
    rc, _, err = _run(args + ['--output', str(tmp_path / 'one.json')], capsys)
    assert rc == 2 and '{dataset}' in err and not (tmp_path / 'one.json').exists()
    absent = next(c for c in SUGARCREPE if not (root / f'{c}.json').exists())
    rc, _, err = _run(args[:5] + [f'sugar_crepe/{absent}'] + args[5:] + ['--output', str(tmp_path / '{dataset}.json')], capsys)
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
