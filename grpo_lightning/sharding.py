"""Sharded training (`trainer=fsdp`): PyTorch's FSDP2 (`fully_shard`) through Lightning's ModelParallelStrategy.

Parameters, gradients and optimizer state are sharded over every training process (each holds 1/W of each
tensor, as DTensors); on a CPU it runs over gloo, on GPUs over NCCL. docs/scaling.md says when to use it.

The sharding plan (`shard_module`): each decoder layer (the classes the model lists in `_no_split_modules`) is one
FSDP unit, gathered for its forward and backward and freed after them; the model itself is the root unit (the
embeddings, final norm and LM head, which a tied model shares). A LoRA layer's frozen base weight and trainable
adapter sit in the same unit (FSDP2 allows both in one unit).

Three places read parameters outside a module's own `forward`, and each is made to see full tensors:

- the training forward calls the backbone and the LM head separately (accel/completion_forward.py), so it runs
  as a registered FSDP forward method of the root (`call_as_forward`): the root's parameters are gathered around
  it and its gradients reduce-scattered after the backward, as for `forward`;
- sampling (the HF engine decodes from the policy itself) gathers every unit once for the whole round and keeps
  it gathered (`gathered_for_sampling`): ranks decode different numbers of steps, so a per-layer gather inside
  each step would leave one rank waiting at a collective the other never enters;
- weights pushed to an inference engine are gathered one decoder layer at a time (`gathered_in_pieces`), so a
  push never holds a second full copy of the weights.

Outside sampling every call of the backbone gathers each decoder layer (and its backward reduce-scatters them), so
every process must call it as often as the others. The training and scoring forwards run it once per micro-batch
(`ForwardSettings.one_backbone_call`, set by the training module when it shards): the CPU's runs by length and
shared prompts call it a number of times that depends on the rows, which differ between processes (self-play's
turns), and the processes would wait at different collectives.

Checkpoints hold the trainable parameters only, gathered one tensor at a time into one file on rank 0, and are
restored before the rollout loop samples the resumed round (`FullyShardedStrategy`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, OptimStateKeyType, fully_shard, register_fsdp_forward_method
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

T = TypeVar("T")

FORWARD_METHOD = "grpo_sharded_call"
"""The root's registered FSDP forward method (`call_as_forward`)."""


class FullyShardedStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy as plain FSDP2: one data-parallel dimension over every process (Lightning's
    default would make the processes of a node a tensor-parallel group), and checkpoints as one file of full
    tensors (`save_distributed_checkpoint=False`), in the layout a DDP checkpoint has (optimizer state keyed by
    parameter index)."""

    def __init__(self, process_group_backend: str | None = None, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            **kwargs,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore before `on_fit_start`, as every other strategy does: the rollout loop samples the resumed round
        there, from the restored weights. `configure_model` has sharded the policy by then; the optimizer, which
        exists only after setup, is restored by Lightning later (`load_optimizer_state_dict`)."""
        return False

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The whole checkpoint file, on every process (it holds the trainable tensors only)."""
        return Strategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Each process keeps its shard of every full tensor in the checkpoint."""
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_model_state_dict(self.lightning_module, checkpoint["state_dict"], options=options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The optimizer state saved as full tensors keyed by parameter index (as `optimizer_state` writes it, and
        as a DDP checkpoint holds it), sharded like the parameters."""
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if state["state"] and isinstance(next(iter(state["state"])), int):
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, self.model)
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable parameters as full tensors on rank 0 (empty elsewhere), gathered one tensor at a time:
        the frozen base (most of a LoRA model) is never gathered, since checkpoints do not hold it."""
        return full_state_dict(self.lightning_module, trainable_only=True)


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def shard_module(module: nn.Module, mesh) -> None:
    """Shard `module` in place over `mesh` (a 1-D device mesh): decoder layers as units, the module as the root."""
    layer_classes = set(_decoder_layer_classes(module))
    for sub in module.modules():
        if sub is not module and type(sub).__name__ in layer_classes:
            fully_shard(sub, mesh=mesh, reshard_after_forward=True)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)  # FSDP2's own choice for a root: kept for backward
    setattr(module, FORWARD_METHOD, types.MethodType(_call, module))
    register_fsdp_forward_method(module, FORWARD_METHOD)


