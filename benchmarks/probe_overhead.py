"""What the probes cost: optimizer-step time with each probe setting and with none, side by side, in one run.

    python benchmarks/probe_overhead.py                          # embedded default: LoRA, then full fine-tuning
    python benchmarks/probe_overhead.py --only lora --rounds 3   # 3 steps of each setting
    python benchmarks/probe_overhead.py --override model=tiny    # any config override, appended

One real `build_run(cfg).fit()` per mode (LoRA / full fine-tuning) of the default config (eval off) with both
probes attached. A rotation callback, placed before the probes, switches them per optimizer step: step k runs
setting k mod 5 of: none, gns, entropy (default settings), entropy + first_order, entropy + measure_actual +
first_order. So every setting and "off" interleave in the same process, on the same weights and the same machine
load. The first round's rollouts are generated once and served again every round (the variant is wrapped),
so every step trains on identical batches and step times differ only by the probe. A step is timed from its
first micro-batch's `on_train_batch_start` to its last micro-batch's `on_train_batch_end` (forward, reference
forward, backward, optimizer step, every probe hook); the first rotation is warm-up and dropped. Printed: the
median step time of each setting, its overhead over "none" as a fraction of the training step and of the whole
round (training step + the measured rollout generation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "grpo_lightning" / "conf")

SETTINGS = {  # name: (gns on, entropy on, entropy.first_order, entropy.measure_actual)
    "none": (False, False, False, False),
    "gns": (True, False, False, False),
    "entropy": (False, True, False, False),
    "entropy+first_order": (False, True, True, False),
    "entropy+first_order+actual": (False, True, True, True),
}
OFF = 10**9
"""An `every_n_steps` no measured step is a multiple of: the probe sits this step out."""
MODES = {"lora": [], "full": ["model.lora.enabled=false"]}


def compose(output_dir: str, steps: int, extra: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides = [
        f"trainer.max_epochs={steps}",
        "eval.enabled=false",
        "trainer.enable_progress_bar=false",
        "data.dynamic_sampling.enabled=false",  # every round serves the first round's rollouts (FrozenRollouts)
        *extra,
    ]
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


class Rotation(L.Callback):
    """Before the probes: sets which probe runs on this optimizer step, and times the step (after everything)."""

    def __init__(self, gns, entropy) -> None:
        self.gns, self.entropy = gns, entropy
        self.names = list(SETTINGS)
        self.rows: list[tuple[int, str, float]] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches:
            return
        name = self.names[trainer.global_step % len(self.names)]
        gns_on, entropy_on, first_order, actual = SETTINGS[name]
        # a probe is active on the steps where global_step % every_n_steps == 0: 1 runs it now, OFF skips it
        # (except at step 0, which is warm-up and dropped)
        self.gns.every_n_steps = 1 if gns_on else OFF
        self.entropy.every_n_steps = 1 if entropy_on else OFF
        self.entropy.first_order, self.entropy.measure_actual = first_order, actual
        self._name, self._start = name, time.perf_counter()

    def stop(self, trainer, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.rows.append((trainer.global_step - 1, self._name, time.perf_counter() - self._start))


class StepEnd(L.Callback):
    """After the probes: closes the step's timing window."""

    def __init__(self, rotation: Rotation) -> None:
        self.rotation = rotation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.rotation.stop(trainer, batch_idx)


def measure(mode: str, rounds: int, extra: list[str]) -> tuple[dict[str, float], float]:
    """Median step seconds per setting and the rollout seconds of one round."""
    from grpo_lightning.app.train import build_run
    from grpo_lightning.probes.entropy import EntropyProbe
    from grpo_lightning.probes.gns import GradientNoiseScaleProbe
    from grpo_lightning.training.rollout_loop import RolloutLoop

    steps = len(SETTINGS) * (rounds + 1)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*MODES[mode], "probe=[gns,entropy]", *extra]
        run = build_run(compose(tmp, steps, overrides))
        callbacks = run.trainer.callbacks
        rollout_cb = next(c for c in callbacks if isinstance(c, RolloutLoop))
        rollout_cb.sampler.variant = frozen = FrozenRollouts(rollout_cb.sampler.variant)
        gns = next(c for c in callbacks if isinstance(c, GradientNoiseScaleProbe))
        entropy = next(c for c in callbacks if isinstance(c, EntropyProbe))
        rotation = Rotation(gns, entropy)
        callbacks.insert(callbacks.index(gns), rotation)  # switches the probes before they look at the step
        callbacks.append(StepEnd(rotation))  # stops the clock after every probe hook
        run.fit()
    rows = [(step, name, s) for step, name, s in rotation.rows if step >= len(SETTINGS)]
    medians = {name: statistics.median(s for _, n, s in rows if n == name) for name in SETTINGS}
    return medians, frozen.seconds


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="measured steps of each setting (after 1 warm-up)")
    parser.add_argument("--only", choices=sorted(MODES), action="append", help="lora and/or full (default both)")
    parser.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    args = parser.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    load = os.getloadavg()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores, OMP_NUM_THREADS={threads}, load average {load[0]:.1f}")
    table = []
    for mode in args.only or list(MODES):
        medians, rollout_s = measure(mode, args.rounds, args.override)
        table.append((mode, medians, rollout_s))
    print(f"\nmedian optimizer-step time over {args.rounds} steps per setting, interleaved in one run per mode")
    print(f"{'mode':<5} {'setting':<27} {'step s':>8} {'+% step':>8} {'round s':>8} {'+% round':>9}")
    for mode, medians, rollout_s in table:
        off = medians["none"]
        for name, seconds in medians.items():
            extra_s = seconds - off
            print(
                f"{mode:<5} {name:<27} {seconds:8.2f} {100 * extra_s / off:+7.1f}% "
                f"{off + rollout_s:8.2f} {100 * extra_s / (off + rollout_s):+8.1f}%"
            )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
