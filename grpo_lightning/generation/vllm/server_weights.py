"""The trainer side of pushing weights into a `vllm serve` server: vLLM's weight-transfer protocol over its HTTP
routes, and a runtime-loaded LoRA adapter. No vLLM import: the training process needs none for a server.

- Full weights (`generator.weight_transfer=files`, the default on a CPU): the four phases of vLLM's protocol
  (`/init_weight_transfer_engine` once, then `/start_weight_update`, `/update_weights` per chunk,
  `/finish_weight_update` with the version), the data plane a safetensors file per chunk that the server's
  `grpo_files` backend (file_transfer.py, registered in vLLM's registry by this package's plugin) loads.
  One chunk exists at a time: written, loaded by the server, deleted; no second full copy of the weights.
- `generator.weight_transfer=nccl` (GPU servers): vLLM's own trainer engine (`WeightTransferTrainerFactory`) drives
  the same routes through `ServerClient`, which has the four methods vLLM's `VLLMWeightSyncClient` protocol asks.
- LoRA (`generator.lora_sync=adapter`): the adapter saved into a folder the server reads, then
  `/v1/load_lora_adapter` under a name that carries the version; the previous version is unloaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from torch import Tensor, nn

from grpo_lightning.generation.vllm.weights import chunked, policy_weights

log = logging.getLogger(__name__)

FILE_BACKEND = "grpo_files"
"""The name of the file backend in vLLM's weight-transfer registry (`--weight-transfer-config`)."""
FILE_CHUNK_BYTES = 256 * 2**20
"""At most this much of the model in one chunk file (one tensor may exceed it alone)."""


class ServerError(RuntimeError):
    """A server answered with an error, or did not answer in time: the message names the URL, `url` holds it, and
    `status` the HTTP status it answered (None: no answer at all)."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.status = status

    @property
    def server_fault(self) -> bool:
        """The server, not the request, failed: no answer (gone, or not within the time limit), or a 5xx (vLLM
        answers 500 once its engine is dead). A 4xx is the request's fault and would recur on every server."""
        return self.status is None or self.status >= 500


INTERRUPTED_UPDATE = "already active"
"""What vLLM answers a `/start_weight_update` while an earlier update was never finished."""


class ServerClient:
    """One server's HTTP routes, each call bounded by `timeout_s` (urllib: no client library needed).

    `api_key` (`generator.api_key`) goes with every request as a bearer token, as vLLM's `--api-key` and
    authenticating proxies expect; it is kept out of `repr` and of every message."""

    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        return f"ServerClient({self.url!r})"

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300].replace("\n", " ")
            raise ServerError(f"{self.url}{path} answered {err.code}: {detail}", self.url, err.code) from None
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(f"{self.url}{path}: no answer ({reason})", self.url) from None
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:  # some routes answer plain text (`/v1/load_lora_adapter`: "Success: ...")
            return text

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self.request("GET", path, timeout_s=timeout_s)

    def post(self, path: str, body: dict | None = None) -> Any:
        return self.request("POST", path, body)

    # vLLM's `VLLMWeightSyncClient` protocol (vllm/distributed/weight_transfer/base.py)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {"weight_version": weight_version})

    def weight_version(self) -> str | None:
        """The version the server's weights were last finished with (`/weight_info`; None: never updated)."""
        return self.get("/weight_info").get("weight_version")


