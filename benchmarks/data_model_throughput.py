"""Throughput of the world loader (samples/s) and of one powerclip-tiny training step (encode + powerset inputs
+ PowerCLIP loss + backward), on this machine's CPU.

    .venv/bin/python benchmarks/data_model_throughput.py [--batch 64] [--workers 2] [--steps 10]
"""
import sys
import time

import torch

import _checks
from powerclip.commandline import ArgumentParser, run_main, usage_errors
from powerclip.data import BatchNeeds, BatchSpec, DataConfig, make_loader
from powerclip.loss import PowerCLIPLossConfig, powerclip_loss
from powerclip.methods import powerset_inputs
from powerclip.model import create_model, encode, model_geometry


def main(argv=None):
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--batch', type=int, default=64)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--steps', type=int, default=10)
    ap.add_argument('--model', default='powerclip-tiny')
    ap.add_argument('--debug', action='store_true', help='show the traceback of a usage error')
    with usage_errors():
        a = ap.parse_args(argv)
        _checks.at_least(a, 1, 'batch', 'steps')
        _checks.at_least(a, 0, 'workers')
        _checks.arch('--model', a.model)
    print(f'torch threads {torch.get_num_threads()}, batch {a.batch}, workers {a.workers}')

    spec = BatchSpec(DataConfig(batch_size=a.batch, workers=a.workers, world_length=a.batch * (a.steps + 2)),
                     model_geometry(a.model), BatchNeeds(tree=True, regions=10))    # what PowerCLIP-R asks for
    it = iter(make_loader(spec, epoch=0))
    batch = next(it)                      # worker start-up not timed
    t0 = time.perf_counter()
    n = 0
    for b in it:
        n += len(b['index'])
    dt = time.perf_counter() - t0
    print(f'world loader: {n / dt:.0f} samples/s ({n} samples, M=10 random boxes, {spec.geometry.image_size} px)')

    model, _, _ = create_model(a.model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lcfg = PowerCLIPLossConfig()
    def step():
        e = encode(model, batch['image'], batch['tokens'])
        t = powerclip_loss(e['image'], e['text'], e['logit_scale'], powerset_inputs(e, batch), lcfg)
        opt.zero_grad()
        (t['clip'] + t['powerset']).backward()
        opt.step()
    step()                                # warm-up
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dt = (time.perf_counter() - t0) / a.steps
    print(f'{a.model} train step: {dt * 1000:.0f} ms/step = {a.batch / dt:.0f} images/s')


if __name__ == '__main__':
    sys.exit(run_main(main, prog='data_model_throughput.py'))
