"""Fingerprints of what training did: hashes of the trainable parameters and the AdamW state after fixed-seed runs.

A refactor that must not change behaviour prints the same table before and after. Each case trains the tiny
random model (`model=tiny`, a dense test reward) in this process with evaluation off, then hashes every
trainable parameter and every optimizer-state tensor, in order, byte for byte.

    python benchmarks/behaviour_hash.py            # prints "case | parameters | optimizer state"
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONE_TREE = "variant.trees=1"
"""One initial completion a prompt: the STORPO cases from before the forest, kept so those stay comparable."""
SENTENCE_GROUP = ["variant.step_rule=sentence", "variant.fallback_rule=none", "variant.advantage=group", ONE_TREE]
"""STORPO with sentence boundaries, a plain group where there are fewer than min_steps, and one flat group: the
settings of the two storpo cases' first fingerprints, kept so those stay comparable."""
CASES = {
    "grpo, 3 rounds": ["trainer.max_epochs=3"],
    "storpo, 3 rounds": ["variant=storpo", "trainer.max_epochs=3", *SENTENCE_GROUP],
    "storpo uncertainty, group, 3 rounds": [
        "variant=storpo",
        "variant.advantage=group",
        "trainer.max_epochs=3",
        ONE_TREE,
    ],  # fmt: skip
    "storpo uncertainty, tree, 3 rounds": ["variant=storpo", "trainer.max_epochs=3", ONE_TREE],
    "storpo forest (defaults), 3 rounds": ["variant=storpo", "trainer.max_epochs=3"],
    "grpo, dapo, 2 passes, 4 steps a round": [
        "loss=dapo",
        "data.num_iterations=2",
        "trainer.accumulate_grad_batches=1",
        "trainer.max_epochs=2",
    ],  # fmt: skip
    "storpo, beta 0.04, 2 rounds": ["variant=storpo", "loss.beta=0.04", "trainer.max_epochs=2", *SENTENCE_GROUP],
}
BASE = [
    "model=tiny",
    "generator.max_new_tokens=16",
    "trainer.enable_progress_bar=false",
    "~reward.terms.gsm8k",
    "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
    "optim.optimizer.lr=1e-3",
    "eval.enabled=false",
]


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint(overrides: list[str]) -> tuple[str, str]:
    from tests.conftest import make_cfg

    try:
        from grpo_lightning.app.train import build_run
    except ImportError:
        from grpo_lightning.app.train import build_run

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(make_cfg(Path(tmp), BASE + overrides))
        run.fit()
        params = [p for p in run.module.policy.parameters() if p.requires_grad]
        state = run.trainer.optimizers[0].state
        opt = [v for p in params for _, v in sorted(state[p].items()) if isinstance(v, torch.Tensor)]
        return digest(params), digest(opt)


def main() -> None:
    print("| case | parameters | optimizer state |\n|---|---|---|")
    for name, overrides in CASES.items():
        params, opt = fingerprint(overrides)
        print(f"| {name} | {params} | {opt} |", flush=True)


if __name__ == "__main__":
    main()
