"""Issue 30, the region task's edges: broken COCO segmentations are counted skips with their reason (and `--strict`
stops on them alone, in one line), OV-COCO's vocabulary and chance levels per group, and AP on pycocotools' own recall
grid. Broken copies of real COCO annotations (`../shared/data/coco_sample`, skipped when absent) and of a hand-made
file are written to tmp dirs here."""
import contextlib, copy, io, json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from powerclip.eval.cli import main
from powerclip.eval.metrics import RECALL_POINTS, average_precision
from powerclip.eval.region_data import load_regions, rle_counts, segmentation_problem
from powerclip.eval.regions import region_chance
from powerclip.regions import coco_mask

ROOT = Path(__file__).resolve().parents[1]
COCO = ROOT.parent / 'shared' / 'data' / 'coco_sample'
needs_data = pytest.mark.skipif(not (COCO / 'annotations').is_dir(), reason=f'real data absent: {COCO}')


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- AP on COCO's grid ---------------------------------------------------------------------------------------------

def _coco_style_ap(scores, positive) -> float:
    """pycocotools' `accumulate` for one class, written out in NumPy (no ties here): detections by score (mergesort),
    tp/fp cumsums, precision made monotone from the right, read at `np.linspace(0, 1, 101)` by `np.searchsorted(...,
    side='left')`, 0 where the recall is never reached."""
    order = np.argsort(-np.asarray(scores, float), kind='mergesort')
    pos = np.asarray(positive, bool)[order]
    tp, fp = np.cumsum(pos).astype(float), np.cumsum(~pos).astype(float)
    rc, pr = tp / pos.sum(), tp / (fp + tp + np.spacing(1))
    for i in range(len(pr) - 1, 0, -1):
        pr[i - 1] = max(pr[i - 1], pr[i])
    q = np.zeros(101)
    for ri, pi in enumerate(np.searchsorted(rc, np.linspace(0, 1, 101), side='left')):
        if pi < len(pr):
            q[ri] = pr[pi]
    return 100 * q.mean()


def _pycocotools_ap(scores, positive) -> float:
    "AP50 of one class by pycocotools' COCOeval: item i is image i with one detection; a positive has its GT box."
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    box = [0.0, 0.0, 10.0, 10.0]
    gt = COCO()
    gt.dataset = dict(images=[dict(id=i + 1, width=20, height=20) for i in range(len(scores))],
                      categories=[dict(id=1, name='x')],
                      annotations=[dict(id=i + 1, image_id=i + 1, category_id=1, bbox=box, area=100.0, iscrowd=0)
                                   for i, p in enumerate(positive) if p])
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        dt = gt.loadRes([dict(image_id=i + 1, category_id=1, bbox=box, score=float(s)) for i, s in enumerate(scores)])
        ev = COCOeval(gt, dt, 'bbox')
        ev.evaluate()
        ev.accumulate()
    assert ev.params.iouThrs[0] == 0.5 and ev.params.areaRngLbl[0] == 'all' and ev.params.maxDets[2] == 100
    return 100 * float(ev.eval['precision'][0, :, 0, 0, 2].mean())


def _cases():
    "Rankings where COCO's grid decides (20 and 100 positives), and random ones, all without ties."
    g = np.random.default_rng(0)
    yield -np.arange(21.0), [True] * 14 + [False] + [True] * 6          # the 14th hit's recall 0.7 < grid point 70
    yield -np.arange(25.0), [True] * 7 + [False] * 5 + [True] * 13      # 7/20 = 0.35 < grid point 35
    for n, p in ((120, 100), (60, 20), (40, 7), (90, 33)):
        pos = np.zeros(n, bool)
        pos[g.choice(n, p, replace=False)] = True
        yield g.permutation(n).astype(float), pos.tolist()


def test_recall_grid_is_numpys():
    assert RECALL_POINTS.dtype == torch.float64
    assert RECALL_POINTS.numpy().tobytes() == np.linspace(0, 1, 101).tobytes()
    assert float(RECALL_POINTS[35]) == 0.35000000000000003 != 35 / 100


def test_ap_equals_coco_reference():
    for scores, positive in _cases():
        ours = average_precision(torch.tensor(scores), torch.tensor(positive))
        assert ours == pytest.approx(_coco_style_ap(scores, positive), abs=1e-9)


def test_ap_equals_pycocotools():
    pytest.importorskip('pycocotools', reason='pycocotools not installed: the NumPy reference above still runs')
    for scores, positive in _cases():
        ours = average_precision(torch.tensor(scores), torch.tensor(positive))
        assert ours == pytest.approx(_pycocotools_ap(scores, positive), abs=1e-9)
    # the first hand case: 70 of 101 points read 1, 31 read 20/21 (COCO's grid), not 71 and 30 (hundredths)
    assert _pycocotools_ap(*next(_cases())) == pytest.approx(100 * (70 + 31 * 20 / 21) / 101, abs=1e-9)


