"""Checkpoints in open_clip's own layouts through `powerclip-eval run --checkpoint` (issue 30): a release folder
(`open_clip_config.json` beside `open_clip_pytorch_model.bin` or `open_clip_model.safetensors`) and a training run
(`logs/NAME/params.txt`, `checkpoints/epoch_N.pt`), both without `--model`; the pooling the checkpoint records; a
broken layout as one line and exit status 2; result names without the data file's `.json`. Built from the micro
model (nothing downloads)."""
import json, logging, subprocess, sys
from pathlib import Path

import open_clip
import pytest
import torch

from powerclip.eval.cli import main
from powerclip.eval.data import write_world_benchmark
from powerclip.eval.models import CheckpointError, load_model, sha256_file
from powerclip.model import create_model, pool_of, register_configs

ROOT = Path(__file__).resolve().parents[1]
register_configs()          # the micro model's config, for open_clip's own get_model_config / create_model


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp('world')
    write_world_benchmark(root, n_images=24, extras=False)
    return root


@pytest.fixture(scope='module')
def avg_weights():
    "The micro model's weights, trained (here: drawn) to be pooled by the mean."
    torch.manual_seed(5)
    return create_model('powerclip-micro', pool='avg')[0].state_dict()


def _release(d: Path, sd: dict, fmt: str = 'bin', pool_type: str | None = 'avg') -> Path:
    "An open_clip release folder, as `open_clip.push_to_hf_hub` writes it."
    cfg = open_clip.get_model_config('powerclip-micro')
    if pool_type is not None:
        cfg['vision_cfg']['pool_type'] = pool_type
    d.mkdir(parents=True, exist_ok=True)
    (d / 'open_clip_config.json').write_text(json.dumps(dict(model_cfg=cfg, preprocess_cfg=dict(
        mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]))))
    if fmt == 'bin':
        torch.save(sd, d / 'open_clip_pytorch_model.bin')
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, d / 'open_clip_model.safetensors')
    return d


def _openclip_run(d: Path, sds: dict, model: str = 'powerclip-micro') -> Path:
    "An open_clip training run `logs/NAME/`: params.txt and checkpoints/epoch_N.pt under DDP's `module.` prefix."
    (d / 'checkpoints').mkdir(parents=True, exist_ok=True)
    (d / 'params.txt').write_text(f'batch_size: 256\nepochs: 32\nforce_quick_gelu: False\nmodel: {model}\n'
                                  f'name: {d.name}\npretrained: \n')
    for n, sd in sds.items():
        torch.save(dict(epoch=n, name=d.name, state_dict={f'module.{k}': v for k, v in sd.items()},
                        optimizer={'state': {}, 'param_groups': []}), d / 'checkpoints' / f'epoch_{n}.pt')
    return d


def _same(model, sd) -> bool:
    return all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_release_folder_loads_without_model(tmp_path, avg_weights):
    for fmt in ('bin', 'safetensors'):
        rel = _release(tmp_path / fmt, avg_weights, fmt)
        lm = load_model(checkpoint=rel)
        assert lm.spec == dict(name='powerclip-micro', kwargs={}, pool='avg')
        assert pool_of(lm.model) == 'avg' and _same(lm.model, avg_weights)
        weights = rel / ('open_clip_pytorch_model.bin' if fmt == 'bin' else 'open_clip_model.safetensors')
        assert lm.ckpt_id == sha256_file(weights) + '-avg'
        # the weights file itself, without --model: the config beside it is read
        assert load_model(checkpoint=weights).spec == lm.spec


