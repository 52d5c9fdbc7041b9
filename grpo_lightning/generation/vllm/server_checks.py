"""What a `vllm serve` server must be before a run trains on its samples (generator=vllm_server; docs/scaling.md).

Each check is one line naming the URL and what differs, a ValueError (exit 2: the user must change the server or
the config), raised before any round is sampled:

- at construction (`check_server`): the server answers; it runs with the dev routes (`/server_info`,
  `VLLM_SERVER_DEV_MODE=1`); its tokenizer encodes a probe text as the policy's does; its `max_model_len` holds
  the longest prompt the data allows (`data.max_prompt_tokens`) plus `generator.max_new_tokens`; it reports
  processed log-probs (`--logprobs-mode processed_logprobs`: raw ones would be compared with the trainer's
  log-probs after temperature); it serves the policy's architecture and shapes (its model config); LoRA is on with
  a rank at least the policy's (adapter sync), or a weight-transfer backend is configured, the one the trainer
  pushes with (full sync). vLLM 0.32's `GET /server_info?config_format=json` answers most of it in one call.
- after the first push (`check_weights`): the server's log-probs of a fixed text (its prompt log-probs, which
  vLLM computes from the raw logits whatever the log-prob mode) equal the trainer's within
  `generator.logp_diff_threshold` (mean absolute difference over the text's tokens). This is the check that
  catches a server with the policy's tokenizer and architecture but other weights: another checkpoint, or a base
  an earlier full-sync run replaced, under an adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_lightning.generation.vllm.server_weights import ServerClient, ServerError

TOKENIZER_PROBE = "Natalia sold clips to 48 of her friends in April. 7 x 8 = 56 <|im_end|>"
"""A text both tokenizers must encode alike (the start-up check against another model's server)."""
WEIGHTS_PROBE = (
    "Question: A baker makes 24 rolls and sells 3 bags of 5 rolls each. How many rolls are left?\n"
    "Answer: 3 bags of 5 rolls are 15 rolls, and 24 - 15 = 9. #### 9"
)
"""The text whose log-probs the server and the trainer must agree on after the first push."""
SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "tie_word_embeddings",
)  # fmt: skip
"""The model config values that make two checkpoints' weights interchangeable (the server's against the policy's)."""


@dataclass(frozen=True)
class ServerNeeds:
    """What this run needs of every server."""

    max_prompt_tokens: int
    max_new_tokens: int
    sync: str
    """'adapter' (a LoRA adapter loaded at runtime) or 'full' (weights pushed through weight transfer)."""
    lora_rank: int = 0
    transfer_backend: str | None = None
    model_config: dict[str, Any] | None = None
    """The policy's model config (`config.to_dict()`), whose `SHAPE_KEYS` the server's must equal."""


def server_info(client: ServerClient) -> dict[str, Any]:
    """The server's `vllm_config` (`/server_info?config_format=json`): a ValueError when it is not served."""
    try:
        info = client.get("/server_info?config_format=json")
    except ServerError as err:
        if " answered 404" in str(err):
            raise ValueError(
                f"generator.urls: the vLLM server at {client.url} has no /server_info route: start it with "
                "VLLM_SERVER_DEV_MODE=1 (the weight-transfer and version routes a run uses need it too)"
            ) from None
        raise unanswered(client, err) from None
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"generator.urls: the vLLM server at {client.url} answered /server_info without a config")
    return config


def unanswered(client: ServerClient, err: ServerError) -> ValueError:
    """The one line for a server that refuses or does not answer a start-up request."""
    if " answered 401" in str(err):
        return ValueError(
            f"generator.urls: the vLLM server at {client.url} refused the request (401 Unauthorized): it needs an "
            "API key; set VLLM_API_KEY (generator.api_key reads it) to the server's --api-key"
        )
    return ValueError(f"generator.urls: the vLLM server at {client.url} does not answer ({err})")