def push_weight_files(
    clients: list[ServerClient], weights: Iterable[tuple[str, Tensor]], folder: Path, version: str, stem: str
) -> int:
    """Push (checkpoint name, tensor) pairs to every server through the file backend, each finished as `version`;
    returns the bytes sent. The policy is gathered once whatever the number of servers: chunk i is written once as
    `<stem>.<i>.safetensors`, loaded by every server, then deleted (also on any error)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sent = 0
    for client in clients:
        client.init_weight_transfer_engine({})  # no rendezvous: cheap, and a restarted server needs it
        start_update(client)
    for index, chunk in enumerate(chunked(weights, FILE_CHUNK_BYTES)):
        path = folder / f"{stem}.{index}.safetensors"
        try:
            tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in chunk}
            save_file(tensors, str(path))
            sent += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
            for client in clients:
                client.update_weights({"path": str(path)})
        finally:
            path.unlink(missing_ok=True)
    for client in clients:
        client.finish_weight_update(version)
    return sent


def start_update(client: ServerClient) -> None:
    """`/start_weight_update`, after finishing an update a killed run left open (vLLM has no route to abort one,
    and refuses a new one meanwhile). Only a run that holds the server's claim pushes, so that update was its own
    earlier process's or an expired claim's; the push that follows rewrites every weight."""
    try:
        client.start_weight_update()
    except ServerError as err:
        if INTERRUPTED_UPDATE not in str(err):
            raise
        log.warning("the vLLM server at %s was inside an interrupted weight update: finishing it", client.url)
        client.finish_weight_update(None)
        client.start_weight_update()


def load_adapter(client: ServerClient, name: str, folder: Path, retired: Iterable[str | None]) -> None:
    """Load the adapter saved in `folder` under `name` (vLLM's runtime LoRA loading), then unload the `retired`
    ones (earlier versions no request uses any more; None: none loaded yet)."""
    client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
    for previous in retired:
        if previous is not None and previous != name:
            with contextlib.suppress(ServerError):  # a restarted server never had it
                client.post("/v1/unload_lora_adapter", {"lora_name": previous})


@contextlib.contextmanager
def requests_kept(clients: list[ServerClient], keep: bool) -> Iterator[None]:
    """With `keep`: every server paused with its requests kept (vLLM's `/pause?mode=keep`: running and waiting
    requests are frozen, their KV cache kept) for what runs inside, then resumed (`/resume`), also when that
    fails. A weight update does not pause a server by itself: its engine would run decode steps between the
    update's chunks, on weights half old and half new. Requests kept across the update continue on KV computed
    with the old weights (as PipelineRL's in-flight updates do; not recomputed). A server that cannot be
    resumed is logged: it failed, and its requests fail with it."""
    paused: list[ServerClient] = []
    try:
        if keep:
            for client in clients:
                client.post("/pause?mode=keep")
                paused.append(client)
        yield
    finally:
        for client in paused:
            try:
                client.post("/resume")
            except ServerError as err:
                log.warning("the vLLM server at %s could not be resumed after a weight update (%s)", client.url, err)


def loaded_models(client: ServerClient) -> list[str]:
    """The model ids the server serves (`/v1/models`): the base model and every loaded adapter."""
    return [entry["id"] for entry in client.get("/v1/models").get("data", [])]


class MergedPolicy(nn.Module):
    """The policy's weights as vLLM checkpoint names, LoRA merged (vLLM's `ModuleSource` reads a module)."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def named_parameters(self, *args, **kwargs):
        yield from policy_weights(self.policy, adapted_only=False)


def push_nccl(client: ServerClient, policy: nn.Module, engines: dict[str, Any]) -> None:
    """Full weights through vLLM's NCCL trainer engine, driven through `client` (vLLM must be installed in the
    trainer's environment); `engines` keeps each server's engine, whose rendezvous is made at its first push."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from grpo_lightning.generation.vllm.engine_io import free_port

    if client.url not in engines:
        workers = int(client.get("/get_world_size")["world_size"])
        host = urlparse(client.url).hostname or "127.0.0.1"
        address = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
        info = NCCLTrainerInitInfo(rank=0, master_address=address, master_port=free_port(), world_size=1 + workers)
        engines[client.url] = WeightTransferTrainerFactory.trainer_init(
            init_info=info, client=client, source=ModuleSource(MergedPolicy(policy))
        )
    engines[client.url].send_weights()
