"""The plan of a run, made before any model weight is loaded: its size, the checks that need the data or the
model's config (the micro-batches, the memory estimate, the token budgets), printed by every run and `dry_run`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from grpo_lightning.app.build import build
from grpo_lightning.app.machine import gpu_memory, machine_memory
from grpo_lightning.app.memory import (
    MemoryEstimate,
    check_fits,
    estimate,
    fit_decode_rows,
    model_shape,
)
from grpo_lightning.app.run_shape import RunShape, run_shape
from grpo_lightning.data.datamodule import RolloutDataModule
from grpo_lightning.variants.base import GroupShape, GRPOVariant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What a run will do; printed by `dry_run=true` and at the start of every run."""

    model: str
    data: str
    num_problems: int
    rounds: int
    prompts_per_round: int
    rollouts_per_round: int
    micro_batches_per_round: int
    accumulate_grad_batches: int
    optimizer_steps_per_round: int
    max_new_tokens: int
    loss: str
    reward: str
    output_dir: str
    memory: MemoryEstimate | None = None
    """The peak-memory estimate (grpo_lightning/app/memory.py); None when the model's config.json cannot be read."""
    decode_rows_per_call: int | None = None
    """Sequences per HF generate call (generator.batch_size, `auto` resolved and fitted to the GPU); None: vLLM."""

    def render(self) -> str:
        rows = {k: v for k, v in self.__dict__.items() if k != "memory" and v is not None}
        rows |= self.memory.render() if self.memory is not None else {"memory": "unknown (no model config.json)"}
        if self.memory is not None and self.memory.engine_share is not None:
            rows["memory_gpu_engine_share"] = f"{self.memory.engine_share:.0%} of the engine GPU's memory (vLLM)"
        return "\n".join(f"  {k:<26} {v}" for k, v in rows.items())

    def check_fits(self) -> None:
        """Refuse a run that cannot fit this machine's RAM (and its GPU, when one is visible) before loading."""
        if self.memory is None:
            return
        check_fits(self.memory, machine_memory(), gpu_memory())


def check_model_fits(cfg: DictConfig, model, tokenizer, datamodule: RolloutDataModule) -> None:
    """Token budgets the model can serve: prompt + completion within its context, room for the question, and the
    prompts the data source says no cut may shorten (`DataSource.check_prompts_fit`; data=games: the opening
    prompts of the game, rules and first state, data/games.py `TurnPrompts`).

    Why here: they need the model's config or tokenizer, so they run right after loading, before any round.
    """
    context = getattr(model.config, "max_position_embeddings", None)
    prompt_tokens = cfg.data.max_prompt_tokens
    budgets = [("generator.max_new_tokens", cfg.generator.max_new_tokens)]
    if cfg.eval.enabled:
        budgets.append(("eval.max_new_tokens", cfg.eval.max_new_tokens))
    for key, new_tokens in budgets:
        if context and prompt_tokens + new_tokens > context:
            raise ValueError(
                f"{key} ({new_tokens}) + data.max_prompt_tokens ({prompt_tokens}) exceed the model's context of "
                f"{context} tokens (max_position_embeddings); lower them"
            )
    messages = datamodule.dataset.messages("")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    template_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prompt_tokens <= template_tokens:
        raise ValueError(
            f"data.max_prompt_tokens ({prompt_tokens}) leaves no room for the question: the chat template, system "
            f"prompt and data.dataset.prompt_template alone take {template_tokens} tokens; raise it (default 512)"
        )
    limits = {"data.max_prompt_tokens": prompt_tokens}  # prompts no budget can hold (a game's opening prompts)
    if cfg.eval.enabled:
        limits["eval.max_prompt_tokens"] = cfg.eval.get("max_prompt_tokens", prompt_tokens)
    datamodule.dataset.check_prompts_fit(tokenizer, limits)


def accumulate_grad_batches(cfg: DictConfig, dm: RolloutDataModule) -> int:
    """Micro-batches per optimizer step: by default the whole round in one step (old_logp = logp.detach())."""
    per_round = dm.micro_batches_per_round * dm.settings.num_iterations
    value = cfg.trainer.get("accumulate_grad_batches") or dm.micro_batches_per_round
    if value < 1 or per_round % value:
        raise ValueError(
            f"trainer.accumulate_grad_batches must divide the {per_round} micro-batches of a round "
            f"(data.prompts_per_round / data.groups_per_micro_batch x data.num_iterations) (got {value})"
        )
    return int(value)


def make_plan(
    cfg: DictConfig, source, dm: RolloutDataModule, variant: GRPOVariant, accumulate: int, reward_fn=None
) -> Plan:
    rounds = cfg.trainer.max_epochs
    if rounds is None or rounds < 1:
        raise ValueError(f"trainer.max_epochs (number of rollout rounds) must be >= 1 (got {rounds})")
    if dm.settings.prompts_per_round > len(dm.problems):
        raise ValueError(
            f"data.prompts_per_round ({dm.settings.prompts_per_round}) exceeds the {len(dm.problems)} problems loaded"
        )
    per_round = dm.micro_batches_per_round * dm.settings.num_iterations
    group = variant.group(dm.dataset)
    rollouts_per_round = dm.settings.prompts_per_round * group.rollouts  # variant.rollouts_per_round, group in hand
    memory, run = memory_estimate(cfg, source, rollouts_per_round, group)
    return Plan(
        model=source.describe(),
        data=dm.dataset.describe(),
        num_problems=len(dm.problems),
        rounds=rounds,
        prompts_per_round=dm.settings.prompts_per_round,
        rollouts_per_round=rollouts_per_round,
        micro_batches_per_round=per_round,
        accumulate_grad_batches=accumulate,
        optimizer_steps_per_round=per_round // accumulate,
        max_new_tokens=cfg.generator.max_new_tokens,
        loss=build(cfg.loss).describe(),
        reward=reward_fn.describe(),
        output_dir=str(Path(cfg.paths.output_dir).resolve()),
        memory=memory,
        decode_rows_per_call=run.decode_rows if run.engine == "hf" else None,
    )


def memory_estimate(
    cfg: DictConfig, source, rollouts_per_round: int, group: GroupShape
) -> tuple[MemoryEstimate | None, RunShape]:
    """The run's peak-memory estimate from the model's config.json (no weights are read; None without one), and
    the run's shape as estimated (its decode rows fitted to the GPU for generator.batch_size=auto)."""
    run = run_shape(cfg, group, rollouts_per_round)
    config = source.config(cfg.model.trust_remote_code)
    if config is None:
        return None, run
    lora = cfg.model.lora
    target = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    shape = model_shape(config, lora.r, target)
    run = fit_decode_rows(shape, run, gpu_memory())
    return estimate(shape, run), run


def score_references(dm: RolloutDataModule, reward_fn) -> float:
    """Mean reward of the reference solutions against their own answers: 1.0 when data and reward agree."""
    scores = [reward_fn(p.solution, p.answer, record=p.record) for p in dm.problems]
    mean = sum(scores) / len(scores)
    print(f"reference solutions score {mean:.4f} on {len(scores)} problems")
    if mean < 1.0:
        log.warning("%d reference solutions do not score 1.0", sum(s < 1.0 for s in scores))
    return mean
