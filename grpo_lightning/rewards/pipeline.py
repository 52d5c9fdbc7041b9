"""The reward pipeline: weighted terms, then per-completion transforms, per-step shaping, group transforms.

Built from the `reward` config group (conf/reward/*.yaml; docs/rewards.md):

    reward:
      terms:             # name -> a reward term and its weight; the reward is sum(weight * term)
        gsm8k: {_target_: grpo_lightning.rewards.gsm8k.GSM8KReward, format_bonus: 0.1, weight: 1.0}
      transforms: {}       # per completion, in order, on the weighted sum: Clip, Scale, Ternary
      step_transforms: {}  # per reasoning step, for variants that know steps (variant=storpo)
      group_transforms:    # over a round's rewards, in order; the last output is the advantage
        normalize: {_target_: grpo_lightning.rewards.transforms.GroupNormalize, scale: auto}

A term is a `RewardTerm` or any callable `(completion, reference, **info) -> float`, a class (instantiated with
the node's other keys) or a plain function (its other keys are bound as keyword arguments). `info` holds
`truncated`, `num_tokens`, `max_new_tokens`, `branch_point` and `record` (the problem's record from its data
source, None for GSM8K); a callable that takes no `**info` gets only the
keys it names. The builder wraps a callable that is not a `RewardTerm` (or, for a transform, not a `Transform`)
into one (`CallableTerm`, `CallableTransform`), so the pipeline calls every stage through the interfaces of
`grpo_lightning.rewards.base`.

Robustness: a term that RAISES scores 0 for that completion and is counted (`rollout/reward_errors`, the first
failure logged with its traceback), so one odd completion cannot end a long run; a term that RETURNS something
other than a finite number is a bug in the term and stops the run with an error naming it.

On the default pipeline (one term of weight 1.0, `GroupNormalize`) rewards and advantages are bit for bit those of
`GSM8KReward` and `group_advantages` (tests/unit/test_reward_pipeline.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from grpo_lightning.moved_keys import check_moved_keys
from grpo_lightning.rewards.base import RewardResult, RewardTerm, Transform
from grpo_lightning.rewards.transforms import GroupNormalize
from grpo_lightning.schema import import_target

logger = logging.getLogger(__name__)

PLACES = ("terms", "transforms", "step_transforms", "group_transforms")
TERM_KEYS = frozenset({"weight"})
"""Keys of a `reward.terms.<name>` node the pipeline takes itself, beside what the term's `_target_` takes."""
RESERVED_TERM_NAMES = ("total",)


class RewardTermError(ValueError):
    """A term or transform returned something other than a finite number (a bug in it; the run stops)."""


@dataclass
class _Stage:
    """One named term or transform of the pipeline."""

    key: str
    """Its config key, e.g. `reward.terms.gsm8k` (errors name it)."""
    name: str
    fn: RewardTerm | Transform
    weight: float = 1.0


def _keywords_for(accepts: frozenset[str] | None, info: Mapping) -> dict:
    """The `info` keys a callable takes (`accepts` None: all, it has **kwargs)."""
    return dict(info) if accepts is None else {k: v for k, v in info.items() if k in accepts}


class CallableTerm(RewardTerm):
    """A term given as a plain callable `(completion, reference, **info) -> number`: called with the info keys its
    signature names, reporting no answer. Its value is passed on as returned; the pipeline checks it is a finite
    number and names the term's key when it is not."""

    def __init__(self, fn: Callable, accepts: frozenset[str] | None) -> None:
        self.fn, self.accepts = fn, accepts

    def score(self, completion: str, reference: str, **info) -> RewardResult:
        value = self.fn(completion, reference, **_keywords_for(self.accepts, info))
        return RewardResult(reward=value, extracted=None, correct=False)


class CallableTransform(Transform):
    """A transform given as a plain callable: called with the info keys its signature names; no context, no
    state (a transform that needs either derives from `Transform`)."""

    def __init__(self, fn: Callable, accepts: frozenset[str] | None) -> None:
        self.fn, self.accepts = fn, accepts

    def __call__(self, *args, **info):
        return self.fn(*args, **_keywords_for(self.accepts, info))


