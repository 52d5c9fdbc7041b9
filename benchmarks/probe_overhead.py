"""What the probes cost: optimizer-step time with each probe on and off, side by side, in one invocation.

    python benchmarks/probe_overhead.py                       # embedded default (LoRA) and full fine-tuning
    python benchmarks/probe_overhead.py --steps 14 --only lora
    python benchmarks/probe_overhead.py --override model=tiny  # any config override, appended to each run

Each measurement is one real `build_run(cfg).fit()` of the default config (eval off) with one probe selected and
`every_n_steps=2`: even optimizer steps are probed, odd ones are not, so "on" and "off" steps interleave in the
same process, on the same weights and the same machine load. The round's rollouts are generated once and
served again every round (the generator is wrapped), so every step trains on identical batches and step times
differ only by the probe. A step is timed from its first micro-batch's `on_train_batch_start` to its last
micro-batch's `on_train_batch_end` (forward, reference forward, backward, optimizer step and every probe hook);
the first two steps are warm-up and dropped. Reported: the median step time on and off, their ratio, and the
overhead as a fraction of the training step and of the whole round (training step + the measured rollout).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")

PROBES = {
    "gns": ["probe=[gns]", "probe.gns.every_n_steps=2"],
    "entropy": ["probe=[entropy]", "probe.entropy.every_n_steps=2"],
    "entropy+actual": ["probe=[entropy]", "probe.entropy.every_n_steps=2", "probe.entropy.measure_actual=true"],
}
MODES = {"lora": [], "full": ["model.lora.enabled=false"]}


def compose(output_dir: str, steps: int, extra: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides = [f"trainer.max_epochs={steps}", "eval.enabled=false", "trainer.enable_progress_bar=false", *extra]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = output_dir
    return cfg


class FrozenRollouts:
    """A variant that samples its first round for real and serves the same rollouts every later round."""

    def __init__(self, variant) -> None:
        self.variant, self.rollouts, self.seconds = variant, None, 0.0

    def __getattr__(self, name):
        return getattr(self.variant, name)

    def generate_rollouts(self, *args, **kwargs):
        if self.rollouts is None:
            start = time.perf_counter()
            self.rollouts = self.variant.generate_rollouts(*args, **kwargs)
            self.seconds = time.perf_counter() - start
        return self.rollouts


class StepTimer(L.Callback):
    """Wall time of each optimizer step, first micro-batch start to last micro-batch end (runs after the probes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.rows.append((trainer.global_step - 1, time.perf_counter() - self._start))


def measure(probe: str, mode: str, steps: int, extra: list[str]) -> dict:
    from grpo_lightning.generation.callback import RolloutCallback
    from grpo_lightning.train import build_run

    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(compose(tmp, steps, [*MODES[mode], *PROBES[probe], *extra]))
        rollout_cb = next(c for c in run.trainer.callbacks if isinstance(c, RolloutCallback))
        rollout_cb.variant = frozen = FrozenRollouts(rollout_cb.variant)
        timer = StepTimer()
        run.trainer.callbacks.append(timer)
        run.fit()
    rows = [(s, t) for s, t in timer.rows if s >= 2]
    on = statistics.median(t for s, t in rows if s % 2 == 0)
    off = statistics.median(t for s, t in rows if s % 2 == 1)
    return {"probe": probe, "mode": mode, "on": on, "off": off, "rollout": frozen.seconds, "n": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per measurement (2 are warm-up)")
    parser.add_argument("--only", choices=sorted(MODES), action="append", help="lora and/or full (default both)")
    parser.add_argument("--probe", choices=sorted(PROBES), action="append", help="default: all")
    parser.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    args = parser.parse_args()
    results = [
        measure(probe, mode, args.steps, args.override)
        for mode in args.only or list(MODES)
        for probe in args.probe or list(PROBES)
    ]
    print(f"\nmedian optimizer-step time, probe on (even steps) vs off (odd steps), {args.steps - 2} steps each")
    print(f"{'mode':<5} {'probe':<15} {'off s':>7} {'on s':>7} {'on/off':>7} {'+% step':>8} {'round s':>8} {'+% round':>9}")
    for r in results:
        extra_s = r["on"] - r["off"]
        round_s = r["off"] + r["rollout"]
        print(
            f"{r['mode']:<5} {r['probe']:<15} {r['off']:7.3f} {r['on']:7.3f} {r['on'] / r['off']:7.3f} "
            f"{100 * extra_s / r['off']:+7.1f}% {round_s:8.2f} {100 * extra_s / round_s:+8.1f}%"
        )


if __name__ == "__main__":
    main()
