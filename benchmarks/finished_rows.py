"""The HF engine's decode loop with finished rows leaving the batch against every row kept to the end, side by side.

    python benchmarks/finished_rows.py                                   # learn_arith's first round, untrained
    python benchmarks/finished_rows.py --ckpt RUN/checkpoints/last.ckpt  # the same prompts, a trained policy
    python benchmarks/finished_rows.py --threads 1 --rounds 2            # a machine other jobs keep busy

Builds the run as the CLI does (default `experiment=learn_arith`: 16 prompts x 8 samples x 48 new tokens at
T=0.7), encodes a round's prompts as the rollout loop does, and times `accel/decode_loop.py`'s `sample_loop` on
them with `compact=True` (the engine's behaviour with `sampler=inverse_cdf`) and `compact=False`, alternating,
each from the same random state, best of `--rounds`. The LoRA merge and the shared prefill are made once, outside
the timing. Prints the tokens each call wrote (the same in both: the random stream is the full batch's), the
batch sizes it was cut to, and the seconds. `--ckpt` loads a checkpoint's policy, whose replies are short: the case
the lever is for.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed_call(engine, ids: torch.Tensor, mask: torch.Tensor, group: int, compact: bool):  # [n, L] x 2
    """One call of the decode loop on a round's prompts (prefill shared, untimed): its seconds, its tokens
    [n * G, T] and the batch sizes it was cut to."""
    from grpo_lightning.accel.decode_loop import new_cache, sample_loop
    from grpo_lightning.accel.generation_levers import shared_prefill

    sampling, model = engine.sampling, engine.model
    cache = new_cache(model, ids.shape[1] + sampling.max_new_tokens)
    rows, row_mask, cache = shared_prefill(model, ids, mask, group, cache)
    cuts, select = [], cache.batch_select_indices
    cache.batch_select_indices = lambda keep: (cuts.append(len(keep)), select(keep))
    rng = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    tokens, _ = sample_loop(
        model, rows, row_mask, cache, sampling.max_new_tokens, engine.eos_token_ids, engine.tokenizer.pad_token_id,
        sampling.temperature, sampling.top_k, sampling.top_p, rng=rng, compact=compact,
    )  # fmt: skip
    return time.perf_counter() - start, tokens, cuts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="a run's checkpoint whose policy samples (default: untrained)")
    parser.add_argument("--rounds", type=int, default=2, help="timings per mode; the best is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("overrides", nargs="*", default=["experiment=learn_arith"], help="config overrides")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from benchmarks.vllm_vs_hf import cpu_name
    from grpo_lightning.accel.generation_levers import merged_lora
    from grpo_lightning.app.train import build_run
    from grpo_lightning.generation.hf_engine import left_pad
    from tests.conftest import make_cfg

    run = build_run(make_cfg(Path(tempfile.mkdtemp()), list(args.overrides)))
    if args.ckpt is not None:
        state = torch.load(args.ckpt, map_location="cpu", weights_only=False)["state_dict"]
        missing, _ = run.module.load_state_dict(state, strict=False)
        trainable = [n for n, p in run.module.named_parameters() if p.requires_grad]
        if any(n in missing for n in trainable):
            raise SystemExit(f"--ckpt: {args.ckpt} lacks the policy's trainable weights (another model?)")
    engine = run.callbacks["rollout_loop"].generator
    datamodule = run.datamodule
    datamodule.setup("fit")
    prompts = [p.prompt_ids for p in datamodule.prompts_for_round(0, engine.tokenizer)]
    g, budget = run.cfg.variant.num_generations, engine.sampling.max_new_tokens
    ids, mask = left_pad(prompts, engine.tokenizer.pad_token_id)
    print(f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"{len(prompts)} prompts x {g} samples x {budget} new tokens, T={engine.sampling.temperature}, "
          f"best of {args.rounds}; policy: {args.ckpt or 'untrained'}")  # fmt: skip
    model = engine.model.eval()
    results = {}
    with merged_lora(model), torch.inference_mode():
        for _ in range(args.rounds):
            for compact in (True, False):
                seconds, tokens, cuts = timed_call(engine, ids, mask, g, compact)
                if compact not in results or seconds < results[compact][0]:
                    results[compact] = (seconds, tokens, cuts)
    (fast, tokens, cuts), (slow, full_tokens, _) = results[True], results[False]
    n, written = tokens.shape[0], int((tokens != engine.tokenizer.pad_token_id).sum())
    print(f"tokens written: {written} (mean {written / n:.1f} a row); the same tokens in both: "
          f"{torch.equal(tokens, full_tokens)}; batch cut to {cuts or 'never'}")  # fmt: skip
    print("| finished rows | steps | s per call | vs kept |")
    print("|---|---|---|---|")
    print(f"| kept to the end | {full_tokens.shape[1]} | {slow:.2f} | 1.00x |")
    print(f"| leave the batch | {tokens.shape[1]} | {fast:.2f} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
