"""Config keys that moved, each with the key to use instead: a command-line override of one (checked before Hydra,
which would refuse it with a message that cannot name the new key) and a composed config that still sets one (an
old experiment file) are refused in one line naming the new key."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

# Old keys, with the new key to use instead (a one-line error names it).
MOVED_KEYS = {
    "reward.format_bonus": "reward.terms.gsm8k.format_bonus (reward=gsm8k; docs/rewards.md)",
    "reward._target_": (
        "a reward term: ~reward.terms.gsm8k +reward.terms.<name>._target_=<your function or class> (docs/rewards.md)"
    ),
    "loss.scale_rewards": "reward.group_transforms.normalize.scale (group | batch | none | auto; docs/rewards.md)",
    "variant.scale_rewards": "reward.group_transforms.normalize.scale (group | batch | none | auto; docs/rewards.md)",
    "generator.num_generations": (
        "variant.num_generations (the variant owns its group; variant=storpo: variant.trees and "
        "variant.fallback_generations, self-play: variant.games_per_group)"
    ),
    # the speed levers: one perf group (perf=cpu_fast | plain; docs/performance.md)
    **{
        f"{old}.{name}": f"perf.{new}.{name} (perf=cpu_fast | plain; docs/performance.md)"
        for old, new, names in (
            ("forward", "forward", ("share_prefix", "logits_chunk_tokens", "runs_by_length", "fused_lora")),
            (
                "generator",
                "generate",
                ("custom_decode", "sampler", "merge_lora", "share_prefill", "stream_logprobs", "packed_weights"),
            ),
        )
        for name in names
    },
}


def moved_key_message(key: str) -> str:
    return f"{key} has moved: use {MOVED_KEYS[key]}"


def check_moved_overrides(overrides: list[str]) -> str | None:
    """The one-line message for a command-line override of a moved key (`reward.format_bonus=0.2`), else None.

    Hydra rejects an unknown key before any project code runs, with a message that cannot name the new key, so
    the CLI checks its arguments first.
    """
    for arg in overrides:
        key = arg.lstrip("~+").split("=", 1)[0].strip()
        if key in MOVED_KEYS:
            return moved_key_message(key)
    return None


def check_moved_keys(cfg: DictConfig) -> None:
    """A composed config (e.g. from an old experiment file) that still sets a moved key: ValueError naming it."""
    for key in MOVED_KEYS:
        group, name = key.split(".", 1)
        node = cfg.get(group)
        if node is not None and OmegaConf.is_dict(node) and name in node:
            raise ValueError(moved_key_message(key))
