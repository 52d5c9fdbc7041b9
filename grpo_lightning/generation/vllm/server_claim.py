"""One run per server: a claim the run writes into the server's weight version and renews (docs/scaling.md).

vLLM keeps no registry of its clients, but every server holds one free-form string, its weight version
(`/weight_info`; set by `/update_weight_version`, and by `/finish_weight_update` at the end of a full push). A run
keeps its claim there:

    grpo-lightning/<claim>/<pushes>/<unix time>/<host>:<pid>:<run dir>

`<claim>` is a random nonce drawn by the run's first process when it starts (shared with the others at the first
push), so two runs never share one, across hosts or in one folder; `<pushes>` is the run's weight version; the time
is when the claim was last renewed: at every push, and by the first process every `claim_ttl_s / 3` seconds
between pushes. At start the first process reads each server's version:

- another run's claim renewed within `generator.claim_ttl_s`: refused in one line naming the server and that run;
- a claim of this run's folder on this host (a run resumed after it was killed), an expired claim, or anything
  else (vLLM's "default", another tool's version): taken. The claim is written, and read back after a random delay
  (0.5 to 1.5 s), so of two runs that start together, one sees the other's claim and is refused.

During the run, the version a server reports before and after every request must carry this run's claim: one that
does not means another writer changed the server's weights or claimed it, and nothing sampled there is trained on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.vllm.server_weights import ServerClient, ServerError

log = logging.getLogger(__name__)

PREFIX = "grpo-lightning"
LAUNCHER_RANKS = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")
RESTARTED = "default"
"""The weight version of a server that was never given weights (vLLM's initial value): one restarted since."""


def first_process() -> bool:
    """Whether this is the run's first training process, the one that claims, asked before torch.distributed
    starts: every launcher's rank variable is 0 or unset (Lightning's own children, torchrun and SLURM set them)."""
    return all(os.environ.get(key, "0") == "0" for key in LAUNCHER_RANKS)


@dataclass(frozen=True)
class Claim:
    """A parsed weight version: this package's claim, or None for anything else."""

    nonce: str
    pushes: int
    renewed: float
    owner: str
    """`<host>:<pid>:<run dir>` of the run that wrote it."""

    def render(self) -> str:
        return f"{PREFIX}/{self.nonce}/{self.pushes}/{self.renewed:.1f}/{self.owner}"

    @property
    def host_and_folder(self) -> tuple[str, str]:
        host, _, rest = self.owner.partition(":")
        return host, rest.partition(":")[2]


def parse(version: str | None) -> Claim | None:
    if not version or not version.startswith(PREFIX + "/"):
        return None
    parts = version.split("/", 4)
    if len(parts) != 5:
        return None
    try:
        return Claim(parts[1], int(parts[2]), float(parts[3]), parts[4])
    except ValueError:
        return None


def new_nonce() -> str:
    return secrets.token_hex(6)


def owner_of(run_dir: str) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{run_dir}"


def foreign_claim(
    found: Claim | None, nonce: str, run_dir: str, ttl_s: float, now: float | None = None
) -> Claim | None:
    """The claim that keeps this run off a server, or None: another run's, renewed within `ttl_s`, from another
    folder or host (a claim of this run's folder on this host is this run's, resumed after a kill: the folder's
    lock, checkpointing.RunLock, keeps two live runs out of one folder)."""
    if found is None or found.nonce == nonce:
        return None
    now = time.time() if now is None else now
    if now - found.renewed > ttl_s:
        return None
    if found.host_and_folder == (socket.gethostname(), run_dir):
        return None
    return found


def in_use_message(url: str, found: Claim, ttl_s: float, now: float | None = None) -> str:
    host, folder = found.host_and_folder
    age = (time.time() if now is None else now) - found.renewed
    return (
        f"generator.urls: the vLLM server at {url} is in use by another run ({folder} on {host}, its claim renewed "
        f"{max(age, 0):.0f} s ago): a push of this run would replace the weights that run samples from; use another "
        f"server, or wait until that run ends (a claim not renewed for generator.claim_ttl_s={ttl_s:g} s is taken over)"
    )


def settle_delay() -> float:
    """The random wait between writing a claim and reading it back (two runs that start together)."""
    return random.uniform(0.5, 1.5)


class RunClaims:
    """This run's claims on its servers: taken at start by the first process (`take`), renewed on a thread while
    the run lasts, checked before and after every request (`check`), released when the run ends (`release`).
    `lock`: the generator's, held by pushes, so a renewal never interleaves with one."""

    def __init__(self, clients: list[ServerClient], run_dir: str, ttl_s: float, lock: threading.Lock) -> None:
        self.clients = clients
        self.run_dir = run_dir
        self.ttl_s = ttl_s
        self.lock = lock
        self.nonce = new_nonce()
        """Drawn by every process; the first process's is the run's (the generator shares it at the first push)."""
        self.owner = owner_of(run_dir)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def render(self, pushes: int, renewed: float | None = None) -> str:
        return Claim(self.nonce, pushes, time.time() if renewed is None else renewed, self.owner).render()

    def take(self) -> None:
        """Refuse a server another live run claims, claim the others, read the claims back after a random delay
        (two runs that start together), then renew them; a refusal leaves no claim of this run behind."""
        try:
            for client in self.clients:
                other = foreign_claim(parse(self._read(client)), self.nonce, self.run_dir, self.ttl_s)
                if other is not None:
                    raise ValueError(in_use_message(client.url, other, self.ttl_s))
                self._write(client, self.render(0))
            time.sleep(settle_delay())
            for client in self.clients:
                found = parse(self._read(client))
                if found is None or found.nonce != self.nonce:
                    who = found.owner if found else "a version of another writer"
                    raise ValueError(
                        f"generator.urls: the vLLM server at {client.url} was claimed by another run starting at the "
                        f"same time ({who}): use another server"
                    )
        except ValueError:
            self._give_back()
            raise
        self._renewer = threading.Thread(target=self._renew, name="vllm-server-claim", daemon=True)
        self._renewer.start()

    def check(self, client: ServerClient, version: str | None, restarted_ok: bool = False) -> Claim | None:
        """`version` (the server's, just read) parsed and checked to be this run's: another writer's stops the
        run. vLLM's "default" is a server restarted since it was claimed: None where `restarted_ok` (it is given
        the weights before it samples), else it stops the run too (what it sampled may come from the model's own
        weights)."""
        if version == RESTARTED:
            if restarted_ok:
                return None
            raise EngineFailed(
                f"generator: the vLLM server at {client.url} restarted while it sampled (its weight version is "
                f"{version!r}): nothing sampled there is trained on; a resumed run gives it the weights"
            )
        found = parse(version)
        if found is None or found.nonce != self.nonce:
            raise EngineFailed(
                f"generator: the weights of the vLLM server at {client.url} were changed by another writer during "
                f"this run (its weight version is now {version!r}): nothing sampled there is trained on; give each "
                "run servers of its own",
                resumable=False,
            )
        return found

    def read(self, client: ServerClient, restarted_ok: bool = False) -> Claim | None:
        """The server's version, read now (a `ServerError` when it does not answer) and checked (`check`)."""
        return self.check(client, client.weight_version(), restarted_ok)

    def forget(self, client: ServerClient) -> None:
        """A server the run no longer uses (dropped from its pool): neither renewed nor released."""
        with self.lock:
            self.clients = [c for c in self.clients if c.url != client.url]

    def release(self) -> None:
        """The run is over: renewals stop, and each server that still carries the claim gets it back expired
        (time 0), so the next run takes it at once. The weights stay as they are."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer = None
            self._give_back()

    def _give_back(self) -> None:
        for client in self.clients:
            with contextlib.suppress(ServerError):
                found = parse(client.weight_version())
                if found is not None and found.nonce == self.nonce:
                    client.post("/update_weight_version", {"new_version": self.render(found.pushes, renewed=0.0)})

    def _renew(self) -> None:
        """Every ttl_s / 3: the claim renewed on every server that still carries it (one that does not is left
        alone: the next sample or push stops the run)."""
        while not self._stop.wait(self.ttl_s / 3):
            for client in self.clients:
                with self.lock:
                    try:
                        found = parse(client.weight_version())
                        if found is not None and found.nonce == self.nonce:
                            client.post("/update_weight_version", {"new_version": self.render(found.pushes)})
                    except ServerError as err:
                        log.warning("could not renew the claim on the vLLM server at %s (%s)", client.url, err)

    @staticmethod
    def _read(client: ServerClient) -> str | None:
        try:
            return client.weight_version()
        except ServerError as err:
            raise ValueError(f"generator.urls: the vLLM server at {client.url} does not answer ({err})") from None

    @staticmethod
    def _write(client: ServerClient, version: str) -> None:
        try:
            client.post("/update_weight_version", {"new_version": version})
        except ServerError as err:
            raise ValueError(
                f"generator.urls: the vLLM server at {client.url} refused /update_weight_version ({err})"
            ) from None
