"""generator=vllm_server against a fake `vllm serve` (tests/fake_vllm_server.py): the protocol it speaks, the
versions it records, and each fault as one line naming the URL or key within a bounded time. The real server:
tests/test_vllm_server.py (vLLM tier)."""

from __future__ import annotations

import copy
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.vllm import server_claim as claims
from grpo_lightning.generation.vllm.server import VLLMServerGenerator
from grpo_lightning.generation.vllm.server_checks import trainer_probe_logprobs
from grpo_lightning.generation.vllm.server_process import ServerLaunch, start_servers
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from tests.fake_vllm_server import COMPLETION, FakeServer


@pytest.fixture(autouse=True)
def no_settle_delay(monkeypatch):
    """The claim's read-back waits 0.5-1.5 s against runs that start together (tests/unit/test_vllm_server_trust.py)."""
    monkeypatch.setattr(claims, "settle_delay", lambda: 0.0)


def scorer_of(model):
    """A fake server's prompt log-probs: those of `model` (the weights it holds)."""
    return lambda ids: trainer_probe_logprobs(model, ids).tolist()


@pytest.fixture
def servers(tokenizer, tiny_model):
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    made = [FakeServer(encode, scorer=scorer_of(tiny_model)) for _ in range(2)]
    yield made
    for server in made:
        server.close()


@pytest.fixture
def lora_policy(tiny_model):
    policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4), needs_reference=False)
    return policy


def generator(policy, tokenizer, servers, tmp_path, **keys) -> VLLMServerGenerator:
    keys = {
        "urls": [s.url for s in servers],
        "model_path": "/models/tiny",
        "transfer_dir": str(tmp_path / "transfer"),
        "request_timeout_s": 5,
        "max_new_tokens": 8,
    } | keys
    return VLLMServerGenerator(policy, tokenizer, **keys)


def test_requests_are_spread_over_the_servers_and_seeded_per_prefix(tmp_path, tiny_model, tokenizer, servers):
    gen = generator(tiny_model, tokenizer, servers, tmp_path)
    gen.reseed(7)
    prefixes = [[1, 2, 3], [4, 5], [1, 2, 3], [6]]
    out = gen.generate(prefixes, num_samples=2)
    assert [[c.token_ids for c in group] for group in out] == [[COMPLETION] * 2] * 4
    assert all(c.logprobs == [-0.5] * 3 and not c.finished for group in out for c in group)
    bodies = [body for server in servers for path, body in server.requests if path == "POST /v1/completions"]
    assert len(bodies) == 4 and all(servers[i].paths().count("POST /v1/completions") >= 1 for i in (0, 1))
    seeds = {tuple(b["prompt"]): [] for b in bodies}
    for body in bodies:
        seeds[tuple(body["prompt"])].append(body["seed"])
        assert body["logprobs"] == 0 and body["return_token_ids"] and body["n"] == 2
    assert len(set(seeds[(1, 2, 3)])) == 2  # the same prefix twice in a round: two streams
    # the same round on a fresh generator asks the same seeds: they depend on (round, prefix), not on the server
    again = generator(tiny_model, tokenizer, servers[::-1], tmp_path)
    again.reseed(7)
    again.generate(prefixes, num_samples=2)
    later = [body["seed"] for server in servers for path, body in server.requests if path == "POST /v1/completions"]
    assert sorted(later[:4] + later[4:]) == sorted([b["seed"] for b in bodies] * 2)


