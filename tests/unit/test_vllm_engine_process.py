"""The vLLM engine in a process of its own (generation/vllm/engine_process.py), against the fake engine of fake_vllm.py.

Truths: the same generator with its engine in the training process (what a process of its own must answer
identically), a responder that draws from the engine process's global RNG (what `reseed` must make
reproducible, without touching the trainer's), and a fake engine that, like vLLM's CPU worker, replaces
`torch.set_num_threads` by a no-op in the process that builds it. What the real engine does in a process of its
own (pushed weights landing, overlapped rounds) is in tests/test_vllm.py.

Each test spawns an engine process (a few seconds of imports): the slow tier.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch

from grpo_lightning.generation.vllm.engine_process import EngineProcess
from grpo_lightning.generation.vllm.generator import VLLMGenerator
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from tests.fake_vllm import FakeBackend

pytestmark = pytest.mark.slow


def random_responder(prompt_ids, kwargs):
    """Sample j: `max_tokens` ids drawn from the process's global RNG."""
    return [
        (torch.randint(0, 1000, (kwargs["max_tokens"],)).tolist(), [-0.5] * kwargs["max_tokens"], "length")
        for _ in range(kwargs["n"])
    ]


def threads_responder(prompt_ids, kwargs):
    """One id: the answering process's torch thread count."""
    return [([torch.get_num_threads()], [-0.5], "length") for _ in range(kwargs["n"])]


class RefusingBackend(FakeBackend):
    def LLM(self, **kwargs):  # noqa: N802 (stands for the class vllm.LLM)
        raise RuntimeError("Not enough memory for the KV cache: out of memory")


class ExitRecordingBackend(FakeBackend):
    """Registers an exit handler where it builds its engine, as vLLM does (its engine shutdown, through a
    `weakref.finalize`): the handler appends a line to `path` in the process that runs it."""

    def __init__(self, vocab_size: int, path: str) -> None:
        super().__init__(vocab_size)
        self.path = path

    def LLM(self, **kwargs):  # noqa: N802
        import atexit

        def shutdown():
            with open(self.path, "a") as f:
                f.write(f"shutdown in {os.getpid()}\n")

        atexit.register(shutdown)
        return super().LLM(**kwargs)


class ThreadFixingBackend(FakeBackend):
    """Builds its engine as vLLM's CPU worker does: `torch.set_num_threads` becomes a no-op in that process."""

    def LLM(self, **kwargs):  # noqa: N802
        torch.set_num_threads = lambda threads: None
        return super().LLM(**kwargs)


@pytest.fixture(scope="module")
def policy(tiny_model):
    """A LoRA policy on a copy: peft wraps the layers of the model it is given, and `tiny_model` is the worker's."""
    policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4, alpha=8), needs_reference=False)
    return policy


def generator(policy, tokenizer, backend, engine_process: bool) -> VLLMGenerator:
    return VLLMGenerator(
        policy, tokenizer, model_path="/models/tiny", max_new_tokens=4, backend=backend,
        engine_process=engine_process,
    )  # fmt: skip


PREFIXES = [[1, 2, 3], [7, 8], [40]]


def test_the_engine_process_answers_as_the_engine_in_this_process(policy, tokenizer):
    here = generator(policy, tokenizer, FakeBackend(len(tokenizer)), engine_process=False)
    there = generator(policy, tokenizer, FakeBackend(len(tokenizer)), engine_process=True)
    assert isinstance(there.engine, EngineProcess) and there.engine.alive
    for args in ((PREFIXES, 2), (PREFIXES, 3, [1, 4, 2]), (PREFIXES, 1, None, True)):
        assert there.generate(*args) == here.generate(*args)
    there.push_weights()  # every merged tensor lands under a name the engine has (the fake raises otherwise)
    assert there.generate(PREFIXES, 2) == here.generate(PREFIXES, 2)
    there.engine.close()
    assert not there.engine.alive
    with pytest.raises(RuntimeError, match="closed"):
        there.generate(PREFIXES, 2)


