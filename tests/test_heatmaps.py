"""The heatmaps CLI end to end: PNGs for an image and texts, and the grounding score, as `python -m`."""
import json, subprocess, sys
from pathlib import Path

import numpy as np
from PIL import Image

from powerclip.heatmaps import main

ROOT = Path(__file__).resolve().parents[1]


def test_cli_pngs_and_grounding(tmp_path, capsys):
    img = tmp_path / 'x.png'
    Image.fromarray((np.random.default_rng(0).random((50, 70, 3)) * 255).astype(np.uint8)).save(img)
    assert main(['--model', 'powerclip-micro', '--image', str(img), '--texts', 'a red circle', 'a blue square',
                 '--out', str(tmp_path / 'maps'), '--grounding', '3']) == 0
    out = capsys.readouterr().out.strip().splitlines()
    pngs = sorted((tmp_path / 'maps').glob('*.png'))
    assert [p.name for p in pngs] == ['00.png', '01.png', 'grid.png'] and all(Image.open(p).size[0] > 0 for p in pngs)
    g = json.loads(out[-1])
    assert g['n_phrases'] > 0 and 0 <= g['pointing'] <= g['pointing_any_object'] <= 100 and 0 <= g['mean_iou'] <= 100


def test_cli_needs_input():
    r = subprocess.run([sys.executable, '-m', 'powerclip.heatmaps', '--model', 'powerclip-micro'], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and '--grounding' in r.stderr
