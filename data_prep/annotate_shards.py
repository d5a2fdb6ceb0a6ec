"""Annotate img2dataset webdataset shards with parse trees and (optionally) region masks.

Reads shards in the layout img2dataset writes (`{key}.jpg`, `{key}.txt`, `{key}.json` per sample) and writes,
for each input shard, an output shard of the same name holding every usable sample's original members plus

- `{key}.tree.json`: the caption's constituency tree, `powerclip.parsing.ParsedCaption.to_dict()`;
- `{key}.regions.npz` (with `--regions slic|felzenszwalb|sam2`): the image's masks on the patch grid,
  `powerclip.regions.encode_regions` (bit-packed `(R, N)` bool, grid size, method).

Unusable samples (undecodable image, missing caption or one `powerclip.parsing.caption_problem` rejects: not
UTF-8, no letter or digit; unparsable json, duplicate key, the last sample of a truncated shard) are not
written; each is counted and listed by key and reason in the shard's `{name}.stats.json`, and totalled in
`summary.json` and on the terminal. The trainer (`powerclip.data.decode_sample`) skips the same captions.

Resumable: a shard is written to `{name}.tar.{run}.partial` and renamed when complete, then its stats file is
written (also by rename): a shard counts as finished only when both exist and the stats match the current input
size and settings. Killing the tool at any point and running the same command again redoes only unfinished
shards. A finished shard made with other settings, or from another input of the same name (another command's
shards into one `--out`), is never replaced: the run is refused before any work unless `--overwrite` (each stats
file records the settings and the input's path and size). A file that is not a tar (0 bytes, text) is a failed
shard, never an annotated one. One run at a time holds `--out` (an exclusive lock on `{out}/.annotate.lock`,
which names the run); worker processes end with the process that started them (kill -9 included), and a worker
commits a shard only while its run still holds the directory, so a re-run never races a writer left from a killed
run.

    python data_prep/annotate_shards.py 'cc12m/{00000..01242}.tar' --out cc12m_annotated --workers 8 --regions slic
    python -m data_prep.annotate_shards cc12m/ --out cc12m_annotated            # a directory: all its *.tar
"""
from __future__ import annotations

import argparse
import glob
import io
import json
import os
import secrets
import sys
import tarfile
import threading
import time
import traceback
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

# the project's command-line convention
from powerclip.commandline import ArgumentParser, UsageError, check_number, run_main, usage_errors

OURS = ('tree.json', 'regions.npz')             # members this tool writes (replaced if the input has them)
STATS_VERSION = 2                               # 2: trees hold the caption as given + word offsets; caption_problem
LOCK = '.annotate.lock'                         # in --out: held by the run writing there, names it


class ShardError(Exception):
    "An input that is not a shard (0 bytes, not a tar): counted as a failed shard, reported in one line."


@dataclass
class AnnotateConfig:
    "Settings of one annotation run; the fields that change outputs are recorded in every shard's stats."
    out: str = 'annotated'          # output directory
    regions: str = 'none'           # 'none' | 'slic' | 'felzenszwalb' | 'sam2'
    grid_h: int = 14                # patch grid of the model that will train on the masks
    grid_w: int = 14
    min_frac: float = 0.5           # regions.GridConfig.min_frac
    keep_best: bool = True          # regions.GridConfig.keep_best
    crop: str = 'center'            # the model sees the centred square ('center') or the whole image ('full')
    seg_size: int = 224             # segment the model's view (crop window resized to seg_size^2), not the photo
    n_segments: int = 16            # slic: approximate number of superpixels
    fz_scale: float = 200.0         # felzenszwalb: scale
    sam2_config: str = 'configs/sam2.1/sam2.1_hiera_l.yaml'
    sam2_checkpoint: str | None = None
    sam2_random_weights_ok: bool = False   # tests only: SAM2 with random weights
    sam2_points_per_side: int = 32
    device: str = 'cpu'             # SAM2 device
    parser: str = 'auto'            # powerclip.parsing.ParserConfig.name
    batch_size: int = 256           # samples parsed (and held in memory) at once
    workers: int = 1                # processes, one shard per task
    overwrite: bool = False         # redo shards even when finished

    def fingerprint(self) -> dict:
        "The settings that change what is written: a finished shard made with other settings is redone."
        keep = ['regions', 'parser']
        if self.regions != 'none':
            keep += ['grid_h', 'grid_w', 'min_frac', 'keep_best', 'crop', 'seg_size']
        if self.regions == 'slic':
            keep += ['n_segments']
        if self.regions == 'felzenszwalb':
            keep += ['fz_scale']
        if self.regions == 'sam2':
            keep += ['sam2_config', 'sam2_checkpoint', 'sam2_points_per_side']
        return {k: getattr(self, k) for k in keep}