def test_a_full_push_runs_the_four_phases_and_a_restarted_server_gets_the_weights_first(
    tmp_path, tiny_model, tokenizer, servers
):
    gen = generator(tiny_model, tokenizer, servers[:1], tmp_path)
    gen.sync_weights(tiny_model)
    server = servers[0]
    phases = [p for p in server.paths() if "weight" in p and p != "POST /update_weight_version"]  # not the claim
    assert phases == [
        "POST /init_weight_transfer_engine", "POST /start_weight_update", "POST /update_weights",
        "POST /finish_weight_update",
    ]  # fmt: skip
    assert (claims.parse(server.weight_version).nonce, claims.parse(server.weight_version).pushes) == (gen.run_id, 1)
    assert not list((tmp_path / "transfer" / "weights").iterdir())  # each chunk deleted once loaded
    (completion,) = gen.generate([[1, 2]], num_samples=1)[0]
    assert completion.weight_version == 1
    server.restart()
    server.requests.clear()
    gen.generate([[1, 2]], num_samples=1)
    paths = server.paths()
    assert paths.index("POST /finish_weight_update") < paths.index("POST /v1/completions")
    assert claims.parse(server.weight_version).pushes == 1


def test_an_adapter_is_loaded_under_its_version_and_an_undelivered_one_is_refused(
    tmp_path, lora_policy, tokenizer, servers
):
    gen = generator(lora_policy, tokenizer, servers[:1], tmp_path, lora_sync="adapter")
    server = servers[0]
    gen.sync_weights(lora_policy)
    gen.sync_weights(lora_policy)
    assert server.adapters == [f"policy-{gen.run_id}-v2"]  # v1 unloaded once v2 was in
    (completion,) = gen.generate([[1, 2]], num_samples=1)[0]
    assert completion.weight_version == 2
    # an adapter the server accepts but never serves: it answers with the version it still holds
    server.answer_as = f"policy-{gen.run_id}-v1"
    gen.sync_weights(lora_policy)
    server.deliver_adapters = False
    server.adapters = [server.answer_as]
    with pytest.raises(ValueError, match=r"sampled with weights of version 1 while the trainer is at 3, older than "
                       r"rollout.max_staleness=0 allows \(served model .*\), twice"):  # fmt: skip
        gen.generate([[1, 2]], num_samples=1)


def test_a_stale_answer_is_dropped_counted_and_asked_again_with_the_same_seed(
    tmp_path, lora_policy, tokenizer, servers
):
    """A server that answers once from weights older than the bound allows (an adapter not yet in use there):
    its samples are never returned; the same request, same seed, is asked again and answered by the current
    adapter; `rollout/dropped_stale` counts the dropped samples."""
    gen = generator(lora_policy, tokenizer, servers[:1], tmp_path, lora_sync="adapter")
    server = servers[0]
    for _ in range(2):
        gen.sync_weights(lora_policy)
    gen.reseed(9)
    gen.engine_metrics()
    server.requests.clear()
    server.answer_as, server.answer_as_left = f"policy-{gen.run_id}-v1", 1
    (group,) = gen.generate([[1, 2]], num_samples=3)
    assert [c.weight_version for c in group] == [2, 2, 2]
    asked = [b for p, b in server.requests if p == "POST /v1/completions"]
    assert len(asked) == 2 and asked[0]["seed"] == asked[1]["seed"] and asked[1]["model"].endswith("-v2")
    assert gen.engine_metrics()["rollout/dropped_stale"] == 3.0


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        ("unreachable", "does not answer"),
        ("tokenizer", "whose tokenizer differs from the policy's"),
        (
            "max_model_len",
            "has max_model_len 4, below the longest prompt (data.max_prompt_tokens=512) plus "
            "generator.max_new_tokens=8 = 520",
        ),
    ],
)
def test_a_server_that_cannot_serve_the_run_is_refused_in_one_line(
    tmp_path, tiny_model, tokenizer, servers, fault, words
):
    server = servers[0]
    if fault == "unreachable":
        server.close()
    elif fault == "tokenizer":
        server.tokenize = lambda text: [1, 2, 3]
    else:
        server.max_model_len = 4
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        generator(tiny_model, tokenizer, [server], tmp_path)
    assert words in str(err.value) and server.url in str(err.value) and "\n" not in str(err.value)
    assert time.monotonic() - start < 10


