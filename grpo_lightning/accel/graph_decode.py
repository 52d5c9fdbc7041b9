"""Decode steps on fixed-shape buffers, replayed from CUDA graphs on a GPU (`perf.generate.cuda_graphs`).

Why: on a GPU the HF engine's decode step is bound by launching kernels, not by the GPU. A step of a Qwen2-style
model launches about forty kernels per layer (norms, projections, rotary embedding, attention, MLP) plus the head,
each costing the host a few microseconds, so a 0.5B model's step takes the host longer than the GPU. A CUDA
graph records one step's kernels once and replays them with one launch (the technique vLLM and TensorRT-LLM use
for decoding). On an H200 at the Qwen2.5-0.5B shape a step of 16 rows took about 23 ms eagerly and 5 ms replayed
(benchmarks/README.md, "Against TRL on a GPU").

What a graph needs is a step whose every tensor has a fixed shape and address. `StaticBatch` is that step:

* the KV cache is the pre-allocated `[B, H, capacity, D]` buffers of `decode_loop.PreallocatedLayer`, adopted
  after the prefill without a copy; a step writes its column with `index_copy_` at a position held in a device
  tensor (`write_at`), and attention reads the whole buffer;
* the attention mask is a `[B, 1, 1, capacity]` boolean buffer (True: the row attends to that column): the
  prompt's columns (left padding excluded), then each decode step's column, set inside the step. Columns not yet
  written are masked out, so attention over the whole capacity equals attention over the filled part (the masked
  columns get exactly zero weight);
* token ids and positions are `[B, 1]` buffers copied in before each step; the logits come out in a buffer.

`StaticSteps` runs a generate call: the prefill (or the last prompt token) eagerly through the cache, then every
decode step through a `StaticBatch`, captured into a CUDA graph on its first step (`capture=True`) or run eagerly
(`capture=False`: the same computation on any device, which is how the CPU tests check it against the eager
loop). Sampling stays outside the graph, in the decode loop, so the random stream is the eager path's and so are
the tokens; the log-probs differ from the eager path's by float rounding only (attention sums over more, masked,
columns).

Finished rows leave the batch as in the eager loop: the kept rows are gathered to the front of the buffers. When
they fit a batch half the size or less, they move to a new, smaller `StaticBatch` (powers of two), captured once,
so a step costs what its rows cost. Graphs live for one generate call: the weights a call samples with (LoRA
merged into temporary tensors, low-precision copies, parameters an optimizer step has changed in place) are the
ones its graphs were captured on, so nothing goes stale between rounds.

What is not served falls back to the eager loop, logged once per reason: a model whose layers are not all plain
full attention (no pre-allocated cache), and a capture that fails (an operation that syncs with the host, say).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from grpo_lightning.accel.decode_loop import EagerSteps, PreallocatedLayer
from grpo_lightning.accel.hf_internals import Cache, DynamicLayer

log = logging.getLogger(__name__)
_logged: set[str] = set()
_warmup_streams: dict[torch.device, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream per CUDA device that every capture's warm-up step runs on, made on first use.

    Why one: cuBLAS keeps a workspace for each stream it has run on (32 MiB on Hopper), cached by PyTorch for the
    life of the process. A new stream per capture would keep a new workspace per capture, until PyTorch's pool of
    32 streams a device came round again: on an H200, 6 x 32 MiB for each decode call of the tiny test model, up to
    1 GiB, and 0.19 GiB more allocated at the end of the embedded model's two-round bf16 run than with the eager
    decode (tests/test_gpu.py measures that later calls keep nothing).
    Sharing the stream between threads is safe: each warm-up orders itself after its own current stream, and its
    current stream after it (`StaticBatch._capture`).
    """
    if device not in _warmup_streams:
        _warmup_streams[device] = torch.cuda.Stream(device=device)
    return _warmup_streams[device]