def test_reseed_makes_the_engine_process_reproducible_and_leaves_the_trainer_rng_alone(policy, tokenizer):
    gen = generator(policy, tokenizer, FakeBackend(len(tokenizer), responder=random_responder), engine_process=True)
    trainer_rng = torch.get_rng_state()
    gen.reseed(5)
    first = gen.generate(PREFIXES, 2)
    gen.reseed(6)
    other = gen.generate(PREFIXES, 2)
    gen.reseed(5)
    assert gen.generate(PREFIXES, 2) == first != other
    assert torch.equal(torch.get_rng_state(), trainer_rng)


@pytest.mark.usefixtures("two_torch_threads")
def test_the_engine_process_takes_its_thread_count_past_vllms_no_op(policy, tokenizer):
    backend = ThreadFixingBackend(len(tokenizer), responder=threads_responder)
    gen = generator(policy, tokenizer, backend, engine_process=True)
    assert gen.generate([[1]], 1)[0][0].token_ids == [torch.get_num_threads()]  # the trainer's count at the start
    gen.engine.set_threads(1)
    assert gen.generate([[1]], 1)[0][0].token_ids == [1]


def test_a_build_error_in_the_engine_process_names_the_key(policy, tokenizer):
    with pytest.raises(ValueError, match="generator.gpu_memory_utilization"):
        generator(policy, tokenizer, RefusingBackend(len(tokenizer)), engine_process=True)


def test_a_stopped_engine_process_runs_its_exit_handlers_and_exits_cleanly(policy, tokenizer, tmp_path):
    """The child skips the interpreter's teardown (`_engine_main`), not the exit handlers: the engine's shutdown
    runs there, once, and the child's exit code is 0."""
    path = tmp_path / "exit-handlers.log"
    gen = generator(policy, tokenizer, ExitRecordingBackend(len(tokenizer), str(path)), engine_process=True)
    pid = gen.engine._process.pid
    assert gen.generate(PREFIXES, 2)
    assert not path.exists()
    gen.engine.close()
    assert gen.engine._process.exitcode == 0
    assert path.read_text() == f"shutdown in {pid}\n"


def test_an_engine_process_that_dies_is_a_clear_error(policy, tokenizer):
    gen = generator(policy, tokenizer, FakeBackend(len(tokenizer)), engine_process=True)
    os.kill(gen.engine._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"exited with code -9"):
        gen.generate(PREFIXES, 2)


def test_the_overlap_snapshot_keeps_the_pushed_weights_and_gives_the_policy_its_own_back(policy, tokenizer):
    """`VLLMSnapshot`: what a checkpoint keeps is the trainable weights as pushed; pushing a checkpoint's snapshot
    back borrows the policy's parameters for the push and leaves them as they were."""
    from grpo_lightning.generation.base import SamplingCancelled

    gen = generator(policy, tokenizer, FakeBackend(len(tokenizer)), engine_process=True)
    snapshot = gen.background_copy()
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    snapshot.sync_weights(policy)
    pushed = snapshot.weights()
    assert pushed.keys() == trainable.keys() and all(torch.equal(pushed[n], p) for n, p in trainable.items())
    before = {n: p.detach().clone() for n, p in trainable.items()}
    with torch.no_grad():
        for p in trainable.values():
            p.add_(1.0)  # training moves the policy; the snapshot keeps what was pushed
    moved = {n: p.detach().clone() for n, p in trainable.items()}
    assert all(torch.equal(snapshot.weights()[n], before[n]) for n in trainable)
    snapshot.load_weights(before)
    assert all(torch.equal(p, moved[n]) for n, p in trainable.items())
    first = sorted(before)[0]  # a checkpoint of another adapter: one line, before the policy is borrowed
    with pytest.raises(ValueError, match=f"ckpt_path: the checkpoint's sampler weights lack {first}"):
        snapshot.load_weights({n: w for n, w in before.items() if n != first})
    assert all(torch.equal(p, moved[n]) for n, p in trainable.items()) and gen.pushes == 2
    assert gen.pushes == 2 and snapshot.generate(PREFIXES, 2) == gen.generate(PREFIXES, 2)
    snapshot.cancel.set()
    with pytest.raises(SamplingCancelled):
        snapshot.generate(PREFIXES, 2)