def test_openclip_run_folder_takes_latest_epoch_numerically(tmp_path, avg_weights):
    torch.manual_seed(6)
    other = create_model('powerclip-micro')[0].state_dict()
    run = _openclip_run(tmp_path / 'logs' / 'r1', {9: other, 10: avg_weights})
    lm = load_model(checkpoint=run)
    assert _same(lm.model, avg_weights)                        # epoch_10, not epoch_9 (lexically larger)
    assert lm.spec['name'] == 'powerclip-micro' and lm.spec['pool'] == 'tok'   # params.txt: the micro architecture
    assert _same(load_model(checkpoint=run / 'checkpoints' / 'epoch_9.pt').model, other)   # one named by its file
    torch.save(dict(epoch=3, state_dict=other), run / 'checkpoints' / 'epoch_latest.pt')
    assert _same(load_model(checkpoint=run).model, other)      # epoch_latest.pt wins


def test_pooling_record_against_the_named_architecture(tmp_path, avg_weights, caplog):
    rel = _release(tmp_path / 'rel', avg_weights)
    with caplog.at_level(logging.WARNING):
        lm = load_model('powerclip-micro', rel)                 # micro alone pools by the class token
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('pooling:')]
    assert lm.spec['pool'] == 'avg' and len(said) == 1 and "'avg', as the checkpoint was trained" in said[0], said
    assert '--pool tok' in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        lm = load_model('powerclip-micro', rel, pool='tok')     # named explicitly: obeyed, and said
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('pooling:')]
    assert lm.spec['pool'] == 'tok' and len(said) == 1 and "'tok' as --pool asks" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_model(checkpoint=rel)                              # nothing named: nothing disagrees
    assert not [r for r in caplog.records if r.getMessage().startswith('pooling:')]
    # our own run folder: config.yaml records ViT-B-16-avg's pooling; --model names another architecture
    (tmp_path / 'ours').mkdir()
    torch.save(avg_weights, tmp_path / 'ours' / 'model.pt')
    (tmp_path / 'ours' / 'config.yaml').write_text('model: {name: powerclip-micro, pool: avg}\nmethod: clip\n')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        lm = load_model('powerclip-micro', tmp_path / 'ours')
    assert lm.spec['pool'] == 'avg'
    assert sum(r.getMessage().startswith('pooling:') for r in caplog.records) == 1


def test_release_config_unlike_any_registered_one(tmp_path):
    cfg = open_clip.get_model_config('powerclip-micro')
    cfg['embed_dim'] = 16
    cfg['text_cfg']['context_length'] = 20
    d = tmp_path / 'odd'
    d.mkdir()
    (d / 'open_clip_config.json').write_text(json.dumps(dict(model_cfg=cfg)))
    torch.manual_seed(0)
    m = open_clip.create_model('powerclip-micro', embed_dim=16, text_cfg=cfg['text_cfg'])
    torch.save(m.state_dict(), d / 'open_clip_pytorch_model.bin')
    lm = load_model(checkpoint=d)
    assert lm.spec['name'] == 'powerclip-micro' and lm.spec['kwargs'] == dict(embed_dim=16, text_cfg=cfg['text_cfg'])
    assert _same(lm.model, m.state_dict()) and lm.tokenizer(['a red circle']).shape == (1, 20)