# ----------------------------------------------------------------------------------------------- paths
def expand_inputs(specs: list[str]) -> list[Path]:
    "Shard paths from directories (their *.tar), brace patterns (`{00000..00009}.tar`) and globs, in order."
    from braceexpand import braceexpand
    out: list[Path] = []
    for spec in specs:
        for s in braceexpand(spec):
            p = Path(s)
            if p.is_dir():
                out += sorted(p.glob('*.tar'))
            elif any(c in s for c in '*?['):
                out += sorted(Path(x) for x in glob.glob(s))
            else:
                out.append(p)
    seen, uniq = set(), []
    for p in out:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            uniq.append(p)
    names = Counter(p.name for p in uniq)
    if dups := [n for n, c in names.items() if c > 1]:
        raise UsageError(f'shards: input shards share file names {dups[:5]}: outputs would collide')
    return uniq


def check_inputs(specs: list[str], shards: list[Path], out: str):
    "Raise UsageError (one line naming the argument) for inputs that cannot work; nothing is written."
    allowed = 'give shard files, directories holding *.tar, brace patterns ({00000..00009}.tar) or globs'
    if not shards:
        raise UsageError(f'shards: nothing matched {" ".join(map(repr, specs))} ({allowed})')
    for p in shards:
        if not p.exists():
            raise UsageError(f'shards: {str(p)!r} does not exist ({allowed})')
        if not p.is_file():
            raise UsageError(f'shards: {str(p)!r} is not a file ({allowed})')
    o = Path(out)
    if o.exists() and not o.is_dir():
        raise UsageError(f'--out: {out!r} is a file; give a directory (created if missing)')
    if next((a for a in o.parents if a.exists() and not a.is_dir()), None) is not None:
        raise UsageError(f'--out: {out!r} is inside a file; give a directory (created if missing)')
    # the input is never written over: --out may not be the folder of an input, nor hold an output named as an input
    ins = {p.resolve() for p in shards}
    here = next((p for p in shards if p.parent.resolve() == o.resolve()), None)
    hit = next((p for p in shards if out_paths(p, o)[0].resolve() in ins), None)
    if here is not None or hit is not None:
        p = here or hit
        raise UsageError(f'--out: {out!r} would write over the input {str(p)!r} (the output shard keeps the input\'s '
                         'name): give another directory')


def out_paths(shard: Path, out: Path, run: str = 'direct') -> tuple[Path, Path, Path]:
    "(output shard, its temporary name while run `run` writes it, its stats json)."
    stem = shard.name[:-4] if shard.name.endswith('.tar') else shard.name
    return out / f'{stem}.tar', out / f'{stem}.tar.{run}.partial', out / f'{stem}.stats.json'


# ----------------------------------------------------------------------------------------------- one run at a time
@contextmanager
def hold_output(out: Path):
    """Hold `out` for this run: an exclusive lock on `out/.annotate.lock` (released by the kernel when this
    process dies, kill -9 included), which names the run; yields the run id. Partial files of earlier runs
    are removed: no earlier run can still be committing, because its workers died with it and a worker
    commits only while the lock names its run."""
    import fcntl
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / LOCK, 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = (f.read().split() or ['?'])[0]
        f.close()
        raise UsageError(f'--out: {str(out)!r} is being written by another run (pid '
                         f'{owner}); wait for it or stop it') from None
    run = f'{os.getpid()}-{secrets.token_hex(4)}'
    f.seek(0)
    f.truncate()
    f.write(f'{os.getpid()} {run}\n')
    f.flush()
    for q in out.glob('*.partial'):
        q.unlink(missing_ok=True)
    try:
        yield run
    finally:
        f.close()                                  # closing the file releases the lock