def test_a_server_killed_mid_round_stops_the_run_naming_it(tmp_path, tiny_model, tokenizer, servers):
    gen = generator(tiny_model, tokenizer, servers[:1], tmp_path)
    servers[0].close()
    with pytest.raises(EngineFailed, match=f"the vLLM server at {servers[0].url}.*resume once it answers again") as err:
        gen.generate([[1, 2]], num_samples=1)
    assert err.value.resumable and "\n" not in str(err.value)


@pytest.mark.slow  # starts processes
def test_a_started_server_that_exits_or_never_gets_ready_is_a_bounded_error(tmp_path):
    exits = ServerLaunch(model="x", args=[], python=sys.executable, module="tests.no_such_module")  # exit 1
    with pytest.raises(ValueError, match="exited with code 1 before it was ready; its log: .*vllm_server0.log"):
        start_servers([exits], tmp_path, timeout_s=60)
    root = str(Path(__file__).resolve().parents[2])
    hangs = ServerLaunch("x", [], {"PYTHONPATH": root}, python=sys.executable, module="tests.never_ready_server")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"was not ready within generator.startup_timeout_s=2 s"):
        start_servers([hangs], tmp_path, timeout_s=2)
    assert time.monotonic() - start < 20


def test_the_server_requests_carry_the_sampling_settings(tmp_path, tiny_model, tokenizer, servers):
    gen = generator(tiny_model, tokenizer, servers[:1], tmp_path, temperature=0.9, top_p=0.8, top_k=5)
    gen.generate([[3]], num_samples=2, max_new_tokens=2)
    gen.generate([[3]], num_samples=1, greedy=True)
    sampled, greedy = (body for path, body in servers[0].requests if path == "POST /v1/completions")
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["max_tokens"]) == (0.9, 0.8, 5, 2)
    assert greedy["temperature"] == 0.0 and greedy["n"] == 1
    assert set(sampled["stop_token_ids"]) == set(gen.eos_token_ids)


