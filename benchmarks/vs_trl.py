"""TRL's GRPOTrainer vs grpo_lightning on identical work, one invocation, one subprocess per system.

    pip install -e '.[bench]'                      # TRL: a benchmark-only extra, never a runtime dependency
    GRPO_LIGHTNING_CACHE=/tmp/glcache python benchmarks/vs_trl.py --steps 4
    python benchmarks/vs_trl.py --check            # same batch through both losses: loss, KL and gradient agree

Identical work: the embedded SmolLM2-135M-Instruct (the converted safetensors folder, loaded with transformers
for TRL), fp32 (or `--bf16` for both), the same GSM8K prompts per step (our data module's seeded order, fed to
TRL unshuffled) with the same chat template, G = 4 completions per prompt, 4 prompts per step, 128 max new
tokens, temperature 1, LoRA r16 alpha32 all-linear, beta 0.04, loss_type `grpo` (per-sequence token mean, then
mean; TRL's semantics are ours), group-scaled advantages, micro-batches of 4 completions, one optimizer step of
16 completions per step, AdamW lr 5e-5, clip norm 1, and the same reward (`GSM8KReward`, wrapped for TRL's
`reward_funcs`). TRL keeps its own defaults otherwise (gradient checkpointing on: `--trl-no-gc` turns it off),
except `use_bias_correction_kl=False`, which makes its KL gradient the plain k3 one we use (the values are the
same either way on-policy, the gradients are not).

Per step: wall time of a whole cycle (rollout + train + bookkeeping), median over the steps after the first.
"rollout" is TRL's `_generate_and_score_completions` (generation, rewards AND its reference forward) and our
rollout callback's generation (the reference forward is in our train step). Peak RSS is the child's VmHWM.
Timings on a shared machine are noisy: compare the two systems within one invocation, by their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "grpo_lightning" / "conf")
PROMPTS_PER_STEP, GROUP, MAX_NEW, MICRO = 4, 4, 128, 4
BETA, LR = 0.04, 5e-5
# grpo_lightning with every speed lever off: plain `generate` (output_logits), full forward, full logits.
PLAIN = ["perf=plain"]


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def compose(output_dir: str, steps: int, extra: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    overrides = [
        f"trainer.max_epochs={steps}",
        f"data.prompts_per_round={PROMPTS_PER_STEP}",
        f"generator.num_generations={GROUP}",
        f"generator.max_new_tokens={MAX_NEW}",
        "loss=grpo",
        f"loss.beta={BETA}",
        f"optim.optimizer.lr={LR}",
        "eval.enabled=false",
        "trainer.enable_progress_bar=false",
        *extra,
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = output_dir
    return cfg


def bench_prompts(cfg, steps: int):
    """(messages, answer) of every step's prompts, in our data module's order."""
    from hydra.utils import instantiate

    dm = instantiate(cfg.data)
    dm.setup("fit")
    rows = []
    for step in range(steps):
        for i in dm.problem_indices_for_round(step):
            problem = dm.problems[i]
            rows.append({"prompt": dm.dataset.messages(problem.question), "answer": problem.answer})
    return rows


def model_dir(cfg) -> str:
    from grpo_lightning.models.sources import PackagedGGUFSource

    return str(PackagedGGUFSource(cache_dir=os.path.expanduser(cfg.paths.cache_dir)).ensure_converted())


# ---- grpo_lightning ------------------------------------------------------------------------------------------
def run_ours(steps: int, extra: list[str]) -> dict:
    import lightning as L

    from grpo_lightning.app.train import build_run
    from grpo_lightning.training.rollout_loop import RolloutLoop

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.starts, self.ends, self.rollout, self.lengths = [], [], [], []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            rc = next(c for c in trainer.callbacks if isinstance(c, RolloutLoop))
            self.rollout.append(rc.round_metrics["time/rollout_s"])
            self.lengths.append(rc.round_metrics["rollout/completion_len_mean"])
            self.starts.append(time.perf_counter())

        def on_train_epoch_end(self, trainer, pl_module) -> None:  # runs first: before the next round's rollout
            self.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, steps, extra)
        run = build_run(cfg)
        timer = Timer()
        run.trainer.callbacks.insert(0, timer)
        run.fit()
        fit_end = time.perf_counter()
    out = {"system": "grpo_lightning", "step_s": [], "rollout_s": timer.rollout, "train_s": []}
    for k in range(steps):
        nxt = timer.starts[k + 1] if k + 1 < steps else fit_end
        next_rollout = timer.rollout[k + 1] if k + 1 < steps else 0.0
        out["step_s"].append(nxt - timer.starts[k] - next_rollout + timer.rollout[k])
        out["train_s"].append(out["step_s"][-1] - timer.rollout[k])
    out["completion_len"] = timer.lengths
    return out


# ---- TRL -----------------------------------------------------------------------------------------------------
def trl_args(output_dir: str, steps: int, gc: bool, bf16: bool, per_device: int = MICRO):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=bf16,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=PROMPTS_PER_STEP * GROUP // per_device,
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        beta=BETA,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        use_bias_correction_kl=False,
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        gradient_checkpointing=gc,
        seed=0,
    )


def gsm8k_reward_for_trl():
    from grpo_lightning.rewards.gsm8k import GSM8KReward

    reward = GSM8KReward(format_bonus=0.1)

    def gsm8k(prompts, completions, answer, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [reward(t, a) for t, a in zip(texts, answer, strict=True)]

    return gsm8k


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def run_trl(steps: int, gc: bool, bf16: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, steps, [])
        rows = bench_prompts(cfg, steps)
        folder = model_dir(cfg)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        rollout: list[float] = []

        class TimedGRPOTrainer(GRPOTrainer):
            def _generate_and_score_completions(self, inputs):
                start = time.perf_counter()
                result = super()._generate_and_score_completions(inputs)
                rollout.append(time.perf_counter() - start)
                return result

        marks: list[float] = []

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                marks.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                marks.append(time.perf_counter())

        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward_for_trl(),
            args=trl_args(tmp, steps, gc, bf16),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=lora_config(),
            callbacks=[StepTimer()],
        )
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    step_s = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "system": "trl",
        "step_s": step_s,
        "rollout_s": rollout,
        "train_s": [s - r for s, r in zip(step_s, rollout, strict=False)],
        "completion_len": lengths,
    }


# ---- same batch through both losses ----------------------------------------------------------------------------
def check(steps: int = 1) -> dict:
    """One batch of 16 completions (sampled once), scored by our module and by TRL's `_compute_loss`.

    Both start from the same LoRA initialisation (same seed). Compared: loss, mean KL (TRL's `kl` metric) after
    perturbing the adapters (so the KL is non-zero), and the gradient of every LoRA parameter.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lightning.algorithm.losses import GRPOLoss
    from grpo_lightning.algorithm.rollouts import collate_rollouts
    from grpo_lightning.rewards.pipeline import pipeline_from_function
    from grpo_lightning.training.module import GRPOModule, LRSchedule
    from grpo_lightning.variants.baseline import BaselineGRPO

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(tmp, 1, [])
        rows = bench_prompts(cfg, 1)
        folder = model_dir(cfg)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        from trl import GRPOTrainer

        from grpo_lightning.generation.hf import HFGenerator
        from grpo_lightning.types import Prompt

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=gsm8k_reward_for_trl(),
            args=trl_args(tmp, 1, gc=False, bf16=False, per_device=PROMPTS_PER_STEP * GROUP),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=lora_config(),
        )
        policy = trainer.model  # the PeftModel TRL trains (with TRL's fused LM head patched in)
        with torch.no_grad():  # move the adapters off zero so the policy differs from the reference (KL > 0)
            gen = torch.Generator().manual_seed(1)
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 2e-3)
        # sample one batch with our generator from the same policy
        prompts = []
        for gid, row in enumerate(rows):
            text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            prompts.append(Prompt(prompt_ids=ids, answer=row["answer"], question="", problem_index=gid))
        generator = HFGenerator(policy, tokenizer, num_generations=GROUP, max_new_tokens=MAX_NEW)
        torch.manual_seed(0)
        variant = BaselineGRPO(num_generations=GROUP)
        rollouts = variant.generate_rollouts(
            generator,
            prompts,
            pipeline_from_function(lambda t, a: 0.1 if "#" in t else len(t) % 7 / 7.0),  # dense: non-zero advantages
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        batch = collate_rollouts(rollouts, tokenizer.pad_token_id)
        policy.train()

        # ours
        module = GRPOModule(
            policy,
            None,
            GRPOLoss(loss_type="grpo", beta=BETA, max_completion_length=MAX_NEW),
            optimizer=None,
            schedule=LRSchedule(),
            total_steps=1,
        )
        logits, logp = module.policy_forward(policy, batch)
        out = module.loss_fn(
            logp, logp.detach(), module.reference_logprobs(batch), batch.advantages, batch.completion_mask
        )
        policy.zero_grad()
        out.loss.backward()
        ours_grad = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad()

        # TRL, on the same tensors (its layout is ours: prompts left-padded, completions right-padded)
        p = batch.prompt_len
        inputs = {
            "prompt_ids": batch.input_ids[:, :p],
            "prompt_mask": batch.attention_mask[:, :p],
            "completion_ids": batch.input_ids[:, p:],
            "completion_mask": batch.attention_mask[:, p:],
            "advantages": batch.advantages,
        }
        with torch.no_grad(), policy.disable_adapter():
            input_ids = batch.input_ids
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                policy, input_ids, batch.attention_mask, input_ids.shape[1] - p
            )[0]
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch here
        trl_loss = trainer._compute_loss(policy, inputs)
        trl_loss.backward()
        trl_grad = {n: q.grad.clone() for n, q in policy.named_parameters() if q.grad is not None}
        trl_kl = trainer._metrics["train"]["kl"][-1]
        grad_diff = max(float((ours_grad[n] - trl_grad[n]).abs().max()) for n in ours_grad)
        grad_scale = max(float(g.abs().max()) for g in ours_grad.values())
        ref_diff = float(
            ((inputs["ref_per_token_logps"] - module.reference_logprobs(batch)).abs() * batch.completion_mask).max()
        )
    return {
        "loss_ours": float(out.loss),
        "loss_trl": float(trl_loss),
        "kl_ours": float(out.kl_mean),
        "kl_trl": float(trl_kl),
        "ref_logp_max_abs_diff": ref_diff,
        "grad_max_abs_diff": grad_diff,
        "grad_max_abs": grad_scale,
        "num_tensors": len(ours_grad),
        "same_params": sorted(ours_grad) == sorted(trl_grad),
    }