def holds_output(out: Path, run: str) -> bool:
    "Does run `run` still hold `out` (the lock file names it)?"
    try:
        return (out / LOCK).read_text().split()[1:2] == [run]
    except (OSError, IndexError):
        return False


def _stats(shard: Path, cfg: AnnotateConfig) -> dict | None:
    "The recorded stats of `shard`'s finished output in `cfg.out`, or None (none, unreadable, or `--overwrite`)."
    tar, _, stats = out_paths(shard, Path(cfg.out))
    if cfg.overwrite or not (tar.exists() and stats.exists()):
        return None
    try:
        st = json.loads(stats.read_text())
    except Exception:
        return None
    return st if isinstance(st, dict) else None


def conflict(shard: Path, cfg: AnnotateConfig) -> str | None:
    """Why the finished output of `shard`'s name in `cfg.out` must not be replaced by this run (made with other
    settings, or from another input), or None. Unfinished shards and unreadable stats are this tool's own
    interrupted work (redone, as before)."""
    st = _stats(shard, cfg)
    if st is None:
        return None
    tar = out_paths(shard, Path(cfg.out))[0]
    made_from = st.get('input_path') or str(Path(st.get('input', shard)).resolve())
    if made_from != str(shard.resolve()):
        return f'{tar.name} was made from another input ({made_from!r}, not {str(shard)!r})'
    if st.get('settings') != cfg.fingerprint():
        return f'{tar.name} was made with other settings ({st.get("settings")}, not {cfg.fingerprint()})'
    return None


def finished(shard: Path, cfg: AnnotateConfig) -> dict | None:
    "The stats of a finished shard, or None if it must be (re)done."
    st = _stats(shard, cfg)
    if st is None:
        return None
    ok = (st.get('version') == STATS_VERSION and st.get('settings') == cfg.fingerprint()
          and st.get('input_bytes') == (shard.stat().st_size if shard.exists() else None))
    return st if ok else None


# ----------------------------------------------------------------------------------------------- reading
def _split(name: str) -> tuple[str, str] | None:
    "webdataset's rule: the key is the path up to the first dot of the file name; the rest is the extension."
    d, _, base = name.rpartition('/')
    if '.' not in base or base.startswith('.'):
        return None
    k, ext = base.split('.', 1)
    return (f'{d}/{k}' if d else k), ext


def read_groups(path: Path, on_bad):
    """Yield `(key, [(TarInfo, bytes), ...])` per sample (consecutive members sharing a key).

    Returns (via StopIteration.value) `(n_members, truncated, error)`. On a read error, or a plain tar that
    lacks its end-of-archive blocks, the shard is truncated: the sample being read is reported to `on_bad`
    (it may be incomplete) and reading stops."""
    n, cur, members, seen = 0, None, None, set()    # members is None while a duplicate group is skipped
    truncated, error = False, None
    try:
        with tarfile.open(path, 'r|*') as tf:
            for ti in tf:
                if not ti.isfile():
                    continue
                kx = _split(ti.name)
                if kx is not None and kx[0] != cur:     # a new sample starts: the previous one is complete
                    if members is not None:
                        yield cur, members
                    cur, members = kx[0], []
                    if cur in seen:
                        on_bad(cur, 'duplicate_key', 'key seen earlier in this shard')
                        members = None
                    seen.add(cur)
                data = tf.extractfile(ti).read()        # raises if the file ends inside this member
                n += 1
                if kx is None:
                    on_bad(ti.name, 'no_extension', 'member name has no extension')
                elif members is not None:
                    members.append((ti, data))
            end = tf.offset
        if path.suffix == '.tar':                     # a complete plain tar ends with two zero blocks
            with open(path, 'rb') as f:
                f.seek(end)
                tail = f.read(1024)
            if len(tail) < 1024 or tail.strip(b'\0'):
                truncated, error = True, f'no end-of-archive marker after byte {end} (file cut short?)'
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        truncated, error = True, f'{type(e).__name__}: {e}'
    if members is not None:
        if truncated:
            on_bad(cur, 'truncated', f'last sample of a truncated shard ({error})')
        else:
            yield cur, members
    return n, truncated, error


