"""grpo_lightning/sharding.py on 2 CPU processes (gloo, 127.0.0.1), without Lightning: the sharding plan, the
gathers the engines and checkpoints use, and the sharded gradient norm, each against the same model unsharded.
The refusals of the config check name their key.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lightning.generation.vllm.weights import policy_weights
from grpo_lightning.sharding import (
    call_as_forward,
    full_state_dict,
    gathered_for_sampling,
    gathered_in_pieces,
    is_sharded,
    shard_module,
    sharded_norm,
)
from tests.test_bad_input import assert_clean_failure, cli


def tiny_llama(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # a nonzero adapter, so merged weights differ from the base
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    return model


def _worker(rank: int, port: int, lora: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        plain, model = tiny_llama(lora), tiny_llama(lora)
        shard_module(model, init_device_mesh("cpu", (2,)))
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        result = {"sharded": is_sharded(model) and not is_sharded(plain)}
        # a forward through the registered method, with a backward: gradients as the plain model's, sharded
        loss = call_as_forward(model, lambda m: m(input_ids=ids, labels=ids).loss, model)
        loss.backward()
        plain(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        result["norm"] = (
            sharded_norm(grads),
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in plain.parameters() if p.grad is not None])
            ).item(),
        )
        # sampling: gathered once, then rank 1 runs more forwards than rank 0 (no collective may run inside)
        with gathered_for_sampling(model), torch.no_grad():
            logits = [model(input_ids=ids).logits for _ in range(1 + 2 * rank)]
        result["logits"] = (logits[-1], plain(input_ids=ids).logits.detach())
        # the engines' pushes: gathered piece by piece, LoRA merged, as the plain model's
        result["weights"] = (dict(policy_weights(model, adapted_only=False)), dict(policy_weights(plain, False)))
        result["pieces"] = sum(1 for _ in gathered_in_pieces(model))
        result["state"] = (full_state_dict(model, trainable_only=lora), plain.state_dict())
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sharded_model_matches_the_plain_model(tmp_path, lora):
    from grpo_lightning.generation.vllm.engine_io import free_port

    mp.start_processes(_worker, args=(free_port(), lora, str(tmp_path)), nprocs=2, start_method="fork")
    results = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)}
    for rank, result in results.items():
        assert result["sharded"]
        norm, plain_norm = result["norm"]
        assert norm == pytest.approx(plain_norm, rel=1e-5)  # the same on both ranks, over both shards
        torch.testing.assert_close(*result["logits"], rtol=1e-5, atol=1e-6)
        pushed, plain = result["weights"]
        assert pushed.keys() == plain.keys()
        for name in plain:
            torch.testing.assert_close(pushed[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
        assert result["pieces"] == 3 + 1  # one per decoder layer, then the root
        state, plain_state = result["state"]
        if rank == 1:
            assert state == {}  # took part in every gather, kept nothing
            continue
        trainable = {n for n, p in tiny_llama(lora).named_parameters() if p.requires_grad}
        assert set(state) >= trainable and (not lora or set(state) == trainable)
        for name in state:
            torch.testing.assert_close(state[name], plain_state[name], msg=name)


LIGHTNING_FSDP = "lightning.pytorch.strategies.FSDPStrategy"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["trainer=fsdp", "trainer.accelerator=cpu", "rollout.max_staleness=1"], ["rollout.max_staleness=1"]),
        (
            ["trainer=ddp", "trainer.accelerator=cpu", "trainer.strategy=fsdp"],
            ["trainer.strategy=fsdp", "trainer=fsdp"],
        ),
        (
            [
                "trainer=ddp",
                "trainer.accelerator=cpu",
                "trainer.strategy={_target_:lightning.pytorch.strategies.FSDPStrategy}",
            ],
            ["trainer.strategy=lightning.pytorch.strategies.FSDPStrategy"],
        ),
    ],
    ids=["overlap", "lightning-fsdp-name", "lightning-fsdp-class"],
)
def test_sharding_the_project_cannot_gather_is_refused_in_one_line(tmp_path, overrides, words):
    result = cli(f"hydra.run.dir={tmp_path}/run", "model=tiny", "trainer.accelerator=cpu", *overrides, cwd=tmp_path)
    assert_clean_failure(result, *words, code=2)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_overlapped_rounds_beside_sharded_training_are_planned_with_servers(tmp_path):
    """Servers hold weights of their own (no copy of the sharded policy): the overlap that the HF engine refuses
    beside trainer=fsdp is planned (tests/test_vllm_server.py trains it)."""
    result = cli(f"hydra.run.dir={tmp_path}/run", "model=tiny", "trainer=fsdp", "trainer.accelerator=cpu",
                 "generator=vllm_server", "generator.urls=[http://127.0.0.1:9]", "rollout.max_staleness=1",
                 "dry_run=true", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer_steps_per_round  1" in result.stdout
