"""The inference side of a weight-transfer backend for vLLM's own registry that runs on any device vLLM runs on:
each update chunk is a safetensors file in a folder the trainer and the server both see.

vLLM 0.32's built-in backends move weights between GPUs (NCCL, CUDA IPC); a CPU server has none. This backend
keeps vLLM's protocol (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`) and its layerwise reload (the checkpoint-format path the IPC backend takes, which on the
CPU build also repacks each layer for its GEMM kernels); only the data plane is a file per chunk. The trainer side
(server_weights.py) writes one chunk at a time and deletes it once `/update_weights` has answered, so neither
side holds a second full copy of the model.

vLLM loads this module in each of its processes through the `vllm.general_plugins` entry point of this package
(pyproject.toml): a server started with `--weight-transfer-config '{"backend": "grpo_files"}'` finds the backend in
its registry. Nothing else of the server changes. This module imports vLLM; the training process never imports it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_lightning.generation.vllm.server_weights import FILE_BACKEND
from grpo_lightning.generation.vllm.weights import repack_tied_weights


@dataclass
class FileTransferInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the folder is named in each update."""


@dataclass
class FileTransferUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file of (checkpoint name -> tensor) pairs, one chunk of the update."""


class FileWeightTransferEngine(WeightTransferEngine[FileTransferInitInfo, FileTransferUpdateInfo]):
    """Loads each chunk's file into the model inside vLLM's layerwise reload (as the IPC backend does)."""

    init_info_cls = FileTransferInitInfo
    update_info_cls = FileTransferUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FileTransferInitInfo) -> None:
        """No rendezvous."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, without its device synchronize: loading from a file is synchronous, and on the CPU
        there is no accelerator to synchronize."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FileTransferUpdateInfo) -> None:
        from safetensors import safe_open

        with safe_open(update_info.path, framework="pt", device="cpu") as chunk:
            weights = [(name, chunk.get_tensor(name).to(self.device)) for name in chunk.keys()]  # noqa: SIM118
        self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_weights(self.model)

    def shutdown(self) -> None:
        """Nothing held between updates."""


def register() -> None:
    """The `vllm.general_plugins` entry point: add the backend to vLLM's registry (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already (the plugin loader may run twice in a process)
        WeightTransferEngineFactory.register_engine(FILE_BACKEND, FileWeightTransferEngine)