# ----------------------------------------------------------------------------------------------- annotating
class Annotator:
    "Parser and segmenter of one process, built on first use."
    def __init__(self, cfg: AnnotateConfig):
        self.cfg, self._masker = cfg, None
        from powerclip.parsing import ParserConfig
        self.parser_cfg = ParserConfig(name=cfg.parser, batch_size=cfg.batch_size)

    def parse(self, texts: list[str]):
        from powerclip.parsing import parse_captions
        return parse_captions(texts, self.parser_cfg)

    def masker(self):
        if self._masker is None:
            from powerclip import regions as R
            c = self.cfg
            # masks are made on the model's view, so the whole segmented image is the patch grid's window
            grid = R.GridConfig(c.grid_h, c.grid_w, c.min_frac, c.keep_best, crop='full')
            if c.regions in ('slic', 'felzenszwalb'):
                sp = R.SuperpixelConfig(method=c.regions, n_segments=c.n_segments, scale=c.fz_scale)
                self._masker = lambda img: R.superpixel_masks(img, grid, sp)
            elif c.regions == 'sam2':
                self._masker = R.SAM2Masker(R.SAM2Config(
                    config=c.sam2_config, checkpoint=c.sam2_checkpoint, random_weights_ok=c.sam2_random_weights_ok,
                    device=c.device, points_per_side=c.sam2_points_per_side), grid)
            else:
                raise ValueError(f'unknown regions method {c.regions!r}')
        return self._masker

    def regions(self, image) -> tuple[bytes, object]:
        from powerclip.regions import encode_regions, model_view
        gm = self.masker()(model_view(image, self.cfg.seg_size, self.cfg.crop))
        return encode_regions(gm.masks.numpy(), self.cfg.grid_h, self.cfg.grid_w, self.cfg.regions), gm


def check_sample(key: str, members: list) -> tuple[dict | None, tuple[str, str] | None]:
    "Decode and validate one sample: ({'image', 'text', 'members'}, None) or (None, (reason, detail))."
    from PIL import Image
    from powerclip.data import IMAGE_EXTS                 # here, so that the command line answers at once
    from powerclip.parsing import caption_problem
    by_ext = {_split(ti.name)[1]: data for ti, data in members}
    img_ext = next((e[1:] for e in IMAGE_EXTS if e[1:] in by_ext), None)   # member keys are suffixes without the dot
    if img_ext is None:
        return None, ('missing_image', f'no {"/".join(e[1:] for e in IMAGE_EXTS)} member')
    try:
        with Image.open(io.BytesIO(by_ext[img_ext])) as im:
            image = im.convert('RGB')
    except Exception as e:
        return None, ('bad_image', f'{type(e).__name__}: {e}'[:300])
    if 'txt' not in by_ext:
        return None, ('missing_txt', 'no .txt member')
    if why := caption_problem(by_ext['txt']):
        return None, ('bad_txt', why[:300])   # the trainer's rule too
    text = by_ext['txt'].decode('utf-8')
    if 'json' in by_ext:
        try:
            json.loads(by_ext['json'])
        except Exception as e:
            return None, ('bad_json', f'{type(e).__name__}: {e}'[:300])
    return dict(image=image, text=text, has_json='json' in by_ext), None


def _add(tw: tarfile.TarFile, name: str, data: bytes, like: tarfile.TarInfo):
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode = len(data), like.mtime, like.mode   # copied times keep outputs reproducible
    tw.addfile(ti, io.BytesIO(data))