def test_compressed_rle_against_pycocotools():
    mask_api = pytest.importorskip('pycocotools.mask', reason='pycocotools not installed')
    g = np.random.default_rng(1)
    for h, w in ((7, 5), (30, 40), (64, 48)):
        m = g.random((h, w)) < 0.3
        enc = mask_api.encode(np.asfortranarray(m.astype(np.uint8)))
        seg = dict(size=[h, w], counts=enc['counts'].decode())
        assert segmentation_problem(seg, w, h) is None
        dec = dict(size=[h, w], counts=rle_counts(seg['counts']))
        assert np.array_equal(coco_mask(dec, h, w), m)


# ---- broken annotations --------------------------------------------------------------------------------------------

def _break(ann: dict, how: str, width: int, height: int) -> tuple[dict, str]:
    "A broken copy of annotation `ann` and the reason the reader must give."
    a = copy.deepcopy(ann)
    poly = a['segmentation'][0] if isinstance(a['segmentation'], list) else [1, 1, 9, 1, 9, 9]
    if how == 'odd':
        a['segmentation'] = [poly[:-1]]
    elif how == 'string':
        a['segmentation'] = [[str(v) for v in poly]]
    elif how == 'flat':
        a['segmentation'] = list(poly)
    elif how == 'rle_size':
        a['segmentation'] = dict(size=[height + 1, width], counts=[(height + 1) * width])
    elif how == 'one_point':
        a['segmentation'] = [poly[:2]]
    return a, dict(odd='bad_polygon', string='bad_polygon', flat='bad_polygon', rle_size='bad_rle',
                   one_point='degenerate')[how]


BREAKS = ('odd', 'string', 'flat', 'rle_size', 'one_point')


def _broken_copy(d: dict, out: Path) -> tuple[dict, list]:
    """`d` with one annotation broken per kind of `BREAKS` (the first non-crowd ones, in file order) written to `out`;
    the expected reason counts and the broken annotations' ids in order."""
    d = copy.deepcopy(d)
    size = {im['id']: (im['width'], im['height']) for im in d['images']}
    want, ids, k = {}, [], 0
    for j, a in enumerate(d['annotations']):
        if k == len(BREAKS):
            break
        if a.get('iscrowd'):
            continue
        d['annotations'][j], reason = _break(a, BREAKS[k], *size[a['image_id']])
        want[reason] = want.get(reason, 0) + 1
        ids.append(a['id'])
        k += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d))
    return want, ids