def check_server(client: ServerClient, tokenizer, needs: ServerNeeds, model_path: str) -> str:
    """The id of the model the server serves, after every check above but the weights' (one line each)."""
    try:
        models = client.get("/v1/models").get("data", [])
    except ServerError as err:
        raise unanswered(client, err) from None
    if not models:
        raise ValueError(f"generator.urls: the vLLM server at {client.url} serves no model")
    served = models[0]
    config = server_info(client)
    model = config.get("model_config") or {}
    check_length(client, model.get("max_model_len", served.get("max_model_len")), needs)
    mode = model.get("logprobs_mode")
    if mode is not None and mode != "processed_logprobs":
        raise ValueError(
            f"the vLLM server at {client.url} reports {mode} log-probs, but the trainer compares log-probs after "
            "temperature: start it with --logprobs-mode processed_logprobs"
        )
    check_sync(client, config, needs)
    check_seeded_sampling(client, config)
    check_architecture(client, served["id"], model, needs)
    try:
        body = {"model": served["id"], "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        theirs = client.post("/tokenize", body)
    except ServerError as err:
        raise unanswered(client, err) from None
    ours = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if list(theirs.get("tokens", [])) != list(ours):
        raise ValueError(
            f"the vLLM server at {client.url} serves {served['id']!r}, whose tokenizer differs from the policy's "
            f"({model_path}): serve the policy's model, or set generator.urls to a server that does"
        )
    return served["id"]


def check_length(client: ServerClient, max_len: Any, needs: ServerNeeds) -> None:
    need = needs.max_prompt_tokens + needs.max_new_tokens
    if isinstance(max_len, int) and max_len < need:
        raise ValueError(
            f"the vLLM server at {client.url} has max_model_len {max_len}, below the longest prompt "
            f"(data.max_prompt_tokens={needs.max_prompt_tokens}) plus generator.max_new_tokens="
            f"{needs.max_new_tokens} = {need}: serve it with --max-model-len {need} or more, or lower those keys"
        )


def check_seeded_sampling(client: ServerClient, config: dict[str, Any]) -> None:
    """Every request of a run is seeded, and vLLM 0.32's CPU build stops its engine when a seeded request's prompt
    is split across scheduler steps (chunked prefill): its worker rewinds the request's random generator
    (`set_offset`), which a CPU generator does not have ("CPU Generator does not use offset"). So a CPU server must
    run without chunked prefill; servers the run starts do (server_process.launch_args)."""
    device = (config.get("device_config") or {}).get("device")
    chunked = (config.get("scheduler_config") or {}).get("enable_chunked_prefill")
    if device is not None and "cpu" in str(device) and chunked is True:
        raise ValueError(
            f"the vLLM server at {client.url} runs on a CPU with chunked prefill on, where vLLM's CPU build stops "
            "its engine once a seeded request's prompt is split across steps (every request of a run is seeded): "
            "start it with --no-enable-chunked-prefill"
        )


def check_sync(client: ServerClient, config: dict[str, Any], needs: ServerNeeds) -> None:
    """LoRA slots for adapter sync, the trainer's weight-transfer backend for full sync."""
    if needs.sync == "adapter":
        lora = config.get("lora_config")
        if not isinstance(lora, dict):
            raise ValueError(
                f"the vLLM server at {client.url} runs without LoRA, which generator.lora_sync=adapter loads at "
                f"runtime: start it with --enable-lora --max-lora-rank {needs.lora_rank} (and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), or push merged weights with generator.lora_sync=merge"
            )
        rank = lora.get("max_lora_rank")
        if isinstance(rank, int) and rank < needs.lora_rank:
            raise ValueError(
                f"the vLLM server at {client.url} has --max-lora-rank {rank}, below the policy's LoRA rank "
                f"(model.lora.r, served in a slot of {needs.lora_rank}): start it with --max-lora-rank "
                f"{needs.lora_rank} or more, or lower model.lora.r"
            )
        return
    transfer = config.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    if backend is None:
        raise ValueError(
            f"the vLLM server at {client.url} has no weight-transfer backend, which full weight pushes need: start "
            f"it with --weight-transfer-config '{json.dumps({'backend': needs.transfer_backend})}', or load "
            "adapters with generator.lora_sync=adapter (a LoRA policy)"
        )
    if needs.transfer_backend is not None and backend != needs.transfer_backend:
        raise ValueError(
            f"the vLLM server at {client.url} takes weights through the {backend!r} backend, but the trainer "
            f"pushes through {needs.transfer_backend!r} (generator.weight_transfer): set "
            f"generator.weight_transfer={backend} or restart the server with the trainer's backend"
        )


def check_architecture(client: ServerClient, served: str, model: dict[str, Any], needs: ServerNeeds) -> None:
    """The server's model config against the policy's, key by key (`SHAPE_KEYS`): a server of another architecture
    with the same tokenizer would take a push only to fail it half-way. `/server_info` names the folder the server
    loaded (`model_config.model`); its `config.json` is read where this machine sees that folder (a server on
    this machine, or a shared file system). Elsewhere the weight probe after the first push is the check."""
    ours = needs.model_config
    theirs = served_config(model)
    if not ours or not theirs:
        return
    ours, theirs = text_config(ours), text_config(theirs)
    differs = [
        f"{key} {theirs[key]} (policy: {ours[key]})"
        for key in SHAPE_KEYS
        if key in ours and key in theirs and ours[key] != theirs[key]
    ]
    if differs:
        raise ValueError(
            f"the vLLM server at {client.url} serves {served!r}, another architecture than the policy's: "
            f"{', '.join(differs)}; serve the policy's model"
        )


def served_config(model: dict[str, Any]) -> dict[str, Any] | None:
    """The served model's `config.json` where this machine can read it, else None."""
    folder = model.get("model")
    if not isinstance(folder, str):
        return None
    path = Path(folder).expanduser() / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model part (its `text_config`), else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def probe_ids(tokenizer) -> list[int]:
    return list(tokenizer(WEIGHTS_PROBE, add_special_tokens=False)["input_ids"])


def server_probe_logprobs(client: ServerClient, model: str, ids: list[int]) -> list[float]:
    """The server's log-prob of each probe token after the first (its prompt log-probs, from the raw logits)."""
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0, "seed": 0}
    answer = client.post("/v1/completions", body)
    scores = answer["choices"][0].get("prompt_logprobs") or []
    out = []
    for position, token in enumerate(ids[1:], start=1):
        entry = scores[position] if position < len(scores) else None
        value = (entry or {}).get(str(token)) or (entry or {}).get(token)
        if value is None:
            raise ServerError(f"{client.url}/v1/completions gave no prompt log-prob for token {position}")
        out.append(float(value["logprob"] if isinstance(value, dict) else value))
    return out


