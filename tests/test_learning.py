"""Learning tests: a seeded run must raise a reward that the same run with lr=0 does not.

A sign bug (ascending the wrong way), a scale bug (a gradient that vanishes or is scaled away) or a broken
link between rollouts and the loss all fail here, unlike a "the loss is finite" check.

The task is made learnable within seconds on the tiny random model: the LM head rows of tokens whose text is
mostly the letter "e" share a planted component `v`, so one direction of the final hidden state raises all of
them together, and the reward is the fraction of the completion's characters that are "e". A policy that
steers its hidden state along `v` writes more "e"; the lr=0 control samples the same first round and then
stays where it is. The truth is that control: the trained run's gain from its first rounds to its last must
exceed the control's by a wide margin.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from grpo_lightning.app.train import build_run
from grpo_lightning.models.sources import RandomSource
from grpo_lightning.training.rollout_loop import RolloutLoop

pytestmark = pytest.mark.slow  # minutes, not seconds: outside `make check`

LETTER = "e"
ROUNDS = 8
WINDOW = 2
MARGIN = 0.05
"""Trained gain (mean reward of the last WINDOW rounds minus the first WINDOW) must exceed the control's gain by
this much. Measured: the trained GRPO run climbs from 0.13 to 0.33 within three rounds; the control's gain is
sampling noise, within +-0.02."""


class LetterFractionReward:
    """Fraction of the completion's characters that are LETTER."""

    def __call__(self, completion: str, answer: str) -> float:
        return completion.count(LETTER) / max(len(completion), 1)


@dataclass
class PlantedFeatureSource(RandomSource):
    """The tiny random model with an untied LM head whose rows of LETTER-dense tokens share a component `v`.

    Raising those tokens together then takes one direction of the final hidden state, which LoRA can add
    (SiLU activations have a non-zero mean, so the last MLP has a context-independent output to steer). The
    input embeddings are left alone, so a sampled LETTER-dense token does not make the next one likelier.
    """

    strength: float = 2.0

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        model, tokenizer = super().load(dtype, trust_remote_code)
        head = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())  # [V, H], untied
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(self.seed + 1)
            direction = torch.randn(head.shape[1])  # [H]
            direction /= direction.norm()
            head[letter_dense(tokenizer, head.shape[0])] += self.strength * direction.to(head.dtype)
        model.get_output_embeddings().weight = head
        model.config.tie_word_embeddings = False
        return model, tokenizer


def letter_dense(tokenizer, vocab_size: int) -> torch.Tensor:  # [V] bool
    """Tokens whose text is at least 30% LETTER (e.g. "e", "ee", " see"): the ones the reward favours."""
    texts = [tokenizer.decode([i]) for i in range(vocab_size)]
    return torch.tensor([len(t.strip()) > 0 and t.count(LETTER) >= 0.3 * len(t.strip()) for t in texts])


BASE = [
    "model.source._target_=tests.test_learning.PlantedFeatureSource",
    f"trainer.max_epochs={ROUNDS}",
    "trainer.enable_progress_bar=false",
    "generator.max_new_tokens=12",
    "variant.num_generations=8",
    "data.prompts_per_round=2",
    "data.groups_per_micro_batch=2",
    "~reward.terms.vowels",
    "+reward.terms.letter._target_=tests.test_learning.LetterFractionReward",
    "eval.enabled=false",
    "checkpoint.every_n_rounds=1000",
    "logging.samples_every_n_rounds=1000",
    "optim.optimizer.lr=1e-2",
]


def rewards_per_round(tiny_cfg, *overrides: str) -> list[float]:
    run = build_run(tiny_cfg(*BASE, *overrides))
    run.fit()
    history = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop)).history
    return [reward for _, reward, _ in history]


def gain(rewards: list[float]) -> float:
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


@pytest.fixture(scope="module")
def control_gain(tmp_path_factory):
    """The lr=0 control of the GRPO-sampled runs: same seed, same sampling; the loss type does not matter."""
    from tests.conftest import TINY, make_cfg

    root = tmp_path_factory.mktemp("control")
    cfg = make_cfg(root / "run", TINY + BASE + ["optim.optimizer.lr=0"])
    run = build_run(cfg)
    run.fit()
    history = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop)).history
    return gain([reward for _, reward, _ in history])


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_each_loss_type_learns_what_the_lr0_control_does_not(tiny_cfg, control_gain, loss):
    rewards = rewards_per_round(tiny_cfg, f"loss={loss}")
    assert gain(rewards) > control_gain + MARGIN, (loss, rewards, control_gain)


@pytest.mark.parametrize("loss", ["gspo", "cispo"])
def test_gspo_and_cispo_learn_off_policy_too(tiny_cfg, control_gain, loss):
    """With one pass per round the ratio is 1, and GSPO's and CISPO's gradients are grpo's and dapo's (here the
    very same runs: every completion of the random model has the same length, and Adam ignores the scale). A
    second pass over each round (`data.num_iterations=2`) takes the ratio off 1, where GSPO clips whole
    completions at its 3e-4 / 4e-4 range and CISPO caps token weights at 5. Measured gains: gspo 0.085, cispo
    0.086 (grpo 0.196), the control 0.006."""
    rewards = rewards_per_round(tiny_cfg, f"loss={loss}", "data.num_iterations=2")
    assert gain(rewards) > control_gain + MARGIN, (loss, rewards, control_gain)


def test_storpo_learns_what_its_lr0_control_does_not(tiny_cfg):
    storpo = ["variant=storpo", "variant.min_steps=1"]
    trained = rewards_per_round(tiny_cfg, *storpo)
    control = rewards_per_round(tiny_cfg, *storpo, "optim.optimizer.lr=0")
    assert gain(trained) > gain(control) + MARGIN, (trained, control)


def test_overlapped_rounds_learn_what_their_lr0_control_does_not(tiny_cfg):
    """Round k+1 sampled beside round k's training, from the weights round k started with (one optimizer step
    stale, docs/overlap.md): the policy still learns. The control overlaps too, so both sample alike."""
    overlap = ["rollout.max_staleness=1"]
    trained = rewards_per_round(tiny_cfg, *overlap)
    control = rewards_per_round(tiny_cfg, *overlap, "optim.optimizer.lr=0")
    assert gain(trained) > gain(control) + MARGIN, (trained, control)
