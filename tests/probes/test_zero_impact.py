"""A probe never changes training: same seed, probe on or off, identical parameters after N steps."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.train import build_run


def _trained(cfg):
    run = build_run(cfg)
    run.fit()
    return {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}


EXPECTED = {
    # B_simple and gns_mu appear only once the |G|^2 estimate is positive (never a negative batch size).
    "gns": {
        "probe/gns/gns_tr_sigma",
        "probe/gns/gns_G2",
        "probe/gns/gns_B_small",
        "probe/gns/gns_B_big",
        "probe/gns/gns_consistency_ratio",
        "probe/gns/B_simple_defined",
    },
    "entropy": {
        "probe/entropy/seq_mean",
        "probe/entropy/seq_std",
        "probe/entropy/seq_min",
        "probe/entropy/seq_max",
        "probe/entropy/adv_corr",
        "probe/entropy/cov_logp_adv",
        "probe/entropy/projected_delta_cov",
        "probe/entropy/projected_delta_first_order",
        "probe/entropy/actual_delta",
        "probe/entropy/sign_agreement_cov",
        "probe/entropy/sign_agreement_first_order",
    },
}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_parameters_identical_with_probes_on_and_off(tiny_cfg, lora):
    base = _trained(tiny_cfg(f"model.lora.enabled={lora}"))
    cfg = tiny_cfg(
        f"model.lora.enabled={lora}",
        "probe=[gns,entropy]",
        "probe.entropy.measure_actual=true",
        "probe.entropy.first_order=true",
    )
    probed = _trained(cfg)
    assert base.keys() == probed.keys()
    assert all(torch.equal(base[n], probed[n]) for n in base)
    acc = EventAccumulator(f"{cfg.paths.output_dir}/tensorboard")
    acc.Reload()
    assert EXPECTED["gns"] | EXPECTED["entropy"] <= set(acc.Tags()["scalars"])
    # The entropy probe's extra gradient pass fires the same parameter hooks; GNS must not count it.
    ratios = [e.value for e in acc.Scalars("probe/gns/gns_consistency_ratio")]
    assert ratios and all(abs(r - 1.0) < 1e-5 for r in ratios)