def test_requests_are_salted_by_version_and_a_round_beside_training_never_pushes(
    tmp_path, tiny_model, tokenizer, servers
):
    """Each request's `cache_salt` names the run and the weights' version, so no prefix-cache block computed under
    other weights serves it. An overlapped round samples in a worker thread while the policy trains: a server that
    lost the weights there stops the run (resumable) rather than being pushed weights half way through a step."""
    gen = generator(tiny_model, tokenizer, servers[:1], tmp_path)
    snapshot = gen.background_copy()
    for _ in range(2):
        snapshot.sync_weights(tiny_model)  # as a round starts training: the push, in the trainer's thread
        snapshot.generate([[3]], num_samples=1)
    sampled = [b for p, b in servers[0].requests if p == "POST /v1/completions" and "prompt_logprobs" not in b]
    assert [body["cache_salt"] for body in sampled] == [f"{gen.run_id}-v1", f"{gen.run_id}-v2"]
    trainable = {n for n, p in tiny_model.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert snapshot.weights().keys() == trainable  # what a checkpoint keeps of the pushed snapshot
    servers[0].restart()
    servers[0].requests.clear()
    raised: list[BaseException] = []

    def beside_training() -> None:
        try:
            snapshot.generate([[3]], num_samples=1)
        except BaseException as err:  # noqa: BLE001 - the worker's error, checked below
            raised.append(err)

    worker = threading.Thread(target=beside_training)
    worker.start()
    worker.join(30)
    assert len(raised) == 1 and isinstance(raised[0], EngineFailed), raised
    assert "lost weights version 2 during the round" in str(raised[0])
    assert not [p for p in servers[0].paths() if "weight_update" in p]  # nothing pushed from the worker


def sample_beside(snapshot, prefix: list[int]) -> tuple[threading.Thread, list]:
    """`snapshot` samples `prefix` in a worker thread, as an overlapped round does; its completions or error go
    into the list once the thread ends."""
    out: list = []

    def work() -> None:
        try:
            out.extend(snapshot.generate([prefix], num_samples=1)[0])
        except BaseException as err:  # noqa: BLE001 - checked by the test
            out.append(err)

    worker = threading.Thread(target=work)
    worker.start()
    return worker, out


def test_a_full_push_in_flight_pauses_the_servers_with_their_requests_kept(tmp_path, tiny_model, tokenizer, servers):
    """`generator.push_in_flight`: a push while a round is sampled runs inside `/pause?mode=keep` ... `/resume`
    (an update does not pause a server by itself). A request in flight across it records both versions; one sent
    after it samples, and is salted, with the new one; the round's metrics count both."""
    gen = generator(tiny_model, tokenizer, servers[:1], tmp_path, push_in_flight=True, max_staleness=1)
    server = servers[0]
    snapshot = gen.background_copy()
    snapshot.sync_weights(tiny_model)  # as the round being trained starts: version 1, servers not paused
    gen.reseed(5)
    server.requests.clear()
    server.delay_s = 0.5
    worker, spanning = sample_beside(snapshot, [3])
    while "POST /v1/completions" not in server.paths():
        time.sleep(0.01)
    assert snapshot.push_in_flight(tiny_model)  # after an optimizer step, on the trainer's thread: version 2
    worker.join(10)
    server.delay_s = 0.0
    (after,) = snapshot.generate([[3]], num_samples=1)[0]
    assert (spanning[0].weight_version, spanning[0].last_weight_version) == (1, 2)
    assert (after.weight_version, after.last_weight_version) == (2, 2)
    paths = server.paths()
    assert paths.index("POST /pause?mode=keep") < paths.index("POST /start_weight_update")
    assert paths.index("POST /finish_weight_update") < paths.index("POST /resume")
    assert "POST /reset_prefix_cache" not in paths  # kept requests hold blocks: the salt keeps versions apart
    salts = [b["cache_salt"] for p, b in server.requests if p == "POST /v1/completions"]
    assert salts == [f"{gen.run_id}-v1", f"{gen.run_id}-v2"]
    metrics = gen.engine_metrics()
    assert (metrics["rollout/pushes_in_flight"], metrics["rollout/spanning_push_frac"]) == (1.0, 0.5)
    assert claims.parse(server.weight_version).pushes == 2 and not server.paused


def test_an_adapter_pushed_in_flight_leaves_the_rounds_adapter_loaded(tmp_path, lora_policy, tokenizer, servers):
    """An adapter is one version start to end (a request names it): the new one is loaded beside it, and the
    replaced ones are unloaded at the next push between rounds, when no request can use them."""
    gen = generator(lora_policy, tokenizer, servers[:1], tmp_path, lora_sync="adapter", push_in_flight=True,
                    max_staleness=1)  # fmt: skip
    server = servers[0]
    snapshot = gen.background_copy()
    snapshot.sync_weights(lora_policy)
    server.requests.clear()  # the push's own weights probe is a /v1/completions too: wait for the worker's
    server.delay_s = 0.5
    worker, spanning = sample_beside(snapshot, [3])
    while "POST /v1/completions" not in server.paths():
        time.sleep(0.01)
    snapshot.push_in_flight(lora_policy)
    assert server.adapters == [f"policy-{gen.run_id}-v1", f"policy-{gen.run_id}-v2"]
    worker.join(10)
    assert (spanning[0].weight_version, spanning[0].last_weight_version) == (1, 1)
    assert "POST /pause?mode=keep" not in server.paths()
    server.delay_s = 0.0
    snapshot.sync_weights(lora_policy)  # the next round starts training: nothing samples the old ones
    assert server.adapters == [f"policy-{gen.run_id}-v3"]
    # an unloaded adapter's folder goes with it (a long run would otherwise fill the transfer folder)
    assert [f.name for f in (tmp_path / "transfer" / "adapters").iterdir()] == [f"policy-{gen.run_id}-v3"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["generator.push_in_flight=true"], "generator.push_in_flight=true pushes the weights while the next round"),
        (["trainer=ddp", "trainer.num_nodes=2", "trainer.devices=1"], "processes of the other nodes cannot find"),
        (["generator.num_servers=2", 'generator.server_devices=["4"]'], "generator.server_devices lists 1 device"),
        (["generator.urls=[10.0.0.5:8000]"], "generator.urls: '10.0.0.5:8000' is not an http:// or https:// URL"),
        (["generator.urls=[]"], "generator.urls is empty"),
        (["generator.weight_transfer=ipc"], "generator.weight_transfer must be one of auto, grpo_files, nccl"),
        (["generator.concurrency=0"], "generator.concurrency must be >= 1"),
        (['generator.server_cpus=["0","1"]'], "generator.server_cpus lists 2 CPU lists for generator.num_servers=1"),
        (['generator.server_cpus=["1-0"]'], "generator.server_cpus must be a list of CPU lists"),
        (["generator.server_cpus=[0.5]"], "generator.server_cpus must be a list of CPU lists"),
        (["generator.server_cpus=[4096]"], "generator.server_cpus: 4096 names a core this machine lacks"),
        (["generator.server_cpus=[0]", "generator.urls=[http://127.0.0.1:8000]"], "bind those where they start"),
        (["generator.server_cpus=[0]", 'generator.server_devices=["0"]'], "set one of them"),
    ],
)
def test_the_config_check_names_the_key_before_anything_starts(tmp_path, overrides, words):
    from grpo_lightning.app.validation import validate
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, ["generator=vllm_server", *overrides])
    with pytest.raises(ValueError) as err:
        validate(cfg, platform=False)  # this machine's vLLM is checked apart (check_platform)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("sync", ["merge", "adapter"])
