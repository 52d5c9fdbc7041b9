"""The exported policy as an artifact: a model card in `<output_dir>/policy/README.md` and, on request
(`export.merged=true`), merged full weights in `<output_dir>/policy/merged/` that load without peft.

`SavePolicy` (callbacks.py) writes the adapter (or the full model) at the end of training; `Run.fit` then calls
`export_policy`, once the final evaluation's metrics are known, on rank 0 only.
"""

from __future__ import annotations

import copy
import logging
import shlex
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from grpo_lightning.data.source import DataSource
from grpo_lightning.generation.vllm.weights import is_peft_model
from grpo_lightning.models.sources import ModelSource
from grpo_lightning.variants.base import GRPOVariant, variant_name

log = logging.getLogger(__name__)

MERGED = "merged"
CARD_METRICS = (
    "eval/accuracy",
    "eval/gsm8k_accuracy",
    "eval/format_rate",
    "eval/completion_len_mean",
    "train/reward_mean",
    "train/kl",
    "rollout/format_rate",
    "rollout/completion_len_mean",
)


def export_policy(
    directory: Path,
    cfg: DictConfig,
    policy: nn.Module,
    tokenizer,
    metrics: dict[str, float],
    source: ModelSource,
    variant: GRPOVariant,
    data: DataSource,
) -> None:
    """Write the model card (and the merged weights when `export.merged` is set) beside the saved policy.

    `source` is the run's `model.source` object: the card names it and tells how to load the base model. `variant`
    is the run's: the card says how it sampled a prompt's group. `data` is the run's data source: the card asks it
    for its words and tags.
    """
    directory = Path(directory)
    if not directory.is_dir():  # nothing was saved (e.g. the run stopped before training ended)
        return
    export = cfg.get("export") or {}
    merged_dir = None
    if export.get("merged", False):
        merged_dir = directory / MERGED
        save_merged(policy, tokenizer, merged_dir)
        log.info("merged weights saved to %s", merged_dir)
    is_adapter = is_peft_model(policy)
    model, base = source.describe(), source.base_model_ref()
    card = model_card(cfg, metrics, model, base, is_adapter, directory, merged_dir, variant, data)
    (directory / "README.md").write_text(card)


