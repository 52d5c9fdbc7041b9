"""`checkpoint.last_every_n_rounds`: when `LastCheckpoint` writes last.ckpt, against the rule written out by hand.

The round-end hook is driven by a stand-in trainer (the attributes Lightning's Trainer gives the callback:
`current_epoch`, `max_epochs`, `should_stop`, `save_checkpoint`); a real run with a sparse cadence stopped by
SIGINT and resumed bit for bit is in tests/test_resume.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from grpo_lightning.app.validation import check_rules
from grpo_lightning.training.checkpointing import LAST, LastCheckpoint
from tests.conftest import make_cfg


@dataclass
class StandInTrainer:
    max_epochs: int | None
    current_epoch: int = 0
    should_stop: bool = False
    written: list[tuple[str, int]] = field(default_factory=list)

    def save_checkpoint(self, path, weights_only: bool = False) -> None:
        self.written.append((path.name, self.current_epoch))


@dataclass
class StandInModule:
    diverged: bool = False


def rounds_written(every: int, rounds: int, stop_after: int | None = None, max_epochs: int | None = None) -> list:
    """Drive `rounds` round ends (1-based round numbers), a stop requested at round `stop_after`."""
    callback = LastCheckpoint("ckpts", every_n_rounds=every)
    trainer = StandInTrainer(max_epochs=rounds if max_epochs is None else max_epochs)
    for epoch in range(rounds):
        trainer.current_epoch = epoch
        trainer.should_stop = stop_after == epoch + 1
        callback.on_train_epoch_end(trainer, StandInModule())
        if trainer.should_stop:
            break
    assert all(name == LAST for name, _ in trainer.written)
    return [epoch + 1 for _, epoch in trainer.written]


@pytest.mark.parametrize("every", [1, 2, 3, 4, 7, 50])
def test_written_every_n_rounds_and_after_the_last(every):
    assert rounds_written(every, rounds=7) == [r for r in range(1, 8) if r % every == 0 or r == 7]


def test_the_default_writes_every_round():
    assert LastCheckpoint("ckpts").every_n_rounds == 1
    assert rounds_written(1, rounds=5) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5])
def test_a_stop_writes_the_round_it_stops_at(stop_after):
    """Ctrl-C / SIGTERM, the token budget and the guard all stop through `trainer.should_stop`."""
    written = rounds_written(4, rounds=10, stop_after=stop_after)
    assert written == [r for r in range(1, stop_after + 1) if r % 4 == 0 or r == stop_after]


def test_no_round_limit_writes_on_the_cadence_alone():
    """`trainer.max_epochs=-1` (a token budget ends the run): no round is the last until the run stops."""
    assert rounds_written(3, rounds=7, max_epochs=-1) == [3, 6]
    assert rounds_written(3, rounds=7, stop_after=7, max_epochs=-1) == [3, 6, 7]


def test_a_diverged_round_is_never_written():
    callback = LastCheckpoint("ckpts", every_n_rounds=1)
    trainer = StandInTrainer(max_epochs=3, should_stop=True)
    callback.on_train_epoch_end(trainer, StandInModule(diverged=True))
    assert trainer.written == []


@pytest.mark.parametrize(("bad", "rule"), [(0, "must be >= 1"), (-2, "must be >= 1"), (1.5, "must be an integer"),
                                           (True, "must be an integer"), ("2", "must be an integer")])  # fmt: skip
def test_a_bad_cadence_is_refused_naming_the_key(tmp_path, bad, rule):
    """In the config check's words: the constructor and `checkpoint.last_every_n_rounds` share one rule."""
    with pytest.raises(ValueError) as err:
        LastCheckpoint("ckpts", every_n_rounds=bad)
    assert str(err.value) == f"checkpoint.last_every_n_rounds {rule} (got {bad!r})"
    if not isinstance(bad, str):  # a string override is YAML-parsed to its int by Hydra
        cfg = make_cfg(tmp_path, [f"checkpoint.last_every_n_rounds={bad}"])
        assert check_rules(cfg) == [str(err.value)]
