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
QWEN2_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)
"""What differs between the Qwen2.5 sizes: the columns of the table below."""
ARCHITECTURES: dict[str, dict] = {
    name: QWEN2_COMMON | dict(zip(QWEN2_SIZES, size, strict=True))
    for name, size in {
        # hidden, intermediate, layers, attention heads, key/value heads, vocabulary, tied embeddings
        "Qwen/Qwen2.5-0.5B-Instruct": (896, 4864, 24, 14, 2, 151936, True),
        "Qwen/Qwen2.5-1.5B-Instruct": (1536, 8960, 28, 12, 2, 151936, True),
        "Qwen/Qwen2.5-3B-Instruct": (2048, 11008, 36, 16, 2, 151936, True),
        "Qwen/Qwen2.5-7B-Instruct": (3584, 18944, 28, 28, 4, 152064, False),
    }.items()
}
ARCHITECTURES |= {name.removesuffix("-Instruct"): shape for name, shape in list(ARCHITECTURES.items())}


def known_config(name: str):
    """The transformers config of a known architecture (`ARCHITECTURES`), or None."""
    from transformers import AutoConfig

    shape = ARCHITECTURES.get(name)
    if shape is None:
        return None
    shape = dict(shape)
    return AutoConfig.for_model(shape.pop("model_type"), **shape)