def _accepted_keywords(fn: Callable, positional: int) -> frozenset[str] | None:
    """Names `fn` takes by keyword besides its first `positional` arguments; None when it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    names, consumed = [], 0
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and consumed < positional:
            consumed += 1  # (completion, reference) or (reward,) or (reward, steps), passed by position
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return frozenset(names)


def _as_number(key: str, value) -> float:
    """`value` as a float, or RewardTermError naming `key` (non-numbers, NaN and infinities)."""
    number: float | None = None
    one_number = isinstance(value, Tensor) and value.numel() == 1
    if isinstance(value, numbers.Real) or one_number:  # bool, int, float, numpy scalars, 1-element tensors
        number = float(value)
    if number is None:
        raise RewardTermError(
            f"{key} returned {value!r} ({type(value).__name__}) for a completion; it must return a finite number"
        )
    if not math.isfinite(number):
        raise RewardTermError(f"{key} returned {number!r} for a completion; it must return a finite number")
    return number


class RewardPipeline:
    """Scores completions (`score_completion`) and turns a round's rewards into advantages (`advantages`)."""

    def __init__(
        self,
        terms: list[_Stage],
        transforms: list[_Stage] = (),
        step_transforms: list[_Stage] = (),
        group_transforms: list[_Stage] = (),
        max_new_tokens: int | None = None,
    ) -> None:
        if not terms:
            raise ValueError("reward.terms is empty: a reward needs at least one term (docs/rewards.md)")
        self.terms = list(terms)
        self.transforms = list(transforms)
        self.step_transforms = list(step_transforms)
        self.group_transforms = list(group_transforms)
        self.max_new_tokens = max_new_tokens
        self.errors = 0
        """Failing term calls since the last `pop_errors()`."""
        self.total_errors = 0

    @property
    def uses_steps(self) -> bool:
        """Whether the pipeline has per-step shaping (it needs a variant that knows steps)."""
        return bool(self.step_transforms)

    # ---- per completion ----------------------------------------------------------------------------------------
    def score_completion(self, completion: str, reference: str, **info) -> RewardResult:
        """Reward of one completion, with each term's unweighted value in `terms`.

        `extracted` / `correct` come from the first term that reports them (`reports_answer`, e.g. GSM8KReward);
        without one, nothing counts as extracted and `correct` is `reward >= 1`. `info["steps"]` (a list of the
        completion's reasoning steps, from a variant that knows them) turns on the step transforms.
        """
        steps = info.pop("steps", None)
        info.setdefault("truncated", False)
        info.setdefault("num_tokens", None)
        info.setdefault("max_new_tokens", self.max_new_tokens)
        info.setdefault("branch_point", 0)
        info.setdefault("record", None)
        values: dict[str, float] = {}
        detail: RewardResult | None = None
        total: float | None = None
        for term in self.terms:
            value, result = self._term(term, completion, reference, info)
            values[term.name] = value
            if detail is None and result is not None:
                detail = result
            weighted = term.weight * value
            total = weighted if total is None else total + weighted  # one term of weight 1.0: the value itself
        reward = total
        for stage in self.transforms:
            reward = _as_number(stage.key, stage.fn(reward, **info))
        if steps is not None:
            for stage in self.step_transforms:
                reward = _as_number(stage.key, stage.fn(reward, steps, **info))
        if detail is None:
            return RewardResult(reward=reward, extracted=None, correct=reward >= 1.0, terms=values)
        return RewardResult(reward=reward, extracted=detail.extracted, correct=detail.correct, terms=values)

    def _term(self, term: _Stage, completion: str, reference: str, info) -> tuple[float, RewardResult | None]:
        """The term's value and, when the term reports answers, its result."""
        try:
            result = term.fn.score(completion, reference, **info)
        except Exception as err:  # noqa: BLE001 - a term that raises scores 0 for this completion, counted and logged
            self._record(term.key, err, completion)
            return 0.0, None
        return _as_number(term.key, result.reward), result if term.fn.reports_answer else None

    def __call__(self, completion: str, reference: str, **info) -> float:
        return self.score_completion(completion, reference, **info).reward

    # ---- over a round ------------------------------------------------------------------------------------------
    def advantages(
        self,
        rewards: Tensor,  # [N] float
        group_ids: Tensor,  # [N] long
    ) -> Tensor:  # [N] float
        """The group transforms in order; the last one's output is the advantage (no transform: the reward)."""
        values = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        for stage in self.group_transforms:
            out = stage.fn(values, group_ids)
            if not isinstance(out, Tensor) or out.shape != values.shape:
                shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise RewardTermError(f"{stage.key} returned {shape} for {tuple(values.shape)} rewards")
            values = out
        return values

    def centres_on_group(self) -> bool:
        """Whether the advantage's baseline is each group's own mean: the last group transform that centres says
        (`Transform.baseline`; a plain function is taken not to centre). STORPO's tree credit values a forest's root
        by its other trees then, and at 0 (the transform's own baseline) otherwise."""
        for stage in reversed(self.group_transforms):
            baseline = stage.fn.baseline if isinstance(stage.fn, Transform) else "none"
            if baseline != "none":
                return baseline == "group"
        return False

    # ---- errors and state ----------------------------------------------------------------------------------
    def pop_errors(self) -> int:
        """Failing term calls since the previous call (the rollout loop logs them once per round)."""
        errors, self.errors = self.errors, 0
        return errors

    def _record(self, key: str, err: Exception, completion: str) -> None:
        if self.total_errors == 0:
            logger.error(
                "%s raised %s on a completion (scored 0; later failures are only counted in rollout/reward_errors): %r",
                key,
                type(err).__name__,
                completion[:200],
                exc_info=err,
            )
        self.errors += 1
        self.total_errors += 1

    def _stages(self) -> list[_Stage]:
        return [*self.terms, *self.transforms, *self.step_transforms, *self.group_transforms]

    def state_dict(self) -> dict:
        """State of the stateful stages (e.g. an EMA baseline), by config key: saved in every checkpoint."""
        return {s.key: state for s in self._stages() if (state := s.fn.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        stateful = self.state_dict()
        stages = {s.key: s for s in self._stages()}
        for key, value in state.items():
            if key not in stateful:
                raise ValueError(
                    f"ckpt_path: the checkpoint holds reward state for {key}, which this run's reward does not have; "
                    "resume with the same reward config"
                )
            stages[key].fn.load_state_dict(value)

    def describe(self) -> str:
        """One line for the run plan: the terms with their weights, then the transforms in order."""
        terms = " + ".join(f"{t.weight:g} x {t.name}" for t in self.terms)
        chain = []
        for stage in (*self.transforms, *self.step_transforms, *self.group_transforms):
            settings = stage.fn.describe_settings()
            chain.append(f"{stage.name}({settings})" if settings else stage.name)
        return terms + "".join(f" -> {name}" for name in chain)


# ---- building from config ------------------------------------------------------------------------------------
def build_reward(node: DictConfig, loss_type: str | None = None, max_new_tokens: int | None = None) -> RewardPipeline:
    """The pipeline of a `reward` config node; every mistake is a ValueError naming its config key."""
    if OmegaConf.is_config(node):
        check_moved_keys(OmegaConf.create({"reward": node}))
    unknown = sorted(set(node) - set(PLACES))
    if unknown:
        raise ValueError(f"reward.{unknown[0]}: unknown key; a reward has {', '.join(PLACES)} (docs/rewards.md)")
    stages = {place: [] for place in PLACES}
    for place, positional in zip(PLACES, (2, 1, 2, 2), strict=True):
        entries = node.get(place) or {}
        if not (OmegaConf.is_dict(entries) or isinstance(entries, Mapping)):
            raise ValueError(f"reward.{place} must be a mapping of name -> {{_target_: ...}} (got {entries!r})")
        for name, spec in entries.items():
            if spec is None:  # `reward.terms.x=null` switches a stage off
                continue
            key = f"reward.{place}.{name}"
            if place == "terms" and name in RESERVED_TERM_NAMES:
                raise ValueError(f"{key}: the name {name!r} is reserved (reward/total_mean); choose another")
            stage = _build_stage(key, str(name), spec, place, positional)
            stage.fn.bind(loss_type=loss_type, max_new_tokens=max_new_tokens)
            stages[place].append(stage)
    return RewardPipeline(**stages, max_new_tokens=max_new_tokens)


def _keyed(key: str, spec, message: str) -> str:
    """A stage's constructor message with its config key: `reward.terms.payoff.discount must be ...` when the
    message begins with one of the node's keys (a term names its own argument), else `reward.terms.payoff: ...`."""
    first = message.split(" ", 1)[0]
    return f"{key}.{message}" if first in spec and first != "_target_" else f"{key}: {message}"


def pipeline_from_function(fn: Callable, name: str = "reward") -> RewardPipeline:
    """A reward function used from Python (tests, benchmarks) as a pipeline a variant takes: the one term
    `fn` of weight 1 and GRPO's group-normalised advantages (`GroupNormalize(scale="group")`)."""
    term = fn if isinstance(fn, RewardTerm) else CallableTerm(fn, _accepted_keywords(fn, 2))
    normalize = _Stage(key="reward.group_transforms.normalize", name="normalize", fn=GroupNormalize(scale="group"))
    return RewardPipeline(terms=[_Stage(key=f"reward.terms.{name}", name=name, fn=term)], group_transforms=[normalize])


def _build_stage(key: str, name: str, spec, place: str, positional: int) -> _Stage:
    """The stage of one config node; a callable that is not a `RewardTerm` / `Transform` is wrapped into one."""
    weighted = place == "terms"
    if not (OmegaConf.is_dict(spec) or isinstance(spec, Mapping)) or "_target_" not in spec:
        raise ValueError(f"{key}: needs a _target_ (a function or a class); got {spec!r}")
    spec = OmegaConf.to_container(spec, resolve=True) if OmegaConf.is_config(spec) else dict(spec)
    weight = spec.pop("weight", 1.0) if weighted else 1.0
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
        raise ValueError(f"{key}.weight must be a finite number (got {weight!r})")
    target = spec["_target_"]
    obj = import_target(target)
    if obj is None:
        raise ValueError(f"{key}._target_: cannot import {target!r}")
    if inspect.isclass(obj):
        try:
            fn = instantiate(spec)
        except InstantiationException as err:
            cause = err.__cause__
            if isinstance(cause, ValueError | TypeError):
                raise ValueError(_keyed(key, spec, str(cause))) from None
            raise
    elif callable(obj):
        kwargs = {k: v for k, v in spec.items() if k != "_target_"}
        fn = functools.partial(obj, **kwargs) if kwargs else obj
    else:
        raise ValueError(f"{key}._target_: {target!r} is neither a function nor a class")
    if not callable(fn):
        raise ValueError(f"{key}._target_: {target!r} builds an object that cannot be called")
    if weighted and isinstance(fn, Transform):
        raise ValueError(f"{key}._target_: {target!r} is a transform, not a reward term")
    if not weighted and isinstance(fn, RewardTerm):
        raise ValueError(f"{key}._target_: {target!r} is a reward term, not a transform")
    if weighted and not isinstance(fn, RewardTerm):
        fn = CallableTerm(fn, _accepted_keywords(fn, positional))
    elif not weighted and not isinstance(fn, Transform):
        fn = CallableTransform(fn, _accepted_keywords(fn, positional))
    return _Stage(key=key, name=name, fn=fn, weight=float(weight))
