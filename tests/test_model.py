"""powerclip.model beyond the notebook cells: DDP through `Encoder`, checkpoints through plain open_clip."""
import os

import open_clip
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from powerclip.methods import powerset_inputs
from powerclip.model import Encoder, create_model, encode, register_configs


def _batch(C=3, N=16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(C, 77, dtype=torch.long)
    tokens[:, 0] = 49406
    tokens[:, 1:4] = 320
    tokens[:, 4] = 49407
    leaf = torch.zeros(C, 2, 77, dtype=torch.bool)
    leaf[:, 0, 1:3] = True
    leaf[:, 1, 3] = True
    masks = torch.rand(C, 4, N, generator=g) > 0.5
    masks[:, :, 0] = True
    return dict(image=torch.randn(C, 3, 32, 32, generator=g), tokens=tokens, leaf_tokens=leaf,
                incidence=torch.ones(C, 2, 2, dtype=torch.bool), node_valid=torch.ones(C, 2, dtype=torch.bool),
                region_masks=masks, region_valid=torch.ones(C, 4, dtype=torch.bool))


def test_ddp_encoder_single_process(tmp_path):
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', '29517')
    dist.init_process_group('gloo', rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, _, _ = create_model('powerclip-micro')
        ref = {n: p.detach().clone() for n, p in model.named_parameters()}
        b = _batch()
        ddp = DDP(Encoder(model))
        e = ddp(b['image'], b['tokens'])
        pi = powerset_inputs(e, b)
        (pi.regions.sum() + pi.phrases.sum() + (e['image'] * e['text']).sum()).backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p is not model.logit_scale)
        # the same numbers as calling encode directly
        with torch.no_grad():
            e2 = encode(model, b['image'], b['tokens'])
        torch.testing.assert_close(e['patches'], e2['patches'])
        # checkpoint of encoder.model loads with plain open_clip and open_clip key names
        torch.save(ddp.module.model.state_dict(), tmp_path / 'c.pt')
        register_configs()
        m2, _, _ = open_clip.create_model_and_transforms('powerclip-micro', pretrained=str(tmp_path / 'c.pt'))
        assert all(torch.equal(ref[n], p) for n, p in m2.named_parameters())
    finally:
        dist.destroy_process_group()