def test_cli_openclip_run_and_data_file_names(tmp_path, world, avg_weights, capsys):
    run = _openclip_run(tmp_path / 'logs' / 'r2', {1: avg_weights, 2: avg_weights})
    out = tmp_path / 'res'
    rc, so, se = _run(['run', '--checkpoint', str(run), '--data', str(world), '--tasks', 'retrieval', '--out',
                       str(out), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 0, se
    res = json.loads((out / 'r2' / f'{world.name}.json').read_text())
    assert res['checkpoint'] == str(run) and res['weights'].endswith('epoch_2.pt')
    assert res['model']['name'] == 'powerclip-micro'
    # a data file: the result is named by its stem, not `<file>.json.json`
    inst = sorted((world / 'annotations').glob('instances_*.json'))[0]
    rc, so, se = _run(['run', '--checkpoint', str(run / 'checkpoints' / 'epoch_1.pt'), '--data', str(inst),
                       '--tasks', 'regions', '--out', str(out), '--cache', 'none', '--no-progress'], capsys)
    assert rc == 0, se
    assert (out / 'r2-epoch_1' / f'{inst.stem}.json').is_file(), sorted(out.rglob('*.json'))
    assert not list(out.rglob('*.json.json'))


@pytest.mark.parametrize('layout, says', [
    ('empty', 'no checkpoint in a known layout'),
    ('config without weights', 'no weights beside it'),
    ('config not JSON', 'not a JSON file'),
    ('config without model_cfg', 'no open_clip model config'),
    ('broken safetensors', 'not a safetensors file'),
    ('params.txt naming an unknown model', "unknown model 'no-such-arch'"),
    ('params.txt naming no model', 'pass --model'),
    ('torn epoch file', 'not a checkpoint torch can read'),
])
def test_cli_broken_layouts_one_line_exit_2(tmp_path, world, avg_weights, capsys, layout, says):
    d = tmp_path / 'ck'
    d.mkdir()
    if layout.startswith('config'):
        (d / 'open_clip_config.json').write_text({'config without weights': '{"model_cfg": {}}',
                                                  'config not JSON': '{"model_cfg": ',
                                                  'config without model_cfg': '{"preprocess_cfg": {}}'}[layout])
        if layout != 'config without weights':
            torch.save(avg_weights, d / 'open_clip_pytorch_model.bin')
    if layout == 'broken safetensors':
        _release(d, avg_weights)
        (d / 'open_clip_model.safetensors').write_bytes(b'\x00' * 64)
    if layout.startswith('params.txt'):
        _openclip_run(d, {1: avg_weights}, model='no-such-arch')
        if 'no model' in layout:
            (d / 'params.txt').write_text('batch_size: 8\n')
    if layout == 'torn epoch file':
        _openclip_run(d, {1: avg_weights})
        f = d / 'checkpoints' / 'epoch_1.pt'
        f.write_bytes(f.read_bytes()[:500])
    rc, so, se = _run(['run', '--checkpoint', str(d), '--data', str(world), '--tasks', 'retrieval', '--out',
                       str(tmp_path / 'res'), '--cache', 'none', '--no-progress'], capsys)
    lines = [x for x in se.splitlines() if 'error' in x]
    assert rc == 2 and len(lines) == 1 and says in lines[0] and 'Traceback' not in se, se
    assert lines[0].startswith('powerclip-eval: error: --checkpoint: '), lines


def test_safetensors_missing_says_what_to_install(tmp_path, avg_weights, monkeypatch):
    rel = _release(tmp_path / 'st', avg_weights, 'safetensors')
    monkeypatch.setitem(sys.modules, 'safetensors.torch', None)     # as if the package were not installed
    with pytest.raises(CheckpointError, match='pip install safetensors'):
        load_model(checkpoint=rel)


def test_python_m_eval_release_without_model(tmp_path, world, avg_weights):
    "The issue's check, as a user runs it: `python -m powerclip.eval run --checkpoint DIR --data ...`."
    rel = _release(tmp_path / 'hub' / 'micro-avg', avg_weights, 'safetensors')
    r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--checkpoint', str(rel), '--data', str(world),
                        '--tasks', 'retrieval', '--out', str(tmp_path / 'res'), '--cache', 'none', '--no-progress'],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / 'res' / 'micro-avg' / f'{world.name}.json').read_text())
    assert res['model'] == dict(name='powerclip-micro', kwargs={}, pool='avg')
    assert res['checkpoint_id'] == sha256_file(rel / 'open_clip_model.safetensors') + '-avg'
    assert 'initialized randomly' not in r.stderr and 'random initialisation' not in r.stderr
    r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--checkpoint', str(tmp_path), '--data',
                        str(world), '--out', str(tmp_path / 'res')], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    errors = [x for x in r.stderr.splitlines() if x.startswith('powerclip-eval: error: --checkpoint: ')]
    assert r.returncode == 2 and 'Traceback' not in r.stderr and len(errors) == 1, r.stderr