def _call(self: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return fn(*args, **kwargs)


def _decoder_layer_classes(module: nn.Module) -> list[str]:
    """The class names of the model's decoder layers (transformers' `_no_split_modules`), through a peft wrapper."""
    for sub in module.modules():
        names = getattr(sub, "_no_split_modules", None)
        if names:
            return list(names)
    return []


def call_as_forward(module: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, run as a forward of `module` when it is sharded (its root parameters gathered
    around it, its gradients reduce-scattered after the backward); a plain call otherwise."""
    if is_sharded(module):
        return getattr(module, FORWARD_METHOD)(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def _units(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_sampling(module: nn.Module) -> Iterator[None]:
    """Every unit of a sharded `module` gathered for the block, none freed by a forward inside it (no collective
    runs inside, so ranks may call the module different numbers of times); a no-op for a module not sharded."""
    if not is_sharded(module):
        yield
        return
    units = _units(module)
    for unit in units:
        unit.unshard()
    module.set_reshard_after_forward(False)
    try:
        yield
    finally:
        module.set_reshard_after_forward(True)  # back to `shard_module`'s plan: layers freed after forward,
        module.set_reshard_after_forward(False, recurse=False)  # the root kept
        for unit in units:
            unit.reshard()


def gathered_in_pieces(module: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """`module.named_parameters()` in pieces: one decoder-layer unit's parameters at a time, gathered while the
    caller reads them and freed when it asks for the next piece (copy what must outlive the piece), then the
    root's (embeddings, final norm, head: gathered throughout). Every process must iterate to the end: each
    gather is a collective. A module that is not sharded is one piece, its own parameters."""
    if not is_sharded(module):
        yield list(module.named_parameters())
        return
    layers = [(name + ".", m) for name, m in module.named_modules() if isinstance(m, FSDPModule) and m is not module]
    pieces: dict[str, list[str]] = {prefix: [] for prefix, _ in layers} | {"": []}
    for name, _ in module.named_parameters():
        pieces[next((prefix for prefix, _ in layers if name.startswith(prefix)), "")].append(name)
    module.unshard()
    try:
        for prefix, unit in layers:
            unit.unshard()
            try:  # the module's parameters are the gathered ones now (FSDP2 swaps them in)
                yield [(name, module.get_parameter(name)) for name in pieces[prefix]]
            finally:
                unit.reshard()
        yield [(name, module.get_parameter(name)) for name in pieces[""]]
    finally:
        module.reshard()


def full_tensor(t: Tensor) -> Tensor:
    """A DTensor's full value (a collective: every process calls it, in the same order); a plain tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(module: nn.Module, trainable_only: bool = False, keep: bool | None = None) -> dict[str, Tensor]:
    """`module.state_dict()` as full CPU tensors, gathered one tensor at a time, kept on rank 0 (`keep=None`) or
    on the processes that pass `keep=True` (each process takes part in every gather; one that keeps nothing
    gets {}). `trainable_only`: the parameters that train, no buffers. A tensor shared by two names (a
    tied LM head) is gathered once and appears under both."""
    if keep is None:
        keep = dist.get_rank() == 0 if dist.is_initialized() else True
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    state: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if trainable_only and id(tensor) not in trainable:
            continue
        if id(tensor) not in gathered:
            full = full_tensor(tensor.detach())
            gathered[id(tensor)] = full.cpu() if keep else None  # None: taken part in the gather, nothing kept
        if keep:
            state[name] = gathered[id(tensor)]
    return state


def save_policy(policy: nn.Module, directory: str | Path, write: bool = True) -> None:
    """`policy.save_pretrained(directory)`: a peft adapter folder with LoRA, a whole model folder otherwise.

    A sharded policy (trainer=fsdp) is gathered first, one tensor at a time: every process calls this together,
    and those with `write=False` only take part in the gathers. Where only some parameters train (LoRA), only
    those are gathered: an adapter folder holds nothing else."""
    if not is_sharded(policy):
        if write:
            policy.save_pretrained(str(directory))
        return
    some_frozen = any(not p.requires_grad for p in policy.parameters())
    state = full_state_dict(policy, trainable_only=some_frozen, keep=write)
    if write:
        policy.save_pretrained(str(directory), state_dict=state)


def sharded_norm(tensors: list[DTensor]) -> float:
    """L2 norm of FSDP-sharded `tensors` together (inf/nan when any entry is): the local shards' squared norms,
    summed over the processes in one all-reduce (each element of a Shard(0) DTensor lives on exactly one
    process), so every process gets the same value."""
    local = [t.to_local() for t in tensors]
    squares = torch.stack([torch.linalg.vector_norm(t.float()).double() ** 2 for t in local]).sum()
    dist.all_reduce(squares, group=tensors[0].device_mesh.get_group())
    return float(squares.sqrt())