def test_a_push_gathers_the_policy_once_whatever_the_number_of_servers(
    tmp_path, lora_policy, tokenizer, servers, sync, monkeypatch
):
    """Each chunk file (or the adapter folder) is written once and loaded by every server."""
    import grpo_lightning.generation.vllm.server as module

    gathered = []
    for name in ("policy_weights", "save_policy"):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **k: gathered.append(_name) or _real(*a, **k)
        )
    gen = generator(lora_policy, tokenizer, servers, tmp_path, lora_sync=sync)
    gen.sync_weights(lora_policy)
    assert gathered == (["policy_weights"] if sync == "merge" else ["save_policy"])
    route = "POST /update_weights" if sync == "merge" else "POST /v1/load_lora_adapter"
    loaded = [[body for path, body in server.requests if path == route] for server in servers]
    assert loaded[0] and loaded[0] == loaded[1]  # the same files, in the same order, on both servers
    versions = {claims.parse(server.weight_version) for server in servers}
    assert len({(v.nonce, v.pushes) for v in versions}) == 1


def pushes_to(server) -> int:
    """The weight-transfer requests `server` received (every phase of every full push)."""
    return len([p for p in server.paths() if "weight_update" in p or "update_weights" in p])


def answered(servers) -> list[tuple[tuple[int, ...], int]]:
    """(prompt, seed) of every sampling request the servers answered (not the weight probe's)."""
    return sorted(
        (tuple(body["prompt"]), body["seed"])
        for server in servers
        for path, body in server.requests
        if path == "POST /v1/completions" and "prompt_logprobs" not in body
    )


def test_requests_go_to_the_least_loaded_server(tmp_path, tiny_model, tokenizer, servers):
    """A server that takes 0.3 s a request gets fewer of them; round-robin would give each server half."""
    gen = generator(tiny_model, tokenizer, servers, tmp_path, concurrency=2)
    servers[0].delay_s = 0.3
    gen.generate([[i + 1] for i in range(12)], num_samples=1)
    slow, fast = (server.paths().count("POST /v1/completions") for server in servers)
    assert slow + fast == 12 and 1 <= slow <= 3