def save_merged(policy: nn.Module, tokenizer, directory: Path) -> None:
    """Full weights with the LoRA update folded in (W + scaling x B @ A), written by `save_pretrained`.

    The merge runs on a copy: the trained policy (and its frozen base, the KL reference) stay as they are.
    Full fine-tuning has nothing to merge and saves the model itself.
    """
    model = copy.deepcopy(policy).merge_and_unload() if is_peft_model(policy) else policy
    with torch.no_grad():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def command_line() -> str:
    """The command that made the run: Hydra's overrides when run from the CLI, else a note."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:  # no Hydra app: `train(cfg)` called in-process
        return "train(cfg) called in-process (the composed config is in the run directory's .hydra/ when run by Hydra)"
    return shlex.join([Path(sys.executable).name, "-m", "grpo_lightning", *overrides])


def reward_terms(cfg: DictConfig) -> str:
    """The reward pipeline in one line: `name` x weight for each term, then the group transforms."""
    reward = cfg.get("reward") or {}
    terms = ", ".join(f"`{name}` x {term.get('weight', 1.0)}" for name, term in (reward.get("terms") or {}).items())
    groups = ", ".join(f"`{name}`" for name in (reward.get("group_transforms") or {}))
    return f"terms {terms or 'none'}" + (f"; group transforms {groups}" if groups else "")


def model_card(
    cfg: DictConfig,
    metrics: dict[str, float],
    model: str,
    base: str | None,
    is_adapter: bool,
    directory: Path,
    merged_dir: Path | None,
    variant: GRPOVariant,
    data: DataSource,
) -> str:
    """The policy's README.md: what it is, how it was trained, its final metrics, the command, how to load it."""
    loss = cfg.loss
    group = variant.group()
    lora = cfg.model.lora
    kind = f"LoRA adapter (r={lora.r}, alpha={lora.alpha}, {lora.target_modules})" if is_adapter else "full model"
    lines = [
        "---",
        "library_name: " + ("peft" if is_adapter else "transformers"),
        *([f"base_model: {base}"] if base and "/" in base and not base.startswith("/") else []),
        f"tags: [{', '.join(('grpo', *data.card_tags, 'grpo_lightning'))}]",
        "---",
        "",
        "# GRPO policy trained with grpo_lightning",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{model}`" + (f" (`{base}`)" if base and base != model else "") + " |",
        f"| weights here | {kind}" + (f"; merged full weights in `{MERGED}/`" if merged_dir else "") + " |",
        f"| data | {data.card_description()} |",
        f"| variant | `{variant_name(type(variant))}` |",
        f"| loss | `{loss.loss_type}`, beta {loss.beta}, epsilon {loss.epsilon_low}/{loss.epsilon_high} |",
        f"| reward | {reward_terms(cfg)} (docs/rewards.md) |",
        f"| rounds | {cfg.trainer.max_epochs} x {cfg.data.prompts_per_round} prompts, "
        f"{group.samples} each, at most {cfg.generator.max_new_tokens} new tokens a completion |",
        f"| optimizer | lr {cfg.optim.optimizer.lr}, schedule `{cfg.optim.schedule.kind}` |",
        f"| seed | {cfg.seed} |",
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| `{k}` | {metrics[k]:.4g} |" for k in CARD_METRICS if k in metrics),
        "",
        f"Evaluation: greedy pass@1 on {cfg.eval.num_problems} test problems (seed {cfg.eval.seed}); "
        "`eval/accuracy` reads the answer whatever its format (docs/data.md). "
        "All metrics: `final_metrics.json` in the run directory.",
        "",
        "## The command that made it",
        "",
        "```",
        command_line(),
        "```",
        "",
        "## Loading",
        "",
        *_loading(is_adapter, model, base, directory, merged_dir, lora.r),
    ]
    lines += [
        "## Training configuration",
        "",
        "```yaml",
        OmegaConf.to_yaml(_card_config(cfg)).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _card_config(cfg: DictConfig) -> DictConfig:
    keys = ("seed", "variant", "loss", "model", "generator", "data", "optim", "trainer")
    return OmegaConf.masked_copy(cfg, [k for k in keys if k in cfg])


def _loading(is_adapter: bool, model: str, base: str | None, directory: Path, merged_dir: Path | None, r: int):
    """The card's "Loading" lines: with peft (an adapter), with transformers alone and vLLM (full or merged
    weights), or vLLM's LoRA support (an adapter without merged weights)."""
    base_for_code = base or "<base model folder>"
    lines = _code("With transformers and peft:", PEFT_LOADING.format(base=base_for_code, folder=directory))
    lines = lines if is_adapter else []
    if merged_dir or not is_adapter:
        folder = merged_dir or directory
        title = "With transformers alone" + (" (merged weights)" if is_adapter else "") + ":"
        lines += _code(title, FULL_LOADING.format(folder=folder)) + _code(
            "With vLLM:", VLLM_LOADING.format(folder=folder)
        )
    else:
        title = ("With vLLM (the adapter through vLLM's LoRA support; or export merged weights with "
                 "`export.merged=true` and pass that folder as `model`):")  # fmt: skip
        lines += _code(title, VLLM_LORA_LOADING.format(base=base_for_code, rank=max(r, 8), folder=directory))
    if base is None:
        lines += [
            f"The base model `{model}` exists only in memory; rebuild it with the same `model.source` "
            "(grpo_lightning.models.sources) to load the adapter.",
            "",
        ]
    return lines


def _code(title: str, code: str) -> list[str]:
    return [title, "", "```python", *code.splitlines(), "```", ""]


PEFT_LOADING = """from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base = AutoModelForCausalLM.from_pretrained("{base}")
model = PeftModel.from_pretrained(base, "{folder}")
tokenizer = AutoTokenizer.from_pretrained("{folder}")"""
FULL_LOADING = """from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{folder}")
tokenizer = AutoTokenizer.from_pretrained("{folder}")"""
VLLM_LOADING = """from vllm import LLM

llm = LLM(model="{folder}")"""
VLLM_LORA_LOADING = """from vllm import LLM
from vllm.lora.request import LoRARequest

llm = LLM(model="{base}", enable_lora=True, max_lora_rank={rank})
outputs = llm.generate(prompts, lora_request=LoRARequest("policy", 1, "{folder}"))"""