# ---- driver ----------------------------------------------------------------------------------------------------
def child(args) -> None:
    if args.child in ("ours", "ours_plain"):
        extra = list(args.ours_override) + (PLAIN if args.child == "ours_plain" else [])
        if args.bf16:
            extra.append("model.dtype=bfloat16")
        result = run_ours(args.steps, extra)
        result["system"] = args.child
    elif args.child == "trl":
        result = run_trl(args.steps, gc=not args.trl_no_gc, bf16=args.bf16)
    else:
        result = check()
    result["peak_rss_gb"] = peak_rss_gb()
    Path(args.out).write_text(json.dumps(result))


def median_after_first(values: list[float]) -> float:
    rest = values[1:] if len(values) > 1 else values
    return statistics.median(rest) if rest else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per system (median over steps 2..N)")
    parser.add_argument("--only", choices=["ours", "trl"], help="run one system")
    parser.add_argument("--check", action="store_true", help="compare loss / KL / gradients on one batch, then exit")
    parser.add_argument("--trl-no-gc", action="store_true", help="TRL without its default gradient checkpointing")
    parser.add_argument("--bf16", action="store_true", help="bf16 for both (TRL: bf16 autocast; ours: model.dtype)")
    parser.add_argument("--ours-override", action="append", default=[], help="extra Hydra override for our side")
    parser.add_argument("--json", help="write the raw per-step results here")
    parser.add_argument("--plain", action="store_true", help="also run grpo_lightning with every lever off")
    parser.add_argument("--child", choices=["ours", "ours_plain", "trl", "check"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    systems = ["check"] if args.check else [s for s in ("trl", "ours") if args.only in (None, s)]
    if args.plain and not args.check:
        systems.insert(-1 if "ours" in systems else len(systems), "ours_plain")
    results = {}
    for system in systems:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, __file__, "--child", system, "--steps", str(args.steps), "--out", out]
        cmd += ["--trl-no-gc"] * args.trl_no_gc + ["--bf16"] * args.bf16
        for o in args.ours_override:
            cmd += ["--ours-override", o]
        print(f"running {system} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL if system != "check" else None)
        if proc.returncode:
            sys.exit(f"{system} failed with exit code {proc.returncode}")
        results[system] = json.loads(Path(out).read_text()) | {"wall_s": time.perf_counter() - start}
        os.unlink(out)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.check:
        print(json.dumps(results["check"], indent=1))
        return
    print_table(results, args)


def print_table(results: dict, args) -> None:
    rows = []
    for name, r in results.items():
        rows.append(
            {
                "system": {
                    "trl": "TRL GRPOTrainer",
                    "ours": "grpo_lightning",
                    "ours_plain": "grpo_lightning, levers off",
                }[name],
                "name": name,
                "step": median_after_first(r["step_s"]),
                "rollout": median_after_first(r["rollout_s"]),
                "train": median_after_first(r["train_s"]),
                "rss": r["peak_rss_gb"],
                "len": statistics.mean(r["completion_len"]) if r["completion_len"] else float("nan"),
                "steps": " ".join(f"{s:.1f}" for s in r["step_s"]),
            }
        )
    print(
        f"\n{args.steps} steps, 4 prompts x 4 completions, {MAX_NEW} new tokens, LoRA r16, beta {BETA}, "
        f"{'bf16' if args.bf16 else 'fp32'}; median over steps 2..N\n"
    )
    print("| system | step s | rollout s | train s | peak RSS GB | mean completion len | all steps s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['system']} | {r['step']:.1f} | {r['rollout']:.1f} | {r['train']:.1f} | {r['rss']:.2f} "
            f"| {r['len']:.0f} | {r['steps']} |"
        )
    by_name = {r["name"]: r for r in rows}
    trl = by_name.get("trl")
    for name in ("ours_plain", "ours"):
        if trl and name in by_name:
            r = by_name[name]
            print(
                f"| ratio {r['system']} / TRL | {r['step'] / trl['step']:.2f} | {r['rollout'] / trl['rollout']:.2f} "
                f"| {r['train'] / trl['train']:.2f} | {r['rss'] / trl['rss']:.2f} | | |"
            )


if __name__ == "__main__":
    main()
