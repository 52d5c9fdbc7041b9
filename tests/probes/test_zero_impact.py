"""A probe never changes training: same seed, probe on or off, identical parameters after N steps."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.train import build_run


def _trained(cfg):
    run = build_run(cfg)
    run.fit()
    return {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("probe", ["[gns]"])
def test_parameters_identical_with_probe_on_and_off(tiny_cfg, probe):
    base = _trained(tiny_cfg())
    cfg = tiny_cfg(f"probe={probe}")
    probed = _trained(cfg)
    assert base.keys() == probed.keys()
    assert all(torch.equal(base[n], probed[n]) for n in base)
    acc = EventAccumulator(f"{cfg.paths.output_dir}/tensorboard")
    acc.Reload()
    assert {"probe/gns/gns_tr_sigma", "probe/gns/B_simple", "probe/gns/gns_ess"} <= set(acc.Tags()["scalars"])
