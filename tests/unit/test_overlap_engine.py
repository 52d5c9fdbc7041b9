"""The HF engine's background copy (generation/hf_snapshot.py) against the plain engine on the same weights.

Truths: the plain `HFGenerator`, which draws from the global RNG (forked and seeded per prefix with
`seed_per_prefix`); a frozen deep copy of the weights a snapshot was taken from; the global RNG state itself.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from grpo_lightning.distributed import derive_seed
from grpo_lightning.generation.hf import HFGenerator
from grpo_lightning.generation.hf_snapshot import SnapshotHFGenerator
from grpo_lightning.training.overlap import BackgroundSampling, ThreadShare
from tests.helpers import lora_policy_with_random_adapters

ROUND_SEED = 4242


@pytest.fixture
def policy(tiny_model):
    return lora_policy_with_random_adapters(tiny_model)


def engine(policy, tokenizer, seed_per_prefix: bool) -> HFGenerator:
    return HFGenerator(policy, tokenizer, max_new_tokens=10, batch_size=6, seed_per_prefix=seed_per_prefix)


def prefixes(tokenizer) -> list[list[int]]:
    return [tokenizer("What is 2 + 2?")["input_ids"], tokenizer("Name a prime.")["input_ids"]]


def flat(samples) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for group in samples for c in group]


def nudge_adapters(policy, amount: float) -> None:
    """What an optimizer step does to the trainable weights."""
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(amount)


def test_frozen_weights_are_shared_and_trainable_ones_copied(policy, tokenizer):
    copy_engine = SnapshotHFGenerator(engine(policy, tokenizer, False))
    mine = dict(copy_engine.model.named_parameters(remove_duplicate=False))
    trainable = 0
    for name, p in policy.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            trainable += 1
            assert mine[name] is not p and mine[name].data_ptr() != p.data_ptr() and not mine[name].requires_grad
            assert torch.equal(mine[name], p)
        else:
            assert mine[name] is p  # the base is not doubled
    assert trainable and sorted(copy_engine.weights()) == sorted(copy_engine.names)


@pytest.mark.parametrize("seed_per_prefix", [True, False])
def test_the_copy_samples_what_the_plain_engine_samples_from_the_same_seed(policy, tokenizer, seed_per_prefix):
    plain = engine(policy, tokenizer, seed_per_prefix)
    plain.reseed(ROUND_SEED)
    if not seed_per_prefix:  # the plain engine draws from the global RNG; the copy's stream is (round seed, rank 0)
        torch.manual_seed(derive_seed(ROUND_SEED, "rank", 0))
    expected = flat(plain.generate(prefixes(tokenizer), 3))
    background = SnapshotHFGenerator(engine(policy, tokenizer, seed_per_prefix))
    background.sync_weights(policy)
    background.reseed(ROUND_SEED)
    assert flat(background.generate(prefixes(tokenizer), 3)) == expected
    assert len({tuple(ids) for ids, _ in expected}) > 1  # sampled, not one repeated completion


def test_the_copy_keeps_the_weights_of_its_snapshot_while_the_policy_trains(policy, tokenizer):
    background = SnapshotHFGenerator(engine(policy, tokenizer, True))
    frozen_in_time = copy.deepcopy(policy)  # the truth: the weights as they were at the snapshot
    background.sync_weights(policy)
    nudge_adapters(policy, 0.05)  # the trainer moves on
    background.reseed(ROUND_SEED)
    got = flat(background.generate(prefixes(tokenizer), 3))
    then = engine(frozen_in_time, tokenizer, True)
    then.reseed(ROUND_SEED)
    assert got == flat(then.generate(prefixes(tokenizer), 3))
    now = engine(policy, tokenizer, True)
    now.reseed(ROUND_SEED)
    assert got != flat(now.generate(prefixes(tokenizer), 3))  # the nudge changes samples: the check has teeth
    background.sync_weights(policy)  # the next snapshot takes the trained weights
    background.reseed(ROUND_SEED)
    now.reseed(ROUND_SEED)
    assert flat(background.generate(prefixes(tokenizer), 3)) == flat(now.generate(prefixes(tokenizer), 3))


def test_the_copy_never_moves_the_global_rng(policy, tokenizer):
    background = SnapshotHFGenerator(engine(policy, tokenizer, False))
    background.reseed(ROUND_SEED)
    state = torch.get_rng_state()
    background.generate(prefixes(tokenizer), 3)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_round_sampled_in_the_worker_equals_one_sampled_here(policy, tokenizer):
    """Same seed, same thread count: the worker thread changes nothing but where the work runs."""
    threads = torch.get_num_threads()
    background = BackgroundSampling(
        SnapshotHFGenerator(engine(policy, tokenizer, False)), ThreadShare(threads, threads, 1)
    )
    background.snapshot(policy, 0)
    in_worker = background.run_now(ROUND_SEED, lambda e, group: flat(e.generate(prefixes(tokenizer), 3)))
    background.engine.reseed(ROUND_SEED)
    assert flat(background.engine.generate(prefixes(tokenizer), 3)) == in_worker


def test_checkpointed_weights_come_back(policy, tokenizer):
    background = SnapshotHFGenerator(engine(policy, tokenizer, True))
    saved = background.weights()
    nudge_adapters(policy, 0.1)
    background.sync_weights(policy)
    assert any(not torch.equal(saved[n], w) for n, w in background.weights().items())
    background.load_weights(saved)
    assert all(torch.equal(saved[n], w) for n, w in background.weights().items())
    with pytest.raises(ValueError, match="ckpt_path: the checkpoint's sampler weights lack"):
        background.load_weights({})
    with pytest.raises(ValueError, match="ckpt_path: the checkpoint's sampler weights hold extra.weight"):
        background.load_weights({**saved, "extra.weight": torch.zeros(1)})
    assert all(torch.equal(saved[n], w) for n, w in background.weights().items())  # refused before any copy


def test_hf_generate_cannot_sample_beside_the_trainer(policy, tokenizer):
    from grpo_lightning.accel import GenerationSettings

    plain = HFGenerator(policy, tokenizer, generation_settings=GenerationSettings.plain())
    with pytest.raises(ValueError, match="perf.generate.custom_decode=false"):
        plain.background_copy()


def test_the_worker_keeps_its_thread_count_when_the_trainer_sets_its_own_later(policy, tokenizer):
    """torch initialises a thread's count at its first parallel op from the count last set by any thread. The
    trainer setting its share after the worker set the sampler's (the order of a background round) must not reach
    the worker: its matmuls would round differently from a sequential run's, and from one run to the next."""
    threads = torch.get_num_threads()
    sampler_count = threads + 1  # differs from both the trainer's share and the process default
    background = SnapshotHFGenerator(engine(policy, tokenizer, False))
    worker_set, trainer_set = threading.Event(), threading.Event()
    seen: list[int] = []

    def worker() -> None:
        background.use_threads(sampler_count)
        worker_set.set()
        trainer_set.wait()
        torch.ones(1 << 16).sum()  # a parallel op: the first one in this thread
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    worker_set.wait()
    try:
        torch.set_num_threads(1)  # the trainer's share, set while the worker samples
        trainer_set.set()
        thread.join()
    finally:
        torch.set_num_threads(threads)
    assert seen == [sampler_count]
