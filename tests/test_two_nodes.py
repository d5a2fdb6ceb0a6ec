"""Two nodes on localhost: `torchrun --nnodes 2 --nproc_per_node 1` with a c10d rendezvous at 127.0.0.1, one agent per
node as two subprocesses (`--node-rank 0` and `1`).

1. The whole trainer: the logged losses of 3 steps of two nodes with 4 samples each equal those of one process with
   the doubled batch of 8 (as `tests/test_ddp.py` checks two processes on one node).
2. Webdataset shards (written by the repo's own `write_shard`), read by each node's loader with 2 DataLoader workers
   for two epochs: every sample key is counted on the node and worker that read it; no key is seen twice in an epoch,
   and the keys missing are exactly those of each worker stream's last incomplete batch (dropped, `23_data`).
"""
import io, json, os, signal, socket, subprocess, sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(target: list[str], timeout: int = 240) -> list[subprocess.CompletedProcess]:
    "`target` (-m module args, or a script and its args) on two torchrun nodes of one process each; both must succeed."
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
                               "--node-rank", str(n), "--local-addr", "127.0.0.1", *target],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)     # a group of its own: a timeout kills its workers too
             for n in (0, 1)]
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    for r in out:
        assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_two_nodes_trainer_equals_one_process(tmp_path):
    common = ["--preset", "smoke", "max_steps=3", "optim.warmup_steps=1", "progress=false", "tensorboard=false"]
    _two_nodes(["-m", "powerclip.train", *common, "data.batch_size=4", f"out_dir={tmp_path / 'two'}"])
    from powerclip.runrecord import run_threads
    from powerclip.train import main, read_metrics
    with run_threads(1):                     # the one-process reference: the same command line, in this process
        assert main([*common, "data.batch_size=8", f"out_dir={tmp_path / 'one'}"]) == 0
    two, one = (read_metrics(tmp_path / d / "metrics.csv") for d in ("two", "one"))
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    cfg = (tmp_path / "two" / "config.yaml").read_text()
    assert "batch_size: 4" in cfg
    for a, b in zip(two, one):
        for k in ("loss", "clip", "powerset"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a, b)


# run under torchrun on each node: its loader's keys per worker stream and per node, for epochs 0 and 1
_READER = '''
import json, sys
from powerclip import dist as pdist
from powerclip.config import load_config
from powerclip.data import WdsItems, make_loader
from powerclip.train import validate
shards, out = sys.argv[1], sys.argv[2]
ctx = pdist.init_distributed("cpu")
cfg = load_config("smoke", {"data.source": "wds", "data.shards": shards, "data.batch_size": 2, "data.workers": 2,
                            "data.shuffle_buffer": 4, "max_steps": 10}, method="clip")
spec = validate(cfg, ctx.world_size).spec
res = {}
for epoch in (0, 1):
    ds = WdsItems(spec, epoch, rank=ctx.rank, world_size=ctx.world_size)
    streams = {w: [int(i) for b in ds.stream(w) if "index" in b for i in b["index"]] for w in range(2)}
    loader = [int(i) for b in make_loader(spec, epoch, rank=ctx.rank, world_size=ctx.world_size) for i in b["index"]]
    res[epoch] = dict(streams=streams, loader=loader, shards={w: ds.shards(w) for w in range(2)})
json.dump(dict(rank=ctx.rank, res=res), open(f"{out}.{ctx.rank}", "w"))
pdist.cleanup(ctx)
'''


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def test_two_nodes_shards_split_by_node_and_worker(tmp_path):
    from powerclip.data import key_index, write_shard
    sizes = [5, 3, 6, 4, 5, 2, 7]          # 7 shards of unequal sizes over 2 nodes x 2 workers: 32 samples
    keys, n = {}, 0
    for s, size in enumerate(sizes):
        samples = []
        for _ in range(size):
            k = f"{n:09d}"
            samples.append({"__key__": k, "jpg": _jpeg(n), "txt": f"a photo of a red car number {n}"})
            keys[key_index(k)] = (s, k)
            n += 1
        write_shard(tmp_path / f"{s}.tar", samples)
    script = tmp_path / "reader.py"
    script.write_text(_READER)
    _two_nodes([str(script), str(tmp_path / "{0..6}.tar"), str(tmp_path / "keys")])
    got = [json.loads((tmp_path / f"keys.{r}").read_text()) for r in (0, 1)]
    assert sorted(g["rank"] for g in got) == [0, 1]
    for epoch in ("0", "1"):
        seen, dropped, shard_sets = [], 0, []
        for g in got:
            e = g["res"][epoch]
            streams = e["streams"]
            # the node's DataLoader (2 workers, taking turns) reads exactly its two worker streams
            assert sorted(e["loader"]) == sorted(streams["0"] + streams["1"])
            for w, idx in streams.items():
                shard_ids = [int(Path(u).stem) for u in e["shards"][w]]
                shard_sets.append(set(shard_ids))
                in_stream = sum(sizes[s] for s in shard_ids)
                assert all(keys[i][0] in shard_ids for i in idx)      # a worker reads only its own shards
                assert in_stream - len(idx) == in_stream % 2           # only the last incomplete batch (B = 2) is lost
                dropped += in_stream - len(idx)
            seen += e["loader"]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was seen twice"
        assert set(seen) <= set(keys) and len(keys) - len(seen) == dropped, (epoch, len(seen), dropped)
        assert sum(len(s) for s in shard_sets) == len(sizes) and set().union(*shard_sets) == set(range(len(sizes)))
    # the two epochs order the shards differently
    assert got[0]["res"]["0"]["shards"] != got[0]["res"]["1"]["shards"]
