"""The speed layer: levers that make training and HF generation cheaper, each equal to the plain path up to
float rounding (docs/performance.md). Switched by the `perf` config group (`perf=cpu_fast` | `perf=plain`).

Training forward: `completion_forward` (shared prompt prefixes, runs by length), `chunked_head` (the LM head a
chunk at a time), `entropy_terms` (the entropy probe's terms from the same logits), `fused_lora` (LoRA's update
in place). Generation: `decode_loop` (our sampling loop), `graph_decode` (on CUDA, its decode steps replayed from
CUDA graphs), `generation_levers` (merged LoRA, shared prefill, streamed log-probs), `packed_weights` (MKL-packed
linears), `low_precision` (sampling with bf16 / int8 copies of the linear weights: not exact, off by default).
Between phases: `heap_trim`. transformers internals are reached through `hf_internals` only.
"""

from grpo_lightning.accel.settings import ForwardSettings, GenerationSettings

__all__ = ["ForwardSettings", "GenerationSettings"]
