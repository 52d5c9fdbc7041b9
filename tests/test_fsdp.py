"""Sharded training (trainer=fsdp: FSDP2 over 2 CPU processes, gloo) through the real CLI against trainer=ddp.

Truths: the DDP run on the same rollouts (`generator.seed_per_prefix=true`; SGD, so float-rounding differences stay
float-sized), each rank's parameters gathered whole (tests/helpers.DumpTrainableParams), the rewards both runs
logged, and for resume a straight run of the same length.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from grpo_lightning.accel.completion_forward import length_runs
from tests.forked_cli import cli_run
from tests.test_ddp import ROOT, run, scalars
from tests.test_selfplay_run import SELFPLAY

FSDP = ["trainer=fsdp", "trainer.devices=2", "trainer.accelerator=cpu"]
FULL = ["model.lora.enabled=false", "loss.beta=0.04", "optim.optimizer.lr=0.05"]  # a reference, sharded as well


@pytest.fixture(scope="module", params=["lora", "full"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    extra = FULL if request.param == "full" else []
    return {"ddp": run(root / "ddp", 2, *extra), "fsdp": run(root / "fsdp", 2, *extra, *FSDP), "kind": request.param}


def test_fsdp_trains_what_ddp_trains(pair):
    fsdp, ddp = pair["fsdp"]["dir"], pair["ddp"]["dir"]
    rank0, rank1 = torch.load(fsdp / "rank0.pt"), torch.load(fsdp / "rank1.pt")
    reference = torch.load(ddp / "rank0.pt")
    assert rank0.keys() == rank1.keys() == reference.keys()
    assert all(torch.equal(rank0[n], rank1[n]) for n in rank0)  # one model, gathered from two halves
    for name in reference:
        torch.testing.assert_close(rank0[name], reference[name], rtol=1e-4, atol=1e-5, msg=name)
    # it trained: LoRA B starts at 0
    if pair["kind"] == "lora":
        assert any(rank0[n].abs().max() > 0 for n in rank0 if "lora_B" in n)
    assert scalars(fsdp, "train/reward_mean") == pytest.approx(scalars(ddp, "train/reward_mean"), rel=1e-6)
    assert scalars(fsdp, "train/loss") == pytest.approx(scalars(ddp, "train/loss"), rel=1e-3, abs=1e-6)
    if pair["kind"] == "full":
        assert scalars(fsdp, "train/kl") == pytest.approx(scalars(ddp, "train/kl"), rel=1e-3, abs=1e-7)
        assert max(scalars(fsdp, "train/kl")) > 0  # the (sharded) reference was scored: KL after the first step


def test_fsdp_saves_the_whole_policy(pair):
    """The policy folder holds whole tensors gathered from both shards, equal to the dumped parameters."""
    from safetensors.torch import load_file

    fsdp = pair["fsdp"]["dir"]
    dumped = torch.load(fsdp / "rank0.pt")
    if pair["kind"] == "lora":
        saved = load_file(fsdp / "policy" / "adapter_model.safetensors")
        lora = {n: t for n, t in dumped.items() if "lora_" in n}
        assert len(saved) == len(lora)
        for name, tensor in lora.items():  # peft drops the adapter name: ...lora_A.default.weight -> lora_A.weight
            assert torch.equal(saved[name.replace(".default", "")], tensor), name
    else:
        saved = load_file(fsdp / "policy" / "model.safetensors")
        for name, tensor in dumped.items():
            if name in saved:
                assert torch.equal(saved[name], tensor), name
        assert sum(name in saved for name in dumped) >= len(dumped) - 1  # a tied head is saved once


def test_fsdp_resume_continues_exactly(tmp_path):
    """2 rounds, then resumed to 3 (AdamW: its sharded moments go through the checkpoint as full tensors), equals
    3 rounds straight, bitwise."""
    common = [*FSDP, *FULL, "optim.optimizer._target_=torch.optim.AdamW", "optim.optimizer.lr=1e-3"]
    straight = run(tmp_path / "straight", 2, *common, "trainer.max_epochs=3")
    split = run(tmp_path / "split", 2, *common, "trainer.max_epochs=2")
    resumed = run(tmp_path / "resumed", 2, *common, "trainer.max_epochs=3", f"ckpt_path={split['dir']}")
    assert "resuming from" in resumed["stdout"]
    a, b = torch.load(straight["dir"] / "rank0.pt"), torch.load(resumed["dir"] / "rank0.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    c = torch.load(split["dir"] / "rank0.pt")
    assert any(not torch.equal(a[n], c[n]) for n in a)  # the third round trained


def cpu_backbone_calls(batch: dict) -> int:
    """The backbone calls the CPU's forward levers (`perf=cpu_fast`: runs by length, shared prompts) would make for
    a recorded micro-batch, counted from accel/completion_forward.py's rules."""
    runs = length_runs(batch["lengths"])
    return 1 + sum(length > 1 for _, length in runs) if batch["shared"] else len(runs)


@pytest.mark.slow
def test_fsdp_selfplay_ends_though_ranks_train_on_different_turns(tmp_path):
    """Self-play's games end after different numbers of turns on each rank, so the ranks' micro-batches differ in
    rows and lengths. Each backbone call gathers every decoder layer (a collective): with the CPU levers the ranks
    would make different numbers of calls and wait for each other for ever. The sharded run makes one call per
    forward and ends; a regression stops at trainer.collective_timeout_s instead of at the test's timeout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    start = time.monotonic()
    result = cli_run(
        f"hydra.run.dir={tmp_path}", *SELFPLAY, *FSDP, "trainer.collective_timeout_s=60",
        "+callbacks.batches._target_=tests.helpers.RecordTrainedBatches", f"+callbacks.batches.directory={tmp_path}",
        cwd=ROOT, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert time.monotonic() - start < 300
    ranks = [json.loads((tmp_path / f"batches{r}.json").read_text()) for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [2, 2]  # 2 rounds, one micro-batch each, on both ranks
    # the hazard was there: in some round the CPU levers would have made different numbers of backbone calls
    assert any(cpu_backbone_calls(a) != cpu_backbone_calls(b) for a, b in zip(*ranks, strict=True))
    assert (tmp_path / "policy").is_dir()
