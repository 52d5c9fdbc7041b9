"""The one door to transformers' KV-cache internals: every name the speed layer takes from `transformers.cache_utils`.

They are not a stable public API (the cache classes were rebuilt around per-layer objects in transformers 4.56 and
keep changing), so they are imported here only, the supported range is pinned in pyproject.toml, and
tests/unit/test_hf_internals.py checks that each name exists and behaves as the code below relies on, so an
upgrade fails there first, with a message naming what moved.

* `Cache`: the container of per-layer caches; `Cache(layers=[...])` builds one from our own layers
  (decode_loop.new_cache) and `.layers` lists them (completion_forward gathers the prompt cache per row).
* `DynamicCache`: the model's usual cache, the fallback for models whose layers are not all full attention.
* `DynamicLayer`: one full-attention layer's keys / values. `decode_loop.PreallocatedLayer` subclasses it (its
  `keys`, `values`, `is_initialized`, `dtype`, `device` attributes, `lazy_initialization`, `update`,
  `get_seq_length`, `batch_repeat_interleave`, `batch_select_indices` are what attention and masking read and
  call); completion_forward copies the prompt cache row by row only when every layer is one. So does
  `graph_decode.StaticLayer`, whose decode step also relies on a 4-D attention mask being used as it is
  (tests/unit/test_graph_decode.py compares that step with the eager loop).
* `get_layer_types_and_kwargs(config)`: the model's layer kinds (`full_attention`, `sliding_attention`, ...), so
  the pre-allocated cache is used only where every layer is plain full attention.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, get_layer_types_and_kwargs

__all__ = ["Cache", "DynamicCache", "DynamicLayer", "get_layer_types_and_kwargs"]
