"""The servers a run samples from, as one pool (`generator=vllm_server`; docs/scaling.md).

- **By load.** Each request goes to the live server with the fewest of this process's requests in flight (ties to
  the one sent fewest so far, then in an order that starts at a different server on each rank), so a slower or
  busier server gets fewer: round-robin would give every server the same share and wait for the slowest.
- **Losing a server.** A server that does not answer, or answers 5xx (vLLM does once its engine has died), is
  dropped from the pool for the rest of the run, and the request goes to another server with the same seed. A
  request's seed derives from (round seed, prefix tokens, how often the prefix was asked this round), never from
  the server, so the round equals the round an intact pool would have sampled. The last server lost stops the run.
- **Load, as the servers see it.** While requests are in flight, a thread reads each live server's Prometheus
  `/metrics` every `generator.metrics_interval_s`: the requests it queues and runs and its KV-cache use (their
  maxima since the last report), its preemptions and its requests' mean time in its queue (counter deltas). The
  rollout loop logs them each round as `server/<i>/...` (i: the server's place in the pool's order, logged at
  start), beside the trainer's idle time (`time/rollout_wait_s`), so a user sees which side waits.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.vllm.server_weights import ServerClient, ServerError

log = logging.getLogger(__name__)

T = TypeVar("T")

GAUGES = {
    "vllm:num_requests_waiting": "requests_waiting_max",
    "vllm:num_requests_running": "requests_running_max",
    "vllm:kv_cache_usage_perc": "kv_cache_usage_max",
}
"""vLLM 0.32's gauges (vllm/v1/metrics/loggers.py) and the name of their maximum over a report's span."""
PREEMPTIONS = "vllm:num_preemptions_total"
QUEUE_SUM, QUEUE_COUNT = "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"
COUNTERS = (PREEMPTIONS, QUEUE_SUM, QUEUE_COUNT)


def parse_metrics(text: str, names: tuple[str, ...] | set[str]) -> dict[str, float]:
    """The Prometheus text format's samples of `names`, summed over their label sets (one per engine core)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if "{" in line:  # name{label="value",...} value [timestamp]
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :].split()
        else:  # name value [timestamp]
            name, *rest = line.split()
        if name not in names or not rest:
            continue
        try:
            values[name] = values.get(name, 0.0) + float(rest[0])
        except ValueError:
            continue
    return values


class ServerPool:
    """A process's view of the run's servers: which are live, and how many of its requests each holds."""

    def __init__(self, clients: list[ServerClient], rank: int = 0) -> None:
        self.clients = list(clients)
        """Every server, in the order logged at start (their index names their metrics)."""
        self._order = [clients[(rank + i) % len(clients)] for i in range(len(clients))]
        self.lost: dict[str, EngineFailed] = {}
        """URL -> why the server was dropped (the run's one line, were it the last)."""
        self._in_flight: Counter[str] = Counter()
        self._sent: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.on_lost: list[Callable[[ServerClient], None]] = []
        """Called with each server dropped (the claims stop renewing it)."""

    @property
    def live(self) -> list[ServerClient]:
        with self._lock:
            return [c for c in self._order if c.url not in self.lost]

    @property
    def busy(self) -> bool:
        with self._lock:
            return sum(self._in_flight.values()) > 0

    def lose(self, client: ServerClient, err: EngineFailed) -> None:
        """Drop `client` for the rest of the run; the last live server lost raises `err`, the run's one line."""
        with self._lock:
            if client.url in self.lost:
                return  # dropped already, by another request's fault
            self.lost[client.url] = err
            left = [c.url for c in self._order if c.url not in self.lost]
        if not left:
            raise err
        log.warning(
            "the vLLM server at %s is dropped from the pool for the rest of the run (%s); sampling goes on with %s",
            client.url,
            err,
            ", ".join(left),
        )
        for callback in self.on_lost:
            callback(client)

    def fault(self, client: ServerClient, err: ServerError, line: EngineFailed) -> None:
        """`err` from `client`: a fault of the server drops it (`lose`: the last one raises `line`); a fault of
        the request (4xx) raises `line`, since every server would refuse it alike."""
        if not err.server_fault:
            raise line from None
        self.lose(client, line)

    def run(
        self, request: Callable[[ServerClient], T], failed: Callable[[ServerClient, ServerError], EngineFailed]
    ) -> T:
        """`request` on the least-loaded live server; a server fault drops that server and tries the next (`fault`,
        with the line `failed(client, err)`)."""
        while True:
            client = self._acquire()
            try:
                return request(client)
            except ServerError as err:
                self.fault(client, err, failed(client, err))
            finally:
                with self._lock:
                    self._in_flight[client.url] -= 1

    def _acquire(self) -> ServerClient:
        with self._lock:
            live = [c for c in self._order if c.url not in self.lost]
            if not live:  # another request lost the last one: its line
                raise next(reversed(self.lost.values()))
            client = min(live, key=lambda c: (self._in_flight[c.url], self._sent[c.url]))  # equals: the rank's order
            self._in_flight[client.url] += 1
            self._sent[client.url] += 1
            return client