def annotate_shard(shard: Path, cfg: AnnotateConfig, ann: Annotator | None = None, run: str | None = None) -> dict:
    """Annotate one shard into `cfg.out` (atomically); returns its stats (also written next to it). `run`: the
    id of the run holding `cfg.out` (`hold_output`); the shard is committed only while that run holds it."""
    t0 = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rid = run or f'direct-{os.getpid()}-{secrets.token_hex(4)}'
    tar_path, tmp_path, stats_path = out_paths(shard, out, rid)
    ann = ann or Annotator(cfg)
    bad: list[dict] = []
    c = Counter()
    reg = Counter()
    parsers = Counter()

    def on_bad(key, reason, detail):
        bad.append(dict(key=key, reason=reason, detail=detail))

    def flush(batch, tw):
        trees = ann.parse([s['text'] for _, _, s in batch]) if batch else []
        for (key, members, s), tree in zip(batch, trees):
            parsers[tree.parser] += 1
            if not s['has_json']:
                c['no_json'] += 1
            new = [('tree.json', json.dumps(tree.to_dict(), ensure_ascii=False).encode('utf-8'))]
            if cfg.regions != 'none':
                blob, gm = ann.regions(s['image'])
                new.append(('regions.npz', blob))
                reg['masks'] += len(gm.masks)
                reg['pixel_masks'] += gm.n_input
                reg['empty'] += gm.n_empty
                reg['thin'] += gm.n_thin
                reg['dropped'] += gm.n_dropped
                reg['images_without_masks'] += len(gm.masks) == 0
            for ti, data in members:
                if _split(ti.name)[1] in OURS:
                    c['replaced_members'] += 1
                    continue
                _add(tw, ti.name, data, ti)
            for ext, data in new:
                _add(tw, f'{key}.{ext}', data, members[0][0])
            c['written'] += 1

    if shard.exists() and shard.stat().st_size == 0:
        raise ShardError('not a tar shard: the file is empty (0 bytes)')
    with open(tmp_path, 'wb') as f:
        with tarfile.open(fileobj=f, mode='w') as tw:
            gen, batch = read_groups(shard, on_bad), []
            while True:
                try:
                    key, members = next(gen)
                except StopIteration as stop:
                    n_members, truncated, error = stop.value
                    break
                c['read'] += 1
                s, why = check_sample(key, members)
                if why:
                    on_bad(key, *why)
                    continue
                batch.append((key, members, s))
                if len(batch) >= cfg.batch_size:
                    flush(batch, tw)
                    batch = []
            flush(batch, tw)
        f.flush()
        os.fsync(f.fileno())
    if n_members == 0 and truncated:                   # nothing could be read: not a tar (or cut in its 1st member)
        tmp_path.unlink(missing_ok=True)
        raise ShardError(f'not a tar shard: nothing readable ({error})')
    # samples rejected while reading were never yielded: count them as read, so that read = written + bad
    c['read'] += sum(b['reason'] in ('truncated', 'duplicate_key', 'no_extension') for b in bad)
    stats = dict(
        version=STATS_VERSION, shard=shard.name, input=str(shard), input_path=str(shard.resolve()),
        input_bytes=shard.stat().st_size if shard.exists() else None,
        output=str(tar_path), settings=cfg.fingerprint(), members_read=n_members, samples_read=c['read'],
        written=c['written'], n_bad=len(bad), bad_by_reason=dict(Counter(b['reason'] for b in bad)), bad=bad,
        truncated=truncated, read_error=error, no_json=c['no_json'],
        replaced_members=c['replaced_members'], parsers=dict(parsers), seconds=round(time.time() - t0, 3))
    if cfg.regions != 'none':
        # 0 in a shard of no sample
        counts = ('masks', 'pixel_masks', 'empty', 'thin', 'dropped', 'images_without_masks')
        stats['regions'] = dict(method=cfg.regions, grid=[cfg.grid_h, cfg.grid_w], **{k: reg[k] for k in counts},
                                masks_per_image=round(reg['masks'] / max(c['written'], 1), 3))
    if run is not None and not holds_output(out, run):  # a later run took the directory over: leave it to that run
        tmp_path.unlink(missing_ok=True)
        raise RuntimeError(f'{out} is now held by another run; {shard.name} left to it')
    os.replace(tmp_path, tar_path)                     # the shard is complete ...
    tmp_stats = stats_path.with_name(f'{stats_path.name}.{rid}.partial')
    tmp_stats.write_text(json.dumps(stats, indent=1))
    os.replace(tmp_stats, stats_path)                  # ... and now it counts as finished
    return stats