@torch.no_grad()
def trainer_probe_logprobs(policy: nn.Module, ids: list[int]) -> torch.Tensor:
    """The policy's log-prob of each probe token after the first, in float32, dropout off.

    Every training process runs it (a sharded policy's forward is collective), whatever it compares."""
    was_training = policy.training
    policy.eval()
    try:
        device = next(policy.parameters()).device
        tokens = torch.tensor([ids], device=device)  # (1, T)
        logits = policy(input_ids=tokens).logits[0, :-1].float()  # (T-1, V)
        return torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None])[:, 0].cpu()  # (T-1,)
    finally:
        policy.train(was_training)


def check_weights(client: ServerClient, model: str, ids: list[int], ours: torch.Tensor, tolerance: float) -> float:
    """The mean |server - trainer| log-prob over the probe, or a ValueError naming the URL above `tolerance`."""
    try:
        theirs = torch.tensor(server_probe_logprobs(client, model, ids))
    except ServerError as err:
        raise ValueError(f"the vLLM server at {client.url} could not score the weight probe ({err})") from None
    diff = float((theirs - ours).abs().mean())
    if not diff <= tolerance:
        raise ValueError(
            f"the vLLM server at {client.url} serves other weights than the policy's: its log-probs of a probe text "
            f"differ from the trainer's by {diff:.3g} on average (generator.logp_diff_threshold={tolerance:g}); "
            "serve the policy's model, or restart the server if another run's push replaced its weights"
        )
    return diff
