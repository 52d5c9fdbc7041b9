"""bf16 autocast on CPU: what it buys in training time and what it costs in log-prob accuracy.

    GRPO_LIGHTNING_CACHE=/tmp/glcache python benchmarks/bf16_drift.py --rounds 2

Builds the default run (embedded model, fp32 weights), samples `--rounds` rounds of rollouts, then for every
micro-batch: the completion log-probs in float32 and under `torch.autocast("cpu", torch.bfloat16)` (what
`trainer.precision=bf16-mixed` runs the training step under), and the wall time of the policy forward +
backward and the reference forward both ways. Prints the per-token |log-prob difference| (mean, p99, max) of
bf16 against float32, the same for the float32 generator against the float32 trainer (the noise floor), and
the train time per round both ways. Timings on a shared machine are noisy: compare within one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from round_profile import train_round  # noqa: E402
from vs_trl import compose  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--override", action="append", default=[], help="Hydra override (repeatable)")
    args = parser.parse_args()

    from grpo_lightning.app.train import build_run
    from grpo_lightning.training.rollout_loop import RolloutLoop
    from grpo_lightning.training.round_layout import lay_out

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(compose(tmp, 1, args.override))
        module, dm = run.module, run.datamodule
        rollout = next(c for c in run.trainer.callbacks if isinstance(c, RolloutLoop))
        module.policy.train()
        precisions = {"fp32": contextlib.nullcontext, "bf16 autocast": partial(torch.autocast, "cpu", torch.bfloat16)}
        bf16_vs_fp32, gen_vs_fp32, times = [], [], {name: [] for name in precisions}
        for r in range(args.rounds):
            torch.manual_seed(r)
            rollouts = rollout.sampler.variant.generate_rollouts(
                rollout.generator, dm.prompts_for_round(r, rollout.tokenizer), rollout.reward_fn, rollout.decode
            )
            dm.serve(lay_out(rollouts, r, dm.micro_batches_per_round, dm.settings, rollout.tokenizer.pad_token_id))
            with torch.no_grad():
                for batch in dm.schedule:
                    mask = batch.sequence_mask.bool()  # [B, C]
                    fp32 = module.completion_logprobs(module.policy, batch)
                    with precisions["bf16 autocast"]():
                        bf16 = module.completion_logprobs(module.policy, batch)
                    bf16_vs_fp32.append((bf16 - fp32)[mask].abs())
                    gen_vs_fp32.append((batch.gen_logprobs - fp32)[mask].abs())
            for name, precision in precisions.items():
                start = time.perf_counter()
                with precision():
                    train_round(module, dm.schedule)
                times[name].append(time.perf_counter() - start)

    def describe(diffs: list[torch.Tensor]) -> str:
        d = torch.cat(diffs).double()
        return f"mean {d.mean():.2e}  p99 {d.quantile(0.99):.2e}  max {d.max():.2e}  ({d.numel()} tokens)"

    print(f"|logp bf16 autocast - logp fp32|       {describe(bf16_vs_fp32)}")
    print(f"|logp fp32 generator - logp fp32 trainer| {describe(gen_vs_fp32)}")
    for name, values in times.items():
        print(f"train s per round, {name:<14} {' '.join(f'{v:.2f}' for v in values)}")


if __name__ == "__main__":
    main()