# ----------------------------------------------------------------------------------------------- running
_ANN: Annotator | None = None


def die_with_parent(parent: int):
    """End this process when `parent` (the process that started it) ends, kill -9 included: Linux's
    PR_SET_PDEATHSIG, plus a thread that polls the parent pid (other systems, and the instant before prctl)."""
    if sys.platform.startswith('linux'):
        import ctypes
        import signal
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name='die-with-parent', daemon=True).start()


def _init_worker(cfg_dict: dict, threads: int, parent: int):
    global _ANN
    die_with_parent(parent)                            # first: a worker must never outlive its run
    import torch
    torch.set_num_threads(threads)                     # N processes x 1 thread, not N x all cores
    _ANN = Annotator(AnnotateConfig(**cfg_dict))


def _work(shard: str, cfg_dict: dict, run: str) -> dict:
    try:
        return annotate_shard(Path(shard), AnnotateConfig(**cfg_dict), _ANN, run)
    except ShardError as e:        # as text: the class pickles by its module's name, which differs under `python x.py`
        return {'_shard_error': str(e)}


def summarize(all_stats: list[dict], failed: dict, n_skipped: int, seconds: float) -> dict:
    "Totals over shards (finished earlier or now) for summary.json and the terminal."
    tot = Counter()
    bad = Counter()
    parsers = Counter()
    reg = Counter()
    for s in all_stats:
        for k in ('samples_read', 'written', 'n_bad', 'no_json', 'members_read'):
            tot[k] += s[k]
        bad.update(s['bad_by_reason'])
        parsers.update(s['parsers'])
        for k, v in s.get('regions', {}).items():
            if isinstance(v, int) and not isinstance(v, bool):
                reg[k] += v
    done_now = [s for s in all_stats if not s.get('_skipped')]
    return dict(shards=len(all_stats) + len(failed), finished_now=len(done_now), skipped_finished=n_skipped,
                failed=failed, truncated_shards={s['shard']: s['read_error'] for s in all_stats if s['truncated']},
                bad_by_reason=dict(bad), parsers=dict(parsers), regions=dict(reg), seconds=round(seconds, 2),
                samples_per_second_now=round(sum(s['samples_read'] for s in done_now) / max(seconds, 1e-9), 2),
                **{k: tot[k] for k in ('samples_read', 'written', 'n_bad', 'no_json', 'members_read')})


def check_config(cfg: AnnotateConfig):
    "Raise UsageError for settings that cannot work."
    if cfg.regions == 'sam2' and cfg.sam2_checkpoint is None and not cfg.sam2_random_weights_ok:
        raise UsageError('--regions sam2 needs --sam2-checkpoint (download a SAM2 checkpoint first)')
    try:       # the project's one check of a number (finite, in range: NaN passes every `x < lo`)
        for name in ('workers', 'batch_size', 'grid_h', 'grid_w', 'seg_size', 'n_segments', 'sam2_points_per_side'):
            check_number(f'--{name.replace("_", "-")}', getattr(cfg, name), 1, integer=True)
        check_number('--min-frac', cfg.min_frac, 0, 1, lo_open=True)      # a share of a patch: (0, 1]
        check_number('--fz-scale', cfg.fz_scale, 0, lo_open=True)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run(shards: list[Path], cfg: AnnotateConfig, progress: bool = True) -> dict:
    "Annotate `shards` into `cfg.out`, skipping finished ones; writes and returns the summary."
    check_config(cfg)
    with hold_output(Path(cfg.out)) as run_id:
        return _run(shards, cfg, run_id, progress)