class ServerLoad:
    """Each server's load as its `/metrics` reports it, read every `interval_s` while the pool is busy (see the
    module docstring); `report` returns what was seen since the last report and starts the next span."""

    def __init__(self, pool: ServerPool, interval_s: float, timeout_s: float = 5.0) -> None:
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._maxima: dict[int, dict[str, float]] = {}
        self._last: dict[int, dict[str, float]] = {}
        """Each server's counters at the last report (the deltas' start)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            for i in range(len(pool.clients)):
                self._last[i] = self._read(i) or {}
            self._thread = threading.Thread(target=self._poll, name="vllm-server-load", daemon=True)
            self._thread.start()

    def _read(self, i: int) -> dict[str, float] | None:
        client = self.pool.clients[i]
        if client.url in self.pool.lost:
            return None
        try:
            text = client.get("/metrics", timeout_s=self.timeout_s)
        except ServerError:
            return None  # a server that stops answering is the pool's to drop, at its next request
        return parse_metrics(text, {*GAUGES, *COUNTERS}) if isinstance(text, str) else None

    def _observe(self) -> None:
        for i in range(len(self.pool.clients)):
            values = self._read(i)
            if values is not None:
                self._keep_maxima(i, values)

    def _keep_maxima(self, i: int, values: dict[str, float]) -> None:
        with self._lock:
            maxima = self._maxima.setdefault(i, {})
            for gauge, name in GAUGES.items():
                if gauge in values:
                    maxima[name] = max(maxima.get(name, 0.0), values[gauge])

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.pool.busy:
                self._observe()

    def report(self) -> dict[str, float]:
        """`server/<i>/<name>` for every live server: the gauges' maxima and the counters' deltas since the last
        report. Empty when reading is off (`generator.metrics_interval_s: 0`)."""
        if self._thread is None:
            return {}
        out: dict[str, float] = {}
        for i in range(len(self.pool.clients)):
            now = self._read(i)
            if now is None:
                continue
            self._keep_maxima(i, now)  # this reading counts too: at least one a span, however short the round
            with self._lock:
                maxima, self._maxima[i] = self._maxima.get(i, {}), {}
                last, self._last[i] = self._last.get(i, {}), now
            for name in GAUGES.values():
                if name in maxima:
                    out[f"server/{i}/{name}"] = maxima[name]
            # a counter below its last reading started again from 0 (a restarted server): all of it is new
            delta = {key: now[key] - last.get(key, 0.0) if now[key] >= last.get(key, 0.0) else now[key]
                     for key in COUNTERS if key in now}  # fmt: skip
            if PREEMPTIONS in delta:
                out[f"server/{i}/preemptions"] = delta[PREEMPTIONS]
            if delta.get(QUEUE_COUNT, 0.0) > 0 and QUEUE_SUM in delta:
                out[f"server/{i}/queue_s_mean"] = delta[QUEUE_SUM] / delta[QUEUE_COUNT]
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def close(self) -> None:
        self._stop.set()
