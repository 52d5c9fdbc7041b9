"""StaleWeightGuard: notice when the generator is not sampling from the weights being trained.

Stale weights are the classic failure of RL with a separate inference engine (TRL #5312): the sync silently
does nothing and the run trains on rollouts from an old policy, which looks like slow learning rather than a
bug. The trainer already measures the symptom every round: `rollout/logp_diff_mean`, the mean |generator
log-prob - trainer log-prob| over the round's completion tokens before any update (rollout_loop.py). The
rollout loop hands it to this guard at the end of each round (`check`), which compares it with
`generator.logp_diff_threshold` and warns (`generator.on_stale=warn`) or stops the run with a RuntimeError
(`abort`). Each generator owns one (`generator.guard`).

Only the mean is guarded: `rollout/logp_diff_max` is one token, and a single low-probability token can differ
by more than a nat between bf16 kernels while the policy is right. Rounds whose rollouts came from
deliberately old weights (`generator.sync_every` > 1, or `rollout.max_staleness` >= 1: sampled beside the
previous round's training) are not judged: the generator says whether its last sync pushed (`is_fresh`), the
rollout loop whether the round is stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from grpo_lightning.errors import EngineFailed
from grpo_lightning.schema import choice, number, optional

log = logging.getLogger(__name__)

METRIC = "rollout/logp_diff_mean"
ACTIONS = ("warn", "abort")
THRESHOLD_RULE = optional(number(above=0))
"""`generator.logp_diff_threshold`: each engine declares the key with its own default (hf_engine.py,
vllm/settings.py)."""
ACTION_RULE = choice(*ACTIONS)
"""`generator.on_stale`."""
ANOTHER_MODEL_LOGP_DIFF = 1.0
"""A round's `rollout/logp_diff_mean` above this many nats means another model sampled it, whatever `on_stale`
says: the stale-weight threshold (0.05) sits near what bf16 engines give honestly, while a server of another
checkpoint with the policy's tokenizer measured 10.2-10.7, one whose base a full push of another run replaced 7-9,
and a stale adapter one optimizer step old stays below 0.1. Generators that sample from another process's weights
declare it (`generator.another_model_logp_diff`)."""


class StaleWeightGuard:
    def __init__(
        self,
        threshold: float | None = 0.05,
        on_stale: str = "warn",
        is_fresh: Callable[[], bool] | None = None,
        another_model: float | None = None,
    ) -> None:
        """`threshold` None disables the guard; `is_fresh()` is asked once a round is sampled; `another_model`: the
        `rollout/logp_diff_mean` above which a fresh round stops the run whatever `on_stale` says (None: never)."""
        keys = [("logp_diff_threshold", THRESHOLD_RULE, threshold), ("on_stale", ACTION_RULE, on_stale)]
        for key, rule, value in keys:
            problem = rule(value)
            if problem is not None:
                raise ValueError(f"generator.{key} {problem} (got {value!r})")
        self.threshold = threshold
        self.on_stale = on_stale
        self.another_model = another_model
        self.is_fresh = is_fresh
        self.flagged: list[tuple[int, float]] = []
        """(round, logp_diff_mean) of every round over the threshold."""
        self._fresh = True

    def round_sampled(self, stale: bool = False) -> None:
        """The rollout loop, right after sampling a round: remember whether it came from freshly pushed weights
        (`stale`: it was sampled from older weights on purpose, beside the previous round's training)."""
        self._fresh = not stale and (self.is_fresh() if self.is_fresh is not None else True)

    def check_another_model(self, round_index: int, value: float) -> None:
        """The rollout loop, before round `round_index`'s first update: stop the run, whatever `on_stale` says, when
        its `rollout/logp_diff_mean` (over all ranks) is what another model's samples give."""
        if self.another_model is None or not self._fresh or value <= self.another_model:
            return
        raise EngineFailed(
            f"round {round_index}: {METRIC} = {value:.4g} before any update, above generator.another_model_logp_diff"
            f" = {self.another_model:g}: the engine sampled from another model's weights (a server serving or given "
            "other weights), and the round was not trained on; check what the server serves",
            resumable=False,
        )

    def check(self, round_index: int, value: float | None) -> None:
        """The rollout loop, at the end of round `round_index`: judge its `rollout/logp_diff_mean` (over all ranks)."""
        if self.threshold is None or not self._fresh or value is None:
            return
        value = float(value)
        if value <= self.threshold:  # NaN is never <= anything: it counts as stale
            return
        self.flagged.append((round_index, value))
        message = (
            f"round {round_index}: {METRIC} = {value:.4g} exceeds generator.logp_diff_threshold = "
            f"{self.threshold:g}: the generator is not sampling from the weights being trained (stale weight "
            "sync, a dtype / precision mismatch, or LoRA dropout > 0)"
        )
        if self.on_stale == "abort":
            raise RuntimeError(message + "; generator.on_stale=abort stopped the run")
        log.warning(message)