@pytest.mark.parametrize("when", ["before the round", "mid-round", "mid-round beside training"])
def test_a_lost_server_is_dropped_and_its_requests_sampled_elsewhere_with_the_same_seeds(
    tmp_path, tiny_model, tokenizer, servers, when, caplog
):
    """The truth: an intact pool's requests for the same round. The seeds depend on (round, prefix), not on the
    server, so the surviving server answers exactly the (prompt, seed) pairs both would have. Beside training
    (an overlapped round, sampled in a worker thread from the weights pushed as the trained round started), the
    same, and nothing is pushed from the worker."""
    prefixes = [[i + 1, 7] for i in range(8)] + [[1, 7]]  # one prefix twice: its second stream too
    reference = generator(tiny_model, tokenizer, servers, tmp_path)
    reference.sync_weights(tiny_model)
    reference.reseed(5)
    reference.generate(prefixes, num_samples=2)
    truth = answered(servers)
    reference.close()
    for server in servers:
        server.requests.clear()

    gen = generator(tiny_model, tokenizer, servers, tmp_path, concurrency=2)
    engine = gen.background_copy() if when == "mid-round beside training" else gen
    engine.sync_weights(tiny_model)
    engine.reseed(5)
    servers[0].answers_left = 0 if when == "before the round" else 3  # dies before, or after a few answers
    pushes = [pushes_to(server) for server in servers]
    out = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate(prefixes, num_samples=2)))
    worker.start()
    worker.join(60)
    assert len(out) == len(prefixes)
    assert [pushes_to(server) for server in servers] == pushes  # none from the worker
    # a request answered by the dying server but not vouched for (its version unread) was asked again elsewhere
    assert set(answered(servers)) == set(truth) and len(set(truth)) == len(prefixes)
    assert all(c.weight_version == 1 for group in out for c in group)
    assert f"the vLLM server at {servers[0].url} is dropped from the pool" in caplog.text
    assert [c.url for c in gen.pool.live] == [servers[1].url]
    # the next push goes to the live server alone, and the claim is no longer renewed on the lost one
    servers[0].requests.clear()
    gen.sync_weights(tiny_model)
    assert claims.parse(servers[1].weight_version).pushes == 2 and not servers[0].requests
    assert [c.url for c in gen.claims.clients] == [servers[1].url]


def test_a_push_that_loses_a_server_part_way_lands_on_the_others(tmp_path, tiny_model, tokenizer, servers, caplog):
    gen = generator(tiny_model, tokenizer, servers, tmp_path)
    gen.sync_weights(tiny_model)
    servers[0].answers_left = 2  # dies inside the next push
    gen.sync_weights(tiny_model)
    assert claims.parse(servers[1].weight_version).pushes == 2
    assert "dropped from the pool" in caplog.text and [c.url for c in gen.pool.live] == [servers[1].url]
    (completion,) = gen.generate([[4]], num_samples=1)[0]
    assert completion.weight_version == 2


def test_a_push_in_flight_that_loses_a_server_part_way_resumes_the_others(tmp_path, tiny_model, tokenizer, servers):
    """`push_in_flight`: a server that dies inside the push (after it was paused) is dropped and the push made
    again to the others; every server still alive is resumed, so a request kept there across the push ends."""
    gen = generator(tiny_model, tokenizer, servers, tmp_path, push_in_flight=True, max_staleness=1)
    snapshot = gen.background_copy()
    snapshot.sync_weights(tiny_model)
    for server in servers:
        server.requests.clear()
        server.delay_s = 0.5
    worker, kept = sample_beside(snapshot, [3])
    while not any("POST /v1/completions" in server.paths() for server in servers):
        time.sleep(0.01)
    busy = next(server for server in servers if "POST /v1/completions" in server.paths())
    other = servers[1 - servers.index(busy)]
    other.answers_left = 2  # its version read, then paused: it dies at the push's first phase
    snapshot.push_in_flight(tiny_model)
    worker.join(10)
    assert not worker.is_alive() and (kept[0].weight_version, kept[0].last_weight_version) == (1, 2), kept
    assert [c.url for c in gen.pool.live] == [busy.url] and not busy.paused
    assert claims.parse(busy.weight_version).pushes == 2
    assert busy.paths().count("POST /pause?mode=keep") == busy.paths().count("POST /resume") == 2  # once per try


