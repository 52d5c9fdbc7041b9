#!/usr/bin/env bash
# The GPU comparison of the training phase (trainer=gpu, which selects perf=gpu) against TRL's GRPOTrainer, as
# benchmarks/vs_trl.py measures it: random-weight Qwen2.5 shapes, bf16, every completion --max-new tokens long,
# 8 prompts x 8 completions a step, 3 steps (median of steps 2..3), one system per process. In this order, the
# first ones mattering most, each run a vs_trl.py call of its own (a run cut short loses only itself):
#   lora   Qwen2.5-1.5B shape, LoRA r16, 128 new tokens: TRL and ours            -> qwen1.5b_lora.json
#   full   the same, full fine-tuning                                            -> qwen1.5b_full.json
#   liger  the same LoRA work, TRL with use_liger_kernel=True (trl_liger)        -> qwen1.5b_lora_liger.json
#   7b     Qwen2.5-7B shape, LoRA, 1,024 new tokens, ours only (peak GPU memory against the plan's estimate)
#                                                                                -> qwen7b_lora_1024.json
# then one table of lora and liger (vs_trl.py --merge). JSON goes to benchmarks/results/gpu/.
#
# Run from the project's root on a CUDA machine, after the install line that ../shared/tools/gpu-bundle prints
# (its wheels, TRL and liger-kernel among them, and the tokenizer folder .tok):
#   benchmarks/gpu_step.sh [TOKENIZER_DIR]          # default .tok
# Optional environment:
#   GPU_STEP_RUNS="lora full liger 7b"   the runs to do (always in the order above)
#   GPU_STEP_COPY_TO=DIR                 copy each JSON there as soon as it is written, and the output to
#                                        DIR/gpu_step.log
#   PY=python3                           the interpreter
# Expected time on one H100 or H200 (an estimate, not yet timed): 2-4 minutes each for lora, full and liger
# (two, two and one processes, mostly start-up and the first step's CUDA graph capture), 4-6 minutes for 7b
# (a 7B random model built on the CPU, then 3 steps of 64 completions x 1,024 tokens): 12-18 minutes in all.
# A run that fails is reported and the next one still runs; the exit status is 1 if any failed.
set -euo pipefail

TOK=${1:-.tok}
PY=${PY:-python3}
RUNS=${GPU_STEP_RUNS:-lora full liger 7b}
COPY_TO=${GPU_STEP_COPY_TO:-}
R=benchmarks/results/gpu

[ -f benchmarks/vs_trl.py ] || { echo "gpu_step.sh: run it from the project's root" >&2; exit 2; }
[ -d "$TOK" ] || { echo "gpu_step.sh: no tokenizer folder $TOK (../shared/tools/gpu-bundle writes .tok)" >&2; exit 2; }
mkdir -p "$R"
if [ -n "$COPY_TO" ]; then
    mkdir -p "$COPY_TO"
    exec > >(tee -a "$COPY_TO/gpu_step.log") 2>&1
fi

echo "== GPU and versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not available"
"$PY" - <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("gpu_step.sh: torch sees no CUDA device")
print(f"GPU: {torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
for name in ("transformers", "peft", "lightning", "accelerate", "trl", "liger-kernel", "triton", "hydra-core"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name} not installed")
PYEOF

# The work every run shares: the Qwen2.5-1.5B shape's, as in benchmarks/README.md's GPU table.
COMMON=(--gpu --fixed-length --group 8 --prompts 8 --steps 3 --tokenizer-dir "$TOK")
QWEN15=(--model random_qwen1.5b --micro 16 --max-new 128)
failed=()

run() {  # run NAME JSON VS_TRL_ARGS...: one vs_trl.py call, its JSON written afresh
    local name=$1 json=$2
    shift 2
    case " $RUNS " in *" $name "*) ;; *) echo "== $name: skipped (GPU_STEP_RUNS)"; return 0 ;; esac
    rm -f "$R/$json"
    echo "== $name -> $R/$json"
    local start=$SECONDS
    if "$PY" benchmarks/vs_trl.py "${COMMON[@]}" "$@" --json "$R/$json"; then
        echo "== $name: done in $((SECONDS - start)) s"
        if [ -n "$COPY_TO" ]; then cp "$R/$json" "$COPY_TO/"; fi
    else
        echo "== $name: FAILED after $((SECONDS - start)) s"
        failed+=("$name")
    fi
}

run lora qwen1.5b_lora.json "${QWEN15[@]}" --systems trl ours
run full qwen1.5b_full.json "${QWEN15[@]}" --full --systems trl ours
run liger qwen1.5b_lora_liger.json "${QWEN15[@]}" --systems trl_liger
run 7b qwen7b_lora_1024.json --model random_qwen7b --micro 8 --max-new 1024 --systems ours

merged=()
for json in qwen1.5b_lora.json qwen1.5b_lora_liger.json; do
    if [ -f "$R/$json" ]; then merged+=("$R/$json"); fi
done
if [ ${#merged[@]} -gt 0 ]; then
    echo "== Qwen2.5-1.5B shape, LoRA: TRL, TRL with the Liger kernel, ours"
    "$PY" benchmarks/vs_trl.py --merge "${merged[@]}" || failed+=(merge)
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_step.sh: failed: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_step.sh: every run done, JSON in $R/"
