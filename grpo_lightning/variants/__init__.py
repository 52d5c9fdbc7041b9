"""Rollout variants: how a round's prompts become scored, grouped rollouts."""

from grpo_lightning.variants.base import VARIANTS, GroupShape, GRPOVariant, register_variant
from grpo_lightning.variants.baseline import BaselineGRPO
from grpo_lightning.variants.selfplay import SelfPlay
from grpo_lightning.variants.storpo import STORPO

__all__ = ["STORPO", "VARIANTS", "BaselineGRPO", "GRPOVariant", "GroupShape", "SelfPlay", "register_variant"]