def _toy_coco(root: Path) -> dict:
    "A hand-made COCO file: 3 photos of noise, 4 squares each of classes 'cat' and 'dog', one crowd region."
    (root / 'images').mkdir(parents=True)
    g, images, anns = np.random.default_rng(0), [], []
    for i in range(3):
        Image.fromarray(g.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(root / 'images' / f'{i}.png')
        images.append(dict(id=i + 1, file_name=f'{i}.png', width=64, height=48))
        for j in range(4):
            x, y = 8 + 12 * j, 10 + 6 * (j % 2)
            anns.append(dict(id=len(anns) + 1, image_id=i + 1, category_id=1 + j % 2, bbox=[x, y, 10, 10], area=100,
                             segmentation=[[x, y, x + 10, y, x + 10, y + 10, x, y + 10]], iscrowd=0))
    anns.append(dict(anns[0], id=99, iscrowd=1, segmentation=dict(size=[48, 64], counts=[48 * 64])))
    return dict(images=images, annotations=anns, categories=[dict(id=1, name='cat'), dict(id=2, name='dog')])


def _run_regions(capsys, tmp_path, data, *extra, images=None):
    argv = ['run', '--model', 'powerclip-micro', '--data', str(data), '--tasks', 'regions', '--out',
            str(tmp_path / 'res'), '--cache', str(tmp_path / 'cache'), '--no-progress', *extra]
    return _run(argv + (['--images', str(images)] if images else []), capsys)


def _check_broken(capsys, tmp_path, d: dict, images: Path):
    good = tmp_path / 'good' / 'annotations' / 'instances_x.json'
    good.parent.mkdir(parents=True)
    good.write_text(json.dumps(d))
    bad = tmp_path / 'bad' / 'annotations' / 'instances_x.json'
    want, ids = _broken_copy(d, bad)
    # each broken annotation a counted skip with its reason, the run going on (exit 0)
    rc, out, err = _run_regions(capsys, tmp_path, bad, images=images)
    assert rc == 0, err
    counts = json.loads(out)['skipped_items']['regions']
    for reason, n in want.items():
        assert counts[reason] == n, counts
    res = json.loads((tmp_path / 'res' / 'random-init' / 'instances_x.json').read_text())
    named = {(i['reason'], i['file']) for i in res['skipped_items']['regions']['items']}
    assert all(any(f.endswith(f'annotation {a}') for _, f in named) for a in ids)
    # --strict: one line naming the file and the first broken annotation, exit 2, before any model is built
    rc, out, err = _run_regions(capsys, tmp_path, bad, '--strict', images=images)
    assert rc == 2 and out == '' and len(err.strip().splitlines()) == 1, err
    assert f'{bad} annotation {ids[0]}: bad polygon (polygon 0 has an odd number of coordinates' in err
    # the valid file passes --strict, whatever its crowd regions and regions outside the view
    rc, out, err = _run_regions(capsys, tmp_path, good, '--strict', images=images)
    assert rc == 0, err
    return json.loads(out)


def test_broken_segmentations_toy(tmp_path, capsys):
    d = _toy_coco(tmp_path / 'toy')
    r = _check_broken(capsys, tmp_path, d, tmp_path / 'toy' / 'images')
    assert r['skipped_items']['regions'].get('crowd_region') == 1
    assert set(r['skipped_items']['regions']) <= {'crowd_region', 'outside_view'}


@needs_data
def test_broken_segmentations_real_coco(tmp_path, capsys):
    d = json.loads((COCO / 'annotations' / 'instances_val2017.json').read_text())
    # a subset keeps the test short: the first 20 photos and those with crowd regions
    crowd = {a['image_id'] for a in d['annotations'] if a.get('iscrowd')}
    keep = {im['id'] for im in d['images'][:20]} | crowd
    d = dict(d, images=[im for im in d['images'] if im['id'] in keep],
             annotations=[a for a in d['annotations'] if a['image_id'] in keep])
    r = _check_broken(capsys, tmp_path, d, COCO / 'images')
    left = r['skipped_items']['regions']
    assert left['crowd_region'] == len([a for a in d['annotations'] if a.get('iscrowd')]) > 0
    assert set(left) <= {'crowd_region', 'outside_view'}


# ---- OV-COCO's vocabulary and chance per group ---------------------------------------------------------------------

def test_vocab_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(['run', '--help'])
    assert e.value.code == 0 and '--vocab {all,ovcoco}' in capsys.readouterr().out
    rc, _, err = _run(['run', '--data', str(ROOT), '--vocab', 'lvis'], capsys)
    assert rc == 2 and "--vocab: invalid choice: 'lvis'" in err and len(err.strip().splitlines()) == 1


@needs_data
def test_ovcoco_vocabulary_real(tmp_path, capsys):
    f = COCO / 'annotations' / 'instances_val2017.json'
    rc, out, err = _run_regions(capsys, tmp_path, f, '--vocab', 'ovcoco', '--strict')
    assert rc == 0, err
    m = json.loads(out)['metrics']['regions']
    assert (m['vocabulary'], m['classes']) == ('ovcoco', 65)
    assert json.loads(out)['skipped_items']['regions']['outside_vocabulary'] > 0
    # chance per group: expected numbers of a random scorer on the regions the model saw (the view drops some), every
    # group's top-1 at 1/65; recomputed here from those regions' labels
    left = json.loads((tmp_path / 'res' / 'random-init' / 'instances_val2017.json').read_text())['skipped_items']
    unseen = [i for i in left['regions']['items'] if i['reason'] == 'outside_view']
    assert left['regions']['items_left_out'] == 0
    unseen = {int(i['detail'].split()[1]) for i in unseen}                      # 'region <id> outside the centred ..'
    rs = load_regions(f, vocabulary='ovcoco')
    labels = torch.tensor([r['label'] for r in rs.regions if r['id'] not in unseen])
    assert len(labels) == m['n_regions'] == m['pooled_n_regions_base'] + m['pooled_n_regions_novel']
    assert {f'chance_{k}': m[f'chance_{k}'] for k in ('top1', 'ap50', 'top1_base', 'ap50_base', 'top1_novel',
                                                         'ap50_novel')} == region_chance(labels, 65, rs.groups)
    assert m['chance_top1_novel'] == pytest.approx(100 / 65) and 0 < m['chance_ap50_novel'] < m['chance_ap50_base']
    # the table says which vocabulary: its rows read 'regions (vocab ovcoco)'
    rc, md, _ = _run(['table', str(tmp_path / 'res')], capsys)
    assert rc == 0 and '| regions (vocab ovcoco) | chance_ap50_novel |' in md


def test_region_chance_matches_random_scores():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 12, (150,), generator=g)
    groups = dict(base=list(range(8)), novel=list(range(8, 12)))
    from powerclip.eval.metrics import region_classification_metrics
    draws = [region_classification_metrics(torch.randn(150, 12, generator=g, dtype=torch.float64), labels, groups)
             for _ in range(200)]
    ch = region_chance(labels, 12, groups)
    for k in ('ap50', 'ap50_base', 'ap50_novel'):
        assert ch[f'chance_{k}'] == pytest.approx(np.mean([d[k] for d in draws]), abs=1.0)
