"""The transformers internals the speed layer relies on (accel/hf_internals.py) exist and behave as it expects.

A transformers release that moves or reshapes them fails here first, with a message naming what changed, before
the decode loop or the shared-prefix forward fails somewhere deeper.
"""

import inspect

import torch
import transformers
from transformers import LlamaConfig

from grpo_lightning.accel import hf_internals
from grpo_lightning.accel.decode_loop import PreallocatedLayer, new_cache

UPGRADE = f"transformers {transformers.__version__}: see grpo_lightning/accel/hf_internals.py and pyproject.toml"


def test_the_shim_exports_what_the_speed_layer_imports():
    for name in hf_internals.__all__:
        assert hasattr(hf_internals, name), f"{UPGRADE}: transformers.cache_utils.{name} is gone"


def test_dynamic_layer_has_what_the_preallocated_layer_overrides_and_reads():
    layer = hf_internals.DynamicLayer()
    for attribute in ("keys", "values", "is_initialized"):
        assert hasattr(layer, attribute), f"{UPGRADE}: DynamicLayer has no {attribute!r}"
    methods = ("lazy_initialization", "update", "get_seq_length", "batch_repeat_interleave", "batch_select_indices")
    for method in methods:
        assert callable(getattr(layer, method, None)), f"{UPGRADE}: DynamicLayer has no method {method!r}"
    params = list(inspect.signature(hf_internals.DynamicLayer.update).parameters)
    assert params[1:3] == ["key_states", "value_states"], f"{UPGRADE}: DynamicLayer.update takes {params}"


def test_a_cache_of_our_layers_reads_like_a_dynamic_cache():
    keys, values = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    ours = hf_internals.Cache(layers=[PreallocatedLayer(capacity=8)])
    theirs = hf_internals.DynamicCache()
    for cache in (ours, theirs):
        cache.update(keys, values, 0)
        cache.update(keys[:, :, :1], values[:, :, :1], 0)
    assert ours.get_seq_length() == theirs.get_seq_length() == 5, UPGRADE
    assert torch.equal(ours.layers[0].keys, theirs.layers[0].keys), UPGRADE
    assert isinstance(ours.layers[0], hf_internals.DynamicLayer)


def test_layer_types_decide_the_preallocated_cache():
    config = LlamaConfig(num_hidden_layers=3)
    types, _ = hf_internals.get_layer_types_and_kwargs(config)
    assert list(types) == ["full_attention"] * 3, f"{UPGRADE}: get_layer_types_and_kwargs gave {types}"
    model = type("Model", (), {"config": config})()
    assert all(isinstance(layer, PreallocatedLayer) for layer in new_cache(model, 16).layers), UPGRADE