def test_a_request_the_server_refuses_is_not_sent_elsewhere(tmp_path, tiny_model, tokenizer, servers):
    """A 4xx is the request's fault: every server would refuse it, so it stops the run, naming the server."""
    gen = generator(tiny_model, tokenizer, servers, tmp_path)
    gen.served_model = "another-model"  # the fake answers 404 for a model it does not serve
    with pytest.raises(EngineFailed, match="failed a completion request .*answered 404"):
        gen.generate([[4]], num_samples=1)
    assert sum(server.paths().count("POST /v1/completions") for server in servers) == 1
    assert len(gen.pool.live) == 2


def test_the_last_server_lost_stops_the_run_in_one_line(tmp_path, tiny_model, tokenizer, servers):
    gen = generator(tiny_model, tokenizer, servers, tmp_path)
    for server in servers:
        server.answers_left = 0
    with pytest.raises(EngineFailed, match="resume once it answers again") as err:
        gen.generate([[1], [2], [3]], num_samples=1)
    assert "\n" not in str(err.value) and gen.pool.live == []


METRICS = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 12.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 4.0
process_cpu_seconds_total 81.2 1700000000
"""


def test_the_prometheus_text_is_read_by_name_summed_over_engines():
    from grpo_lightning.generation.vllm.server_pool import parse_metrics

    names = {"vllm:num_requests_waiting", "vllm:request_queue_time_seconds_sum", "process_cpu_seconds_total"}
    assert parse_metrics(METRICS, names) == {
        "vllm:num_requests_waiting": 5.0,
        "vllm:request_queue_time_seconds_sum": 12.5,
        "process_cpu_seconds_total": 81.2,
    }


def test_each_servers_load_is_reported_as_maxima_and_deltas_since_the_last_report(
    tmp_path, tiny_model, tokenizer, servers
):
    """By hand: the gauges' largest reading in the span, the counters' growth over it, the mean queue time as
    the queue-time sum's growth over the count's."""
    for server in servers:
        server.metrics_text = METRICS
    gen = generator(tiny_model, tokenizer, servers, tmp_path, metrics_interval_s=3600)  # read only at reports
    servers[0].metrics_text = METRICS.replace("} 3.0", "} 9.0")  # a busier moment, seen by the next reading
    gen.load._observe()
    later = METRICS.replace("} 7.0", "} 10.0").replace("} 12.5", "} 20.5")
    servers[0].metrics_text = later.replace(
        'count{engine="0",model_name="m"} 10.0', 'count{engine="0",model_name="m"} 14.0'
    )
    report = gen.engine_metrics()
    assert report["server/0/requests_waiting_max"] == 11.0  # 9 + 2 (engine 1), the busier reading
    assert report["server/0/requests_running_max"] == 4.0 and report["server/0/kv_cache_usage_max"] == 0.25
    assert report["server/0/preemptions"] == 3.0
    assert report["server/0/queue_s_mean"] == pytest.approx(8.0 / 4.0)
    assert report["server/1/preemptions"] == 0.0 and "server/1/queue_s_mean" not in report  # nothing queued since
    assert gen.engine_metrics()["server/0/preemptions"] == 0.0  # the next span starts at the last report
    servers[0].metrics_text = METRICS.replace("} 7.0", "} 2.0")  # restarted: its counters began again at 0
    assert gen.engine_metrics()["server/0/preemptions"] == 2.0
    off = generator(tiny_model, tokenizer, servers, tmp_path, metrics_interval_s=0)
    assert off.engine_metrics() == {"rollout/dropped_stale": 0.0}  # no server/ load read
