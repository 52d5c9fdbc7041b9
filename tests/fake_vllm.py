"""A fake vLLM backend for the contract tests: the engine's calls recorded, its answers computed by hand.

The fake engine model is written by hand from vLLM's Llama layout (q/k/v fused into `qkv_proj`, gate/up into
`gate_up_proj`, tied embeddings without an `lm_head`), and its `load_weights` writes HF-named tensors into
hand-computed slices of the fused parameters, as vLLM's stacked loaders do. A module of its own so that an engine
process (generation/vllm/engine_process.py) can build the fake from a pickled `FakeBackend`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

# The tiny model (conftest `tiny_model`): hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 2 layers, tied embeddings.
HIDDEN, KV, MLP, LAYERS = 64, 32, 128, 2
# HF name -> (vLLM parameter, first row, last row + 1): q rows 0..64, k 64..96, v 96..128; gate 0..128, up 128..256.
FUSED_ROWS = {
    "q_proj": ("qkv_proj", 0, HIDDEN),
    "k_proj": ("qkv_proj", HIDDEN, HIDDEN + KV),
    "v_proj": ("qkv_proj", HIDDEN + KV, HIDDEN + 2 * KV),
    "gate_proj": ("gate_up_proj", 0, MLP),
    "up_proj": ("gate_up_proj", MLP, 2 * MLP),
}


def vllm_llama_shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """vLLM's LlamaForCausalLM parameters for the tiny model, listed by hand."""
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.qkv_proj.weight": (HIDDEN + 2 * KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_up_proj.weight": (2 * MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


# ---- the fake engine -----------------------------------------------------------------------------------------
class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeEngineModel:
    """Stands for the model inside a vLLM worker: named parameters and a stacking `load_weights`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], log: list) -> None:
        self.params = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        self.log = log

    def named_parameters(self):
        return iter(self.params.items())

    def modules(self):  # no tied layers to repack (vLLM's CPU build after a reload)
        return iter(())

    def load_weights(self, weights) -> None:
        names = []
        for name, tensor in weights:
            parts = name.split(".")
            fused = next((p for p in parts if p in FUSED_ROWS), None)
            if fused is None:
                self.params[name].copy_(tensor)  # KeyError for a name vLLM does not have
            else:
                target, start, stop = FUSED_ROWS[fused]
                self.params[name.replace(fused, target)][start:stop].copy_(tensor)
            names.append(name)
        self.log.append(("load_weights", names))


@dataclass
class FakeLLM:
    """Records every call in `log`; `generate` answers from `responder(prompt_ids, kwargs) -> [(ids, lps, reason)]`."""

    shapes: dict
    log: list
    responder: object
    kwargs: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = FakeEngineModel(self.shapes, self.log)

    def apply_model(self, fn):
        self.log.append(("apply_model",))
        return [fn(self.model)]

    def collective_rpc(self, method, kwargs=None):
        """vLLM's CPU build: the worker's `reload_weights` (layerwise reload of checkpoint-format weights)."""
        assert method == "reload_weights" and kwargs["is_checkpoint_format"], (method, kwargs)
        self.log.append(("reload_weights",))
        return [self.model.load_weights(kwargs["weights_iterator"])]

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.log.append(("generate", prompts, params, lora_request))
        pairs = zip(prompts, params, strict=True)
        return [request_output(self.responder(p["prompt_token_ids"], sp.kwargs)) for p, sp in pairs]

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", list(tags)))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


def request_output(samples):
    outputs = [
        SimpleNamespace(
            index=j,
            token_ids=ids,
            logprobs=[{t: SimpleNamespace(logprob=lp, rank=1)} for t, lp in zip(ids, lps, strict=True)],
            finish_reason=reason,
        )
        for j, (ids, lps, reason) in reversed(list(enumerate(samples)))  # out of order: the parser sorts
    ]
    return SimpleNamespace(outputs=outputs)


def counting_responder(prompt_ids, kwargs):
    """Sample j of a prompt: max_tokens ids counting up from last prompt id + 10 * (j + 1); log-probs -0.1 * (t + 1)."""
    first = prompt_ids[-1]
    return [
        (
            [first + 10 * (j + 1) + t for t in range(kwargs["max_tokens"])],
            [-0.1 * (t + 1) for t in range(kwargs["max_tokens"])],
            "length",
        )
        for j in range(kwargs["n"])
    ]


class FakeBackend:
    def __init__(self, vocab: int, responder=counting_responder) -> None:
        self.log: list = []
        self.engines: list[FakeLLM] = []
        self.shapes = vllm_llama_shapes(vocab)
        self.responder = responder
        self.SamplingParams = FakeSamplingParams
        self.LoRARequest = FakeLoRARequest
        self.platform = "cuda"  # what import_vllm reports; the CPU tests set "cpu"

    def LLM(self, **kwargs):  # noqa: N802 (stands for the class vllm.LLM)
        engine = FakeLLM(self.shapes, self.log, self.responder, kwargs, env=dict(os.environ))
        self.engines.append(engine)
        return engine

    def calls(self, *names):
        return [c for c in self.log if c[0] in names]
