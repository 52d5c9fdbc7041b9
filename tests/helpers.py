"""Test-only pieces plugged in through config (`+reward.terms.vowels._target_=tests.helpers.VowelFractionReward`),
and builders."""

import copy
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn

from grpo_lightning.generation.base import Generator, SamplingConfig
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.sharding import full_tensor


class StubGenerator(Generator):
    """The base of the tests' scripted engines: a `Generator` with nothing to sync, no guard threshold and no
    callbacks; a subclass implements `generate`."""

    def __init__(self, sampling: SamplingConfig | None = None) -> None:
        self.sampling = sampling if sampling is not None else SamplingConfig()
        self.guard = StaleWeightGuard(threshold=None)
        self.callbacks = []

    def sync_weights(self, policy: nn.Module) -> None:
        """Nothing to copy: scripted completions do not depend on weights."""

    def sample(self, prefixes, num_samples, budgets, greedy):
        """Unused: a scripted engine answers `generate` itself."""
        raise NotImplementedError


class VowelFractionReward:
    """Fraction of characters that are vowels: a dense reward that varies across a random model's samples.

    GSM8K correctness is 0 for every sample of a random model, which makes every advantage 0 and every
    gradient 0; this reward gives the end-to-end tests a real learning signal.
    """

    def __call__(self, completion: str, answer: str) -> float:
        return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)


class FlakyReward(VowelFractionReward):
    """Raises on completions whose length is a multiple of 3 (a user's reward with a bug), else vowel fraction."""

    def __call__(self, completion: str, answer: str) -> float:
        if len(completion) % 3 == 0:
            raise ZeroDivisionError("bug in the user's reward")
        return super().__call__(completion, answer)


class RecordingReward(VowelFractionReward):
    """Vowel fraction, also appended to `<directory>/rewards.<pid>` (one line per call): a hand count of the
    rewards every process computed, to check the logged reward mean against."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, completion: str, answer: str) -> float:
        reward = super().__call__(completion, answer)
        with open(os.path.join(self.directory, f"rewards.{os.getpid()}"), "a") as f:
            f.write(f"{reward!r}\n")
        return reward


class DumpTrainableParams(L.Callback):
    """Saves each rank's trainable parameters at the end of training to `<directory>/rank<r>.pt`
    (plugged in through config: +callbacks.dump._target_=tests.helpers.DumpTrainableParams)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        # trainer=fsdp: each parameter gathered whole (every rank takes part), so ranks dump what DDP ranks dump
        params = {n: full_tensor(p.detach()).clone() for n, p in pl_module.policy.named_parameters() if p.requires_grad}
        torch.save(params, os.path.join(self.directory, f"rank{trainer.global_rank}.pt"))


class RecordHowRankStarted(L.Callback):
    """Writes `<directory>/rank<r>.started`: `forked` in a run forked past its imports by tests/forked_cli.py (its
    Lightning launcher forks the ranks it starts), `real` in a process of its own (tests/test_ddp.py)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def setup(self, trainer, pl_module, stage) -> None:
        from lightning.pytorch.strategies.launchers import subprocess_script

        how = "real" if subprocess_script.subprocess is subprocess else "forked"
        Path(self.directory, f"rank{trainer.global_rank}.started").write_text(how)


def lora_policy_with_random_adapters(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A LoRA (r 4) copy of `model` whose B matrices are random, not zero: adapters that change samples and let
    gradients reach A as well as B."""
    from grpo_lightning.models.lora import LoraSettings, wrap_policy

    policy, _ = wrap_policy(copy.deepcopy(model), LoraSettings(r=4, alpha=8), needs_reference=True)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


class VowelFractionOnEvenAnswers(VowelFractionReward):
    """Vowel fraction for problems whose reference answer is an even integer, 0.0 for every other problem: the
    groups of the other problems have all-equal rewards (what dynamic sampling drops), and which ones they are
    is known from the data alone."""

    def __call__(self, completion: str, answer: str) -> float:
        return super().__call__(completion, answer) if is_even_integer(answer) else 0.0


def is_even_integer(answer: str) -> bool:
    try:
        return float(answer) % 2 == 0
    except ValueError:
        return False


class Recorder(L.Callback):
    """A user's callback that asks the run for its tokenizer by parameter name (tests/test_configs.py)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer


def load_benchmark(name: str):
    """The script `benchmarks/<name>.py` as a module (the benchmarks are scripts, not a package)."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(name, root / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


class KillRank(L.Callback):
    """Kills process `rank` with SIGKILL when round `at_round` starts training (a training process lost to the
    machine: tests/test_ddp.py's fault test)."""

    def __init__(self, rank: int, at_round: int) -> None:
        self.rank, self.at_round = rank, at_round

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.at_round:
            os.kill(os.getpid(), signal.SIGKILL)


class KillServer(L.Callback):
    """SIGKILLs the API server of the run's first started vLLM server when round `at_round` starts training, after
    the rollout loop's own hook (with overlapped rounds it has pushed the weights and the server samples round
    `at_round + 1` beside the training), and writes the server's process group (its supervisor leads it) to
    `<directory>/killed_server`: a server lost mid-round (tests/test_vllm_server_faults.py)."""

    def __init__(self, at_round: int, directory: str) -> None:
        self.at_round, self.directory = at_round, directory

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0 or trainer.current_epoch != self.at_round:
            return
        from tests.processes import group_members, parent_of

        loop = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutLoop")
        assert trainer.callbacks.index(loop) < trainer.callbacks.index(self), "the rollout loop's hook runs first"
        supervisor = loop.generator.servers[0].process.pid
        (api,) = [pid for pid in group_members(supervisor) if parent_of(pid) == supervisor]
        Path(self.directory, "killed_server").write_text(str(supervisor))
        os.kill(api, signal.SIGKILL)


class RecordServerGroup(L.Callback):
    """Writes the process group of the run's first started vLLM server (its supervisor leads it) to
    `<directory>/server_group` as the run starts (process 0, which starts the servers): whether a run that stopped
    left any of it behind."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            loop = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutLoop")
            Path(self.directory, "server_group").write_text(str(loop.generator.servers[0].process.pid))


class StallRank(L.Callback):
    """Process `rank` stops for `seconds` when round `at_round` starts training, after writing its pid to
    `<directory>/stalled<rank>`: the other processes wait for it at their next collective (a rank out of step:
    tests/test_launch.py)."""

    def __init__(self, rank: int, at_round: int, seconds: float, directory: str) -> None:
        self.rank, self.at_round, self.seconds, self.directory = rank, at_round, seconds, directory

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank and trainer.current_epoch == self.at_round:
            Path(self.directory, f"stalled{self.rank}").write_text(str(os.getpid()))
            time.sleep(self.seconds)


class RecordTrainedBatches(L.Callback):
    """Writes `<directory>/batches<rank>.json`: each trained micro-batch's round, completion lengths and whether
    two of its rows share a prompt (what the CPU's forward levers split the backbone calls by; tests/test_fsdp.py)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.batches: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from grpo_lightning.accel.completion_forward import completion_lengths, shared_prompts

        shared = shared_prompts(batch) is not None
        self.batches.append({"round": trainer.current_epoch, "lengths": completion_lengths(batch), "shared": shared})

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.directory, f"batches{trainer.global_rank}.json").write_text(json.dumps(self.batches))