def log_fallback_once(reason: str) -> None:
    """One warning per reason per process: a round samples many times, the reason does not change."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("perf.generate.cuda_graphs: decoding eagerly: %s", reason)


def bucket(rows: int) -> int:
    """The batch size a `StaticBatch` is built for: the next power of two (graphs are captured per size)."""
    return 1 << max(0, rows - 1).bit_length()


class StaticLayer(DynamicLayer):
    """One layer's KV cache as fixed buffers: `update` writes the step's column at `write_at` and returns the whole
    buffers (`[B, H, capacity, D]`); the attention mask hides the columns not written yet."""

    def __init__(self, keys: Tensor, values: Tensor, write_at: Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.write_at = keys, values, write_at
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.keys.index_copy_(2, self.write_at, key_states)  # [B, H, 1, D] into column write_at
        self.values.index_copy_(2, self.write_at, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[2]


class StaticBatch:
    """One decode step over fixed buffers for `B` rows (module docstring); `capture=True` replays it from a CUDA
    graph captured on the first step."""

    def __init__(
        self,
        model: nn.Module,
        keys: list[Tensor],  # per layer [B, H, capacity, D]
        values: list[Tensor],
        mask: Tensor,  # [B, capacity] bool: the columns each row attends to so far
        capture: bool,
    ) -> None:
        self.model = model
        rows, device = mask.shape[0], mask.device
        self.write_at = torch.zeros(1, dtype=torch.long, device=device)  # the column this step writes
        self.cache = Cache(layers=[StaticLayer(k, v, self.write_at) for k, v in zip(keys, values, strict=True)])
        self.mask = mask[:, None, None, :].clone()  # [B, 1, 1, capacity]
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [B, 1]
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [B, 1]
        self.capture = capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # [B, V]: the captured step's output buffer

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def keys_values(self) -> tuple[list[Tensor], list[Tensor]]:
        return [layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers]

    def _forward(self) -> Tensor:  # -> [B, V] in the model's dtype
        self.mask.index_fill_(3, self.write_at, True)  # the column this step writes is attended to, by every row
        out = self.model(
            input_ids=self.ids,
            attention_mask=self.mask,  # 4-D: HF uses it as it is
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _capture(self) -> None:
        """One warm-up step on a side stream (lazy initialisations happen outside the capture; it writes the same
        column with the same values the replay writes), then the step captured."""
        side = warmup_stream(self.ids.device)
        side.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(side):
            self._forward()
        torch.cuda.current_stream(self.ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer thread using the GPU meanwhile (sampling beside training) does not break it
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._forward()
        self.graph = graph

    def step(self, ids: Tensor, positions: Tensor, column: int) -> Tensor:  # [b, 1], [b, 1] -> [b, V]
        """Write column `column` for the first b rows and return their next-token logits (a view that the next
        step overwrites). Rows b.. are stale or padding: they compute, and nothing reads them."""
        b = ids.shape[0]
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.write_at.fill_(column)
        if not self.capture:
            return self._forward()[:b]
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits[:b]

    def gather(self, keep: Tensor) -> None:  # [b'] indices of the rows that stay
        """The kept rows to the front of every buffer, in place (the batch keeps its size and its graph)."""
        n = keep.shape[0]
        for layer in self.cache.layers:
            layer.keys[:n] = layer.keys[keep]
            layer.values[:n] = layer.values[keep]
        self.mask[:n] = self.mask[keep]


def smaller_batch(batch: StaticBatch, keep: Tensor, rows: int, capture: bool) -> StaticBatch:
    """A `StaticBatch` of `rows` rows holding the kept rows of `batch` (then padding rows that attend to column 0
    only, so their softmax is defined)."""
    n = keep.shape[0]

    def take(buffer: Tensor) -> Tensor:
        out = buffer.new_zeros(rows, *buffer.shape[1:])
        out[:n] = buffer[keep]
        return out

    keys, values = batch.keys_values()
    mask = take(batch.mask[:, 0, 0])  # [rows, capacity]
    mask[n:, 0] = True
    return StaticBatch(batch.model, [take(k) for k in keys], [take(v) for v in values], mask, capture)


class StaticSteps(EagerSteps):
    """A generate call's steps: the first one eager (the prefill, or the prompt's last token after a shared
    prefill), the decode steps through `StaticBatch`es (module docstring)."""

    def __init__(
        self, model: nn.Module, cache: Cache, attention_mask: Tensor, max_new_tokens: int, capture: bool
    ) -> None:
        super().__init__(model, cache, attention_mask, max_new_tokens)
        self.capture = capture
        self.batch: StaticBatch | None = None
        self.static = all(isinstance(layer, PreallocatedLayer) for layer in cache.layers) and bool(cache.layers)
        if not self.static:
            log_fallback_once("the model's layers are not all plain full attention (no pre-allocated KV cache)")

    def logits(self, ids: Tensor, positions: Tensor) -> Tensor:  # [B, S], [B, S] -> [B, V]
        if not self.static or ids.shape[1] != 1 or not self.cache.layers[0].is_initialized:  # the first step
            return super().logits(ids, positions)
        column = self.length
        if self.batch is None:
            self.batch = self._adopt()
        try:
            logits = self.batch.step(ids, positions, column)
        except RuntimeError as err:  # a capture that fails: this call and later ones decode eagerly
            if not self.batch.capture:
                raise
            log_fallback_once(f"capturing the decode step failed ({type(err).__name__}: {str(err)[:200]})")
            self._give_back(ids.shape[0])
            return super().logits(ids, positions)
        self.length = column + 1
        return logits

    def _adopt(self) -> StaticBatch:
        """A `StaticBatch` over the eager cache's own buffers (no copy), with its mask so far. The batch becomes
        their one owner: the eager cache lets go of them, so a smaller batch frees them (`_give_back` returns
        whatever buffers the batch then holds)."""
        layers = self.cache.layers
        capacity = layers[0].key_buffer.shape[2]
        mask = torch.zeros(self.mask.shape[0], capacity, dtype=torch.bool, device=self.mask.device)  # [B, cap]
        mask[:, : self.length] = self.mask[:, : self.length].bool()
        keys = [layer.key_buffer for layer in layers]
        values = [layer.value_buffer for layer in layers]
        for layer in layers:
            layer.key_buffer = layer.value_buffer = layer.keys = layer.values = None
        return StaticBatch(self.model, keys, values, mask, self.capture and self.mask.is_cuda)

    def _give_back(self, rows: int) -> None:
        """Back to the eager loop: the static batch's rows into the eager cache (the first `rows` are live)."""
        keys, values = self.batch.keys_values()
        for layer, k, v in zip(self.cache.layers, keys, values, strict=True):
            layer.key_buffer, layer.value_buffer = k[:rows], v[:rows]
            layer.length = self.length
            layer._refresh_views()
        self.static, self.batch = False, None

    def keep(self, rows: Tensor) -> None:  # [b'] indices of the rows that stay
        if self.batch is None:
            super().keep(rows)
            return
        self.mask = self.mask[rows]  # the eager view of the mask, in case a later capture fails
        size = bucket(rows.shape[0])
        if size < self.batch.rows:
            self.batch = smaller_batch(self.batch, rows, size, self.batch.capture)
        else:
            self.batch.gather(rows)