def _run(shards: list[Path], cfg: AnnotateConfig, run_id: str, progress: bool) -> dict:
    from tqdm.auto import tqdm
    out = Path(cfg.out)
    t0 = time.time()
    all_stats, todo = [], []
    clash = [(p, why) for p in shards if (why := conflict(p, cfg))]
    if clash:                                          # before any work: finished shards are never replaced
        raise UsageError(f'--out: {str(out)!r} holds {len(clash)} finished shard(s) this command would replace: '
                         f'{clash[0][1]}; give another --out, or --overwrite to replace them')
    for p in shards:
        st = finished(p, cfg)
        if st is not None:
            all_stats.append(dict(st, _skipped=True))
        else:
            todo.append(p)
    n_skipped = len(all_stats)
    failed: dict[str, str] = {}
    missing = [p for p in todo if not p.exists()]
    for p in missing:
        failed[p.name] = 'input shard does not exist'
    todo = [p for p in todo if p.exists()]
    bar = tqdm(total=len(todo), desc=f'shards ({n_skipped} already done)', unit='shard', disable=not progress)

    def done(st):
        all_stats.append(st)
        bar.set_postfix(written=sum(s['written'] for s in all_stats), bad=sum(s['n_bad'] for s in all_stats))
        bar.update()

    cfg_dict = asdict(cfg)
    if cfg.workers <= 1 or len(todo) <= 1:
        ann = Annotator(cfg)
        for p in todo:
            try:
                done(annotate_shard(p, cfg, ann, run_id))
            except ShardError as e:                    # a file that is not a shard: its one line in the report
                failed[p.name] = str(e)
            except Exception as e:
                failed[p.name] = f'{type(e).__name__}: {e}'
                traceback.print_exc()
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        threads = max(1, (os.cpu_count() or 1) // cfg.workers)
        # workers are started from this (main) thread, so PR_SET_PDEATHSIG ties them to this process
        with ProcessPoolExecutor(cfg.workers, mp_context=mp.get_context('spawn'),
                                 initializer=_init_worker, initargs=(cfg_dict, threads, os.getpid())) as ex:
            futs = {ex.submit(_work, str(p), cfg_dict, run_id): p for p in todo}
            for fu in as_completed(futs):
                try:
                    st = fu.result()
                    if '_shard_error' in st:
                        failed[futs[fu].name] = st['_shard_error']
                    else:
                        done(st)
                except Exception as e:
                    failed[futs[fu].name] = f'{type(e).__name__}: {e}'
    bar.close()
    summary = summarize(all_stats, failed, n_skipped, time.time() - t0)
    tmp = out / 'summary.json.partial'
    inputs = [str(p.resolve()) for p in shards]
    tmp.write_text(json.dumps(dict(summary, settings=cfg.fingerprint(), inputs=inputs), indent=1))
    os.replace(tmp, out / 'summary.json')
    return summary


def report(summary: dict) -> str:
    "Human-readable lines of a summary."
    s = summary
    lines = [f"shards: {s['shards']} ({s['finished_now']} annotated now, {s['skipped_finished']} already finished, "
             f"{len(s['failed'])} failed)",
             f"samples: {s['samples_read']} read, {s['written']} written, {s['n_bad']} bad "
             f"{s['bad_by_reason'] or ''}; parsers {s['parsers']}",
             f"time: {s['seconds']} s ({s['samples_per_second_now']} samples/s this run)"]
    if s['regions']:
        lines.append(f"regions: {s['regions']}")
    for name, err in s['truncated_shards'].items():
        lines.append(f'TRUNCATED {name}: {err}')
    for name, err in s['failed'].items():
        lines.append(f'FAILED {name}: {err}')
    lines.append('bad samples are listed by key and reason in each {shard}.stats.json')
    return '\n'.join(lines)


def parse_args(argv=None) -> tuple[list[Path], AnnotateConfig, bool]:
    "Command line -> (shards, settings, progress). Raises UsageError for anything that cannot work."
    d = AnnotateConfig()
    ap = ArgumentParser(description=__doc__.split('\n')[0], epilog=__doc__.split('\n', 2)[2],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('shards', nargs='+', help='shard files, directories (all *.tar), brace patterns or globs')
    ap.add_argument('--out', required=True, help='output directory (created if missing)')
    ap.add_argument('--workers', type=int, default=d.workers, help='processes (one shard each at a time)')
    ap.add_argument('--regions', choices=['none', 'slic', 'felzenszwalb', 'sam2'], default=d.regions)
    ap.add_argument('--grid', default=str(d.grid_h), metavar='G|HxW',
                    help='patch grid: G (square) or HxW; 14 for ViT-B/16 at 224 px')
    ap.add_argument('--min-frac', type=float, default=d.min_frac)
    ap.add_argument('--no-keep-best', action='store_true', help='drop masks too thin to cover half a patch')
    ap.add_argument('--crop', choices=['center', 'full'], default=d.crop,
                    help="the part of the image the model sees: 'center' square (open_clip's eval transform) or 'full'")
    ap.add_argument('--seg-size', type=int, default=d.seg_size, help='side of the model view that is segmented')
    ap.add_argument('--n-segments', type=int, default=d.n_segments)
    ap.add_argument('--fz-scale', type=float, default=d.fz_scale)
    ap.add_argument('--sam2-config', default=d.sam2_config)
    ap.add_argument('--sam2-checkpoint', default=None)
    ap.add_argument('--sam2-points-per-side', type=int, default=d.sam2_points_per_side)
    ap.add_argument('--device', default=d.device)
    ap.add_argument('--parser', choices=['auto', 'spacy', 'benepar'], default=d.parser)
    ap.add_argument('--batch-size', type=int, default=d.batch_size)
    ap.add_argument('--overwrite', action='store_true', help='redo finished shards')
    ap.add_argument('--no-progress', action='store_true')
    ap.add_argument('--debug', action='store_true', help='show the traceback of an error')
    a = ap.parse_args(argv)
    try:
        gh, gw = (int(x) for x in (a.grid.lower().split('x') * 2)[:2]) if 'x' in a.grid.lower() else (int(a.grid),) * 2
    except ValueError:
        raise UsageError(f'--grid: takes G or HxW (14, 16x12), got {a.grid!r}') from None
    cfg = AnnotateConfig(out=a.out, regions=a.regions, grid_h=gh, grid_w=gw, min_frac=a.min_frac,
                         keep_best=not a.no_keep_best, crop=a.crop, seg_size=a.seg_size, n_segments=a.n_segments,
                         fz_scale=a.fz_scale, sam2_config=a.sam2_config, sam2_checkpoint=a.sam2_checkpoint,
                         sam2_points_per_side=a.sam2_points_per_side, device=a.device, parser=a.parser,
                         batch_size=a.batch_size, workers=a.workers, overwrite=a.overwrite)
    check_config(cfg)
    shards = expand_inputs(a.shards)
    check_inputs(a.shards, shards, a.out)
    return shards, cfg, not a.no_progress


def main(argv=None) -> int:
    """The command line: 0 done, 1 some shard failed, 2 a usage error (one line on stderr; --debug or POWERCLIP_DEBUG=1:
    the traceback), as every command of the project (`powerclip.commandline`)."""
    return run_main(_main, argv, 'annotate_shards')


def _main(argv) -> int:
    with usage_errors():                               # the arguments and the paths, before any work
        shards, cfg, progress = parse_args(argv)
    summary = run(shards, cfg, progress=progress)      # a busy --out is a UsageError too (hold_output)
    print(report(summary))
    return 1 if summary['failed'] else 0


if __name__ == '__main__':
    sys.exit(main())
