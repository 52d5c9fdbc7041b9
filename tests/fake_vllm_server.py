"""A fake `vllm serve` for the contract tests of generator=vllm_server: the routes the generator calls, on
127.0.0.1, with every request recorded and answers written by hand. The real server's behaviour is held by
tests/test_vllm_server.py (vLLM's CPU build); this one makes faults cheap: a server that restarts (forgets its
weights), never delivers an adapter, answers nothing, dies part-way (`answers_left`), is slow (`delay_s`), or
serves another tokenizer.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMPLETION = [11, 12, 13]
"""Every sample's tokens (no EOS: finish_reason length), each with log-prob -0.5."""


class FakeServer:
    def __init__(self, tokenize, max_model_len: int = 1024, model: str = "/models/tiny", scorer=None) -> None:
        self.tokenize = tokenize
        self.max_model_len = max_model_len
        self.model = model
        self.scorer = scorer
        """prompt token ids -> the log-prob of each token after the first (the weights the server holds); None:
        every log-prob 0 (weights no policy has)."""
        self.requests: list[tuple[str, dict | None]] = []
        self.lock = threading.Lock()
        self.weight_version: str | None = "default"
        self.adapters: list[str] = []
        self.deliver_adapters = True
        self.answer_as: str | None = None
        """Answer completions as this model (an adapter the server still holds)."""
        self.answer_as_left: int | None = None
        """How many completions answer as `answer_as` before the server answers as asked again (None: all)."""
        self.logprobs_mode = "processed_logprobs"
        self.lora_config: dict | None = {"max_lora_rank": 16}
        self.weight_transfer_config: dict | None = {"backend": "grpo_files"}
        self.device = "cpu"
        self.chunked_prefill = False
        """What `/server_info` says of the server's device and scheduler (vLLM's CPU build needs it off)."""
        self.dev_routes = True
        self.api_key: str | None = None
        """Routes under /v1 answer 401 without this bearer token (vLLM's --api-key)."""
        self.updating = False
        """Inside a weight update (between /start_weight_update and /finish_weight_update)."""
        self.answers_left: int | None = None
        """Requests answered before the server dies (every later one: the connection closed, no answer)."""
        self.delay_s = 0.0
        """Seconds each completion takes."""
        self.paused = False
        """Between `/pause?mode=keep` and `/resume`: a completion in progress or arriving waits (vLLM's kept
        requests), then answers."""
        self.metrics_text = "# HELP vllm:num_requests_waiting waiting\n"
        """What `/metrics` answers (Prometheus' text format)."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: `close` (httpd.shutdown) waits up to one poll interval, 0.5 s by default, in every test
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def restart(self) -> None:
        """What a restarted server holds: the model's own weights, no adapters."""
        self.weight_version, self.adapters = "default", []

    def paths(self, method: str = "POST") -> list[str]:
        return [path for path, _ in self.requests if path.startswith(method + " ")]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _answer(self, method: str, path: str, body: dict | None, headers=None):
        self.requests.append((f"{method} {path}", body))
        if path == "/health":
            return {}
        if path == "/metrics":
            return self.metrics_text
        if (
            path.startswith("/v1/")
            and self.api_key
            and (headers or {}).get("Authorization") != f"Bearer {self.api_key}"
        ):
            return 401, {"error": {"message": "Unauthorized"}}
        if path.startswith("/server_info"):
            if not self.dev_routes:
                return 404, {"detail": "Not Found"}
            return {
                "vllm_config": {
                    "model_config": {
                        "model": self.model, "max_model_len": self.max_model_len, "logprobs_mode": self.logprobs_mode,
                    },
                    "lora_config": self.lora_config,
                    "weight_transfer_config": self.weight_transfer_config,
                    "device_config": {"device": self.device},
                    "scheduler_config": {"enable_chunked_prefill": self.chunked_prefill},
                }
            }  # fmt: skip
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return {"success": True, "new_version": body["new_version"]}
        if path == "/start_weight_update":
            if self.updating:
                return 500, {"error": {"message": "Worker failed with error 'start_weight_update called while a weight "
                                       "update is already active. Call finish_weight_update first.'"}}  # fmt: skip
            self.updating = True
            return {"message": "Weight update started"}
        if path == "/v1/models":
            return {
                "data": [{"id": self.model, "max_model_len": self.max_model_len}] + [{"id": a} for a in self.adapters]
            }
        if path == "/tokenize":
            return {"tokens": self.tokenize(body["prompt"])}
        if path == "/weight_info":
            return {"weight_version": self.weight_version}
        if path == "/finish_weight_update":
            self.updating = False
            if body.get("weight_version") is not None:
                self.weight_version = body.get("weight_version")
            return {"message": "Weight update finished"}
        if path in ("/init_weight_transfer_engine", "/update_weights", "/reset_prefix_cache"):
            return {}
        if path == "/pause?mode=keep":
            self.paused = True
            return {"status": "paused"}
        if path == "/resume":
            self.paused = False
            return {"status": "resumed"}
        if path == "/v1/load_lora_adapter":
            if self.deliver_adapters:
                self.adapters.append(body["lora_name"])
            return "Success: LoRA adapter loaded"
        if path == "/v1/unload_lora_adapter":
            if body["lora_name"] in self.adapters:
                self.adapters.remove(body["lora_name"])
            return "Success"
        if path == "/v1/completions":
            if body["model"] not in (self.model, *self.adapters) and self.answer_as is None:
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
            if body.get("prompt_logprobs") is not None:
                ids = body["prompt"]
                scores = self.scorer(ids) if self.scorer is not None else [0.0] * (len(ids) - 1)
                prompt_logprobs = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(ids[1:], scores, strict=True)]
                return {"model": body["model"], "choices": [{"index": 0, "token_ids": [1], "prompt_logprobs":
                        prompt_logprobs, "logprobs": None, "finish_reason": "length"}]}  # fmt: skip
            time.sleep(self.delay_s)
            while self.paused:
                time.sleep(0.005)
            choices = [
                {
                    "index": j,
                    "token_ids": COMPLETION[: body["max_tokens"]],
                    "logprobs": {"token_logprobs": [-0.5] * min(len(COMPLETION), body["max_tokens"])},
                    "finish_reason": "length",
                }
                for j in reversed(range(body["n"]))  # out of order: the generator sorts by index
            ]
            model = self.answer_as or body["model"]
            if self.answer_as_left is not None:
                model = self.answer_as if self.answer_as_left > 0 else body["model"]
                self.answer_as_left -= 1
            return {"model": model, "choices": choices}
        return 404, {"detail": "Not Found"}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with server.lock:
                    dead = server.answers_left is not None and server.answers_left <= 0
                    if server.answers_left is not None:
                        server.answers_left -= 1
                if dead:  # gone: the connection closes with no answer
                    self.close_connection = True
                    return
                answer = server._answer(method, self.path, body, dict(self.headers))
                code, answer = answer if isinstance(answer, tuple) else (200, answer)
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply("GET")

            def do_POST(self) -> None:
                self._reply("POST")

        return Handler
