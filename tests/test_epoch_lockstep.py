"""Epochs of unequal length across processes (issue 32): on shards without `data.samples_per_epoch`, two nodes whose
shards hold 16 and 8 samples train in lockstep (`powerclip.train.Lockstep`): the epoch ends for both when the shorter
runs out, the log says so, and the run finishes (before, the longer process went on alone into the next step's
gather while the other waited in its epoch-end sum: a hang until the collective timeout)."""
from powerclip.train import read_metrics

from test_two_nodes import _jpeg, _two_nodes


def test_unequal_shards_end_the_epoch_together(tmp_path):
    from powerclip.data import write_shard
    n = 0
    for s in range(3):                     # 3 shards of 8 over 2 processes: 2 shards (8 batches) and 1 (4 batches)
        samples = []
        for _ in range(8):
            samples.append({"__key__": f"{n:09d}", "jpg": _jpeg(n), "txt": f"a photo of a red car number {n}"})
            n += 1
        write_shard(tmp_path / f"{s}.tar", samples)
    out = tmp_path / "run"
    res = _two_nodes(["-m", "powerclip.train", "--preset", "smoke", "--method", "clip", "data.source=wds",
                      f"data.shards={tmp_path}/{{0..2}}.tar", "data.workers=0", "data.batch_size=2", "max_steps=6",
                      "log_every=1", "progress=false", "tensorboard=false", f"out_dir={out}"], timeout=300)
    log = "".join(r.stderr for r in res)
    said = "epoch 0 ended at its batch 4, where a process's shards ran out: 1 of 2 processes still had batches"
    assert said in log, log
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["epoch"] for r in rows] == [0] * 4 + [1] * 2        # the second epoch began together after 4 steps
