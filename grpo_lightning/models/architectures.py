"""Published model architectures, for speed and memory measurement without a download.

A model built from its architecture's config with random weights runs exactly the kernels the trained model runs
(same layers, widths, heads and vocabulary: the output projection is a large share of a small model's cost), so
its tokens/s, step time and peak memory are the real model's. The numbers below are those of each model's
config.json on the Hugging Face Hub (Qwen2.5 technical report, Qwen Team 2024); the Instruct and base models share
them. `HubSource.config` also falls back to them when a Hub config cannot be read (a login node without network),
so a GPU recipe's dry run still prints its memory estimate.
"""

from __future__ import annotations

QWEN2_COMMON = {
    "model_type": "qwen2",
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
}
ARCHITECTURES: dict[str, dict] = {
    "Qwen/Qwen2.5-0.5B-Instruct": QWEN2_COMMON | {
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-1.5B-Instruct": QWEN2_COMMON | {
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-3B-Instruct": QWEN2_COMMON | {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen/Qwen2.5-7B-Instruct": QWEN2_COMMON | {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
}  # fmt: skip
ARCHITECTURES |= {name.removesuffix("-Instruct"): shape for name, shape in list(ARCHITECTURES.items())}


def known_config(name: str):
    """The transformers config of a known architecture (`ARCHITECTURES`), or None."""
    from transformers import AutoConfig

    shape = ARCHITECTURES.get(name)
    if shape is None:
        return None
    shape = dict(shape)
    return AutoConfig.for_model(shape.pop("model_type"), **shape)
