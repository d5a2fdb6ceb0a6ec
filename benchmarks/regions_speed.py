"""Cost of making region masks, per image: random boxes, pixel-to-grid reduction, superpixels (and SAM2 with --sam2).

    .venv/bin/python benchmarks/regions_speed.py [--images DIR] [--n 20] [--sam2 [--device cuda]]

Photos from ../shared/data/coco_sample/images when present (else synthetic 480x640 images). Prints one table
row per operation (median and mean milliseconds per image) and writes benchmarks/results/regions_speed.json.
SAM2 without a checkpoint runs with random weights and zero thresholds: its timing is that of the full
pipeline (encoder, 32x32 prompts, decoding, post-processing), not of a real checkpoint's filtering.
"""
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import _checks
from powerclip import regions as R
from powerclip.commandline import ArgumentParser, run_main, usage_errors

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, items, repeat=1):
    ts = []
    for x in items:
        for _ in range(repeat):
            t = time.perf_counter()
            fn(x)
            ts.append(time.perf_counter() - t)
    return 1e3 * np.median(ts), 1e3 * np.mean(ts)


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--images', default=None, help='a folder of .jpg photos (default: the shared coco_sample when '
                    'present, else synthetic images)')
    ap.add_argument('--n', type=int, default=20)
    ap.add_argument('--sam2', action='store_true')
    ap.add_argument('--sam2-config', default='configs/sam2.1/sam2.1_hiera_t.yaml')
    ap.add_argument('--sam2-checkpoint', default=None)
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, 'n', 'threads')
        _checks.device(a.device)
        if a.images is not None:
            _checks.existing('--images', a.images, 'dir')
        if a.sam2_checkpoint is not None:
            _checks.existing('--sam2-checkpoint', a.sam2_checkpoint)
    images = Path(a.images or ROOT.parent / 'shared/data/coco_sample/images')
    torch.set_num_threads(a.threads)
    paths = sorted(images.glob('*.jpg'))[: a.n] if images.is_dir() else []
    rng = np.random.default_rng(0)
    imgs = [Image.open(p).convert('RGB') for p in paths] or \
           [Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)) for _ in range(a.n)]
    views = [im.resize((224, 224)) for im in imgs]
    g = torch.Generator().manual_seed(0)
    grid = R.GridConfig(14, 14)
    labels = [R.superpixel_labels(v) for v in views]
    rows = {
        'random_box_masks (M=10, 14x14)': timed(lambda _: R.random_box_masks(14, 14, 10, g), range(200)),
        'random_box_masks_batch (C=256, M=10), per image': tuple(
            x / 256 for x in timed(lambda _: R.random_box_masks_batch(256, 14, 14, 10, g), range(20))),
        'slic on 224x224': timed(R.superpixel_labels, views),
        'felzenszwalb on 224x224': timed(lambda v: R.superpixel_labels(v, R.SuperpixelConfig('felzenszwalb')), views),
        'reduce slic masks to 14x14 (224 px)': timed(lambda l: R.masks_to_patch_grid(R.labels_to_masks(l), grid),
                                                     labels),
        'superpixel_masks on the original photo': timed(lambda im: R.superpixel_masks(im, grid), imgs),
    }
    if a.sam2:
        cfg = R.SAM2Config(config=a.sam2_config, checkpoint=a.sam2_checkpoint, random_weights_ok=True, device=a.device,
                           **({} if a.sam2_checkpoint else dict(pred_iou_thresh=0.0, stability_score_thresh=0.0)))
        sam = R.SAM2Masker(cfg, grid)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            sam(views[0])                                   # build and warm up
            rows[f'SAM2 {Path(a.sam2_config).stem} on 224x224 ({a.device})'] = timed(sam, views[: min(5, len(views))])
    machine = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                   torch_threads=torch.get_num_threads(), device=a.device,
                   gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    print(f'{len(imgs)} images ({"coco_sample" if paths else "synthetic"}), {machine}')
    print(f'{"operation":<52} {"median ms":>10} {"mean ms":>10}')
    for k, (med, mean) in rows.items():
        print(f'{k:<52} {med:10.3f} {mean:10.3f}')
    out = ROOT / 'benchmarks' / 'results'
    out.mkdir(parents=True, exist_ok=True)
    (out / 'regions_speed.json').write_text(json.dumps(dict(machine=machine, n_images=len(imgs),
                                                            ms_per_image={k: dict(median=v[0], mean=v[1])
                                                                          for k, v in rows.items()}), indent=1))


if __name__ == '__main__':
    sys.exit(run_main(main, prog='regions_speed.py'))
