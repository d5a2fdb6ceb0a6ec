"""Pack a folder of COCO photos and their captions (`../shared/data/coco_sample`: `images/`, `captions.jsonl`) into
webdataset shards in img2dataset's layout, for the GPU check's `real-shards` part (issue 38; `make real-shards`).

Each caption is a sample (`{key}.jpg`, `{key}.txt`, `{key}.json`: a photo with five captions gives five samples), its
photo resized as img2dataset's `center_crop` does (the shorter side to `--size`, the centre kept) and saved as a JPEG
of `--quality`; samples are dealt round-robin into `--shards` shards, so that every DataLoader worker of up to that many
has its own (never more shards than samples: no shard is empty). A non-empty `--out` is refused (its shards would mix
with these) unless `--overwrite`, which removes its `*.tar` first; each shard is written as `{name}.partial` and renamed
when complete, so an interrupted run leaves no cut shard under a shard's name. `data_prep/annotate_shards.py` then
adds parse trees and region masks.

    python data_prep/pack_coco_sample.py ../shared/data/coco_sample --out runs/real_shards/raw   # seconds
"""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

from powerclip.commandline import ArgumentParser, run_main, usage_errors


def center_crop(path: Path, size: int, quality: int) -> bytes:
    "The photo's shorter side resized to `size`, the centre `size` x `size` kept, as JPEG bytes."
    from PIL import Image
    im = Image.open(path).convert("RGB")
    s = size / min(im.size)
    im = im.resize((max(size, round(im.width * s)), max(size, round(im.height * s))), Image.BICUBIC)
    left, top = (im.width - size) // 2, (im.height - size) // 2
    buf = io.BytesIO()
    im.crop((left, top, left + size, top + size)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def samples(folder: Path, size: int, quality: int) -> list[dict]:
    "Every (photo, caption) of the folder as an img2dataset sample, in captions.jsonl's order."
    out = []
    for row in (json.loads(line) for line in (folder / "captions.jsonl").read_text().splitlines() if line.strip()):
        jpg = center_crop(folder / "images" / row["file_name"], size, quality)
        for i, cap in enumerate(row["captions"]):
            key = f"{row['image_id']:012d}{i}"
            out.append({"__key__": key, "jpg": jpg, "txt": cap,
                        "json": json.dumps(dict(key=key, caption=cap, url=row.get("flickr_url", ""),
                                                image_id=row["image_id"], width=size, height=size))})
    return out


def main(argv=None):
    ap = ArgumentParser(prog="pack_coco_sample.py", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a folder with images/ and captions.jsonl")
    ap.add_argument("--out", type=Path, required=True, help="folder of the shards (00000.tar, ...)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--quality", type=int, default=70, help="JPEG quality (70: COCO's 1,195 samples in 18 MiB)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the shards of a non-empty --out (its *.tar removed first)")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    with usage_errors():
        a = ap.parse_args(argv)
        if not (a.folder / "captions.jsonl").is_file() or not (a.folder / "images").is_dir():
            raise ValueError(f"folder: {str(a.folder)!r} has no captions.jsonl and images/")
        if a.shards < 1 or a.size < 16 or not 1 <= a.quality <= 100:
            raise ValueError("--shards must be at least 1, --size at least 16, --quality in 1..100")
        if a.out.exists() and not a.out.is_dir():
            raise ValueError(f"--out: {str(a.out)!r} is a file; give a folder (created if missing)")
        held = sorted(a.out.iterdir()) if a.out.is_dir() else []
        if held and not a.overwrite:       # old shards would stay beside the new ones: samples twice, or stale
            raise ValueError(f"--out: {str(a.out)!r} is not empty ({len(held)} entries, e.g. {held[0].name!r}); "
                             "give an empty or new folder, or --overwrite to replace its shards")
    from powerclip.data import write_shard
    rows = samples(a.folder, a.size, a.quality)
    n = min(a.shards, len(rows))           # round-robin: more shards than samples would leave some empty
    if n < a.shards:
        print(f"--shards {a.shards} for {len(rows)} samples: writing {n} shards (no empty shard)")
    a.out.mkdir(parents=True, exist_ok=True)
    for old in [*a.out.glob("*.tar"), *a.out.glob("*.tar.partial")]:   # --overwrite: no stale shard stays
        old.unlink()
    for s in range(n):
        final = a.out / f"{s:05d}.tar"
        tmp = final.with_name(final.name + ".partial")
        try:
            write_shard(tmp, rows[s::n])
        except BaseException:              # Ctrl-C or an error: no cut shard is left, under any name
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, final)             # complete: now under its name
    size = sum(f.stat().st_size for f in a.out.glob("*.tar"))
    print(f"{len(rows)} samples ({len({r['jpg'] for r in rows})} photos) in {n} shards, {size / 2**20:.1f} MiB: "
          f"{a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, prog="pack_coco_sample.py"))
