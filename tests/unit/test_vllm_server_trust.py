"""generator=vllm_server with the faults of servers shared between runs, against the fake `vllm serve`
(tests/fake_vllm_server.py): a server that cannot serve this run, holds other weights, is used by another run, is
written by another writer mid-run, or was left inside a weight update by a killed run. Each is one line naming the
URL; nothing sampled from weights the run cannot vouch for is returned to be trained on.

Truths: the trainer's own log-probs of the probe text (a plain float32 forward of the policy), a server whose
weights are a perturbed copy of the policy's, the claim written by hand.
"""

from __future__ import annotations

import copy
import os
import socket
import stat
import threading
import time

import pytest
import torch

from grpo_lightning.errors import EngineFailed
from grpo_lightning.generation.stale_guard import StaleWeightGuard
from grpo_lightning.generation.vllm import server_claim as claims
from grpo_lightning.generation.vllm.server import VLLMServerGenerator
from grpo_lightning.generation.vllm.server_checks import probe_ids, trainer_probe_logprobs
from grpo_lightning.generation.vllm.server_weights import ServerClient
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from tests.fake_vllm_server import FakeServer
from tests.unit.test_vllm_server_contract import generator, scorer_of


@pytest.fixture(autouse=True)
def no_settle_delay(monkeypatch):
    """The claim's read-back waits 0.5-1.5 s against runs that start together; one test keeps it."""
    monkeypatch.setattr(claims, "settle_delay", lambda: 0.0)


@pytest.fixture
def server(tokenizer, tiny_model):
    made = FakeServer(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], scorer=scorer_of(tiny_model))
    yield made
    made.close()


@pytest.fixture
def lora_policy(tiny_model):
    policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4), needs_reference=False)
    return policy


def perturbed(model, scale: float):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return other


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# ---- a server that cannot serve this run: refused at start --------------------------------------------------------
@pytest.mark.parametrize(
    ("fault", "keys", "words"),
    [
        ("dev_routes", {}, "has no /server_info route: start it with VLLM_SERVER_DEV_MODE=1"),
        ("raw_logprobs", {}, "reports raw_logprobs log-probs"),
        ("no_lora", {"lora_sync": "adapter"}, "runs without LoRA, which generator.lora_sync=adapter loads"),
        ("small_lora", {"lora_sync": "adapter"}, "has --max-lora-rank 1, below the policy's LoRA rank"),
        ("no_transfer", {}, "has no weight-transfer backend, which full weight pushes need"),
        ("nccl_transfer", {}, "takes weights through the 'nccl' backend, but the trainer pushes through 'grpo_files'"),
        ("short", {"max_prompt_tokens": 100}, "max_model_len 64, below the longest prompt (data.max_prompt_tokens=100) "
                                              "plus generator.max_new_tokens=8 = 108"),
        ("api_key", {}, "refused the request (401 Unauthorized): it needs an API key; set VLLM_API_KEY"),
        ("cpu_chunked_prefill", {}, "runs on a CPU with chunked prefill on, where vLLM's CPU build stops its engine "
                                    "once a seeded request's prompt is split"),
    ],
)  # fmt: skip
def test_a_server_that_cannot_serve_this_run_is_refused_at_start_in_one_line(
    tmp_path, lora_policy, tokenizer, server, fault, keys, words
):
    if fault == "dev_routes":
        server.dev_routes = False
    elif fault == "raw_logprobs":
        server.logprobs_mode = "raw_logprobs"
    elif fault == "no_lora":
        server.lora_config = None
    elif fault == "small_lora":
        server.lora_config = {"max_lora_rank": 1}
    elif fault == "no_transfer":
        server.weight_transfer_config = None
    elif fault == "nccl_transfer":
        server.weight_transfer_config = {"backend": "nccl"}
    elif fault == "short":
        server.max_model_len = 64
    elif fault == "cpu_chunked_prefill":
        server.chunked_prefill = True
    else:
        server.api_key = "secret"
    with pytest.raises(ValueError) as err:
        generator(lora_policy, tokenizer, [server], tmp_path, **keys)
    assert words in one_line(err) and server.url in str(err.value)
    assert "POST /update_weight_version" not in server.paths()  # not claimed: nothing of the run's reached it


def test_chunked_prefill_is_refused_on_a_cpu_server_only(tmp_path, tiny_model, tokenizer, server):
    """A GPU's generators rewind; a CPU's do not (server_checks.check_seeded_sampling)."""
    server.chunked_prefill, server.device = True, "cuda"
    generator(tiny_model, tokenizer, [server], tmp_path).close()


def test_started_cpu_servers_run_without_chunked_prefill():
    from grpo_lightning.generation.vllm.server_process import launch_args

    common = {"dtype": "float32", "seed": 0, "max_model_len": None, "weight_transfer": None, "lora_rank": 0,
              "kv_cache_gib": None, "extra": []}  # fmt: skip
    assert "--no-enable-chunked-prefill" in launch_args(cpu=True, **common)
    assert "--no-enable-chunked-prefill" not in launch_args(cpu=False, **common)


def test_a_server_of_another_architecture_is_refused_before_any_push(tmp_path, tiny_model, tokenizer, server):
    folder = tmp_path / "served"
    other = copy.deepcopy(tiny_model.config)
    other.num_hidden_layers += 2
    other.save_pretrained(folder)  # the folder the server says it loaded (/server_info: model_config.model)
    server.model = str(folder)
    with pytest.raises(ValueError) as err:
        generator(tiny_model, tokenizer, [server], tmp_path, model_path=str(folder))
    assert f"num_hidden_layers {other.num_hidden_layers} (policy: {tiny_model.config.num_hidden_layers})" in one_line(
        err
    )
    assert "POST /start_weight_update" not in server.paths()


def test_the_api_key_goes_as_a_bearer_token_and_never_into_a_message(tmp_path, tiny_model, tokenizer, server):
    server.api_key = "s3cret-key"
    gen = generator(tiny_model, tokenizer, [server], tmp_path, api_key="s3cret-key")
    gen.sync_weights(tiny_model)
    assert gen.generate([[1, 2]], num_samples=1)[0][0].token_ids
    assert "s3cret-key" not in repr(gen.clients[0]) and "s3cret-key" not in repr(gen.settings)
    server.close()
    with pytest.raises(EngineFailed) as err:
        gen.generate([[1, 2]], num_samples=1)
    assert "s3cret-key" not in str(err.value)


# ---- other weights: the probe after the first push ----------------------------------------------------------------
@pytest.mark.parametrize("sync", ["merge", "adapter"])
def test_a_server_with_other_weights_is_refused_after_the_first_push(tmp_path, lora_policy, tokenizer, server, sync):
    """The policy's tokenizer and architecture, other weights: what the probe is for. 0.05 nats of noise on every
    weight (the truth: a perturbed copy's own log-probs) is far more than float32 agreement and far less than
    another checkpoint."""
    other = perturbed(lora_policy.get_base_model() if sync == "adapter" else lora_policy, 0.05)
    server.scorer = scorer_of(other)
    gen = generator(lora_policy, tokenizer, [server], tmp_path, lora_sync=sync)
    ids = probe_ids(tokenizer)
    expected = float((trainer_probe_logprobs(other, ids) - trainer_probe_logprobs(lora_policy, ids)).abs().mean())
    with pytest.raises(ValueError) as err:
        gen.sync_weights(lora_policy)
    assert f"serves other weights than the policy's: its log-probs of a probe text differ from the trainer's by " \
        f"{expected:.3g}" in one_line(err)  # fmt: skip
    assert server.url in str(err.value)
    server.scorer = scorer_of(lora_policy)  # the same server with the policy's weights passes
    generator(lora_policy, tokenizer, [server], tmp_path, lora_sync=sync).sync_weights(lora_policy)


def test_the_probe_runs_in_eval_mode_and_leaves_training_mode_as_it_was(lora_policy, tokenizer):
    lora_policy.train()
    ids = probe_ids(tokenizer)
    out = trainer_probe_logprobs(lora_policy, ids)
    assert lora_policy.training
    with torch.no_grad():
        logits = lora_policy.eval()(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    truth = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(out.double(), truth, rtol=0, atol=1e-5)


# ---- one run per server ------------------------------------------------------------------------------------------
def foreign(server: FakeServer, age_s: float = 0.0, folder: str = "/runs/other", host: str = "other-host") -> str:
    version = claims.Claim("abcdef012345", 3, time.time() - age_s, f"{host}:4242:{folder}").render()
    server.weight_version = version
    return version


def test_a_server_another_live_run_claims_is_refused_naming_that_run(tmp_path, tiny_model, tokenizer, server):
    foreign(server, age_s=5)
    with pytest.raises(ValueError) as err:
        generator(tiny_model, tokenizer, [server], tmp_path)
    text = one_line(err)
    assert f"the vLLM server at {server.url} is in use by another run (/runs/other on other-host" in text
    assert "generator.claim_ttl_s=120" in text


@pytest.mark.parametrize("case", ["expired", "same_folder", "another_tool"])
def test_a_claim_no_live_run_holds_is_taken(tmp_path, tiny_model, tokenizer, server, case):
    gen_dir = tmp_path / "run" / "vllm_server"
    if case == "expired":
        foreign(server, age_s=121)
    elif case == "same_folder":  # this run's folder on this host: the run itself, killed and resumed
        foreign(server, folder=str(gen_dir.parent), host=socket.gethostname())
    else:
        server.weight_version = "step-1200"
    gen = generator(tiny_model, tokenizer, [server], tmp_path, log_dir=str(gen_dir))
    assert claims.parse(server.weight_version).nonce == gen.run_id
    gen.sync_weights(tiny_model)
    gen.generate([[1, 2]], num_samples=1)


def test_of_two_runs_that_start_together_one_is_refused(tmp_path, tiny_model, tokenizer, server, monkeypatch):
    monkeypatch.setattr(claims, "settle_delay", lambda: 0.5)
    outcomes: list[object] = [None, None]

    def start(i: int) -> None:
        try:
            outcomes[i] = generator(tiny_model, tokenizer, [server], tmp_path, log_dir=str(tmp_path / f"run{i}" / "v"))
        except ValueError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [o for o in outcomes if isinstance(o, ValueError)]
    kept = [o for o in outcomes if isinstance(o, VLLMServerGenerator)]
    assert len(refused) == 1 and len(kept) == 1, outcomes
    assert server.url in str(refused[0]) and (
        "in use by another run" in str(refused[0]) or "same time" in str(refused[0])
    )
    assert claims.parse(server.weight_version).nonce == kept[0].run_id


def test_the_claim_is_renewed_between_pushes(tmp_path, tiny_model, tokenizer, server):
    gen = generator(tiny_model, tokenizer, [server], tmp_path, claim_ttl_s=0.15)
    first = claims.parse(server.weight_version).renewed
    time.sleep(0.6)
    assert claims.parse(server.weight_version).renewed > first
    gen.close()
    stopped = server.weight_version
    time.sleep(0.2)
    assert server.weight_version == stopped  # a closed run renews nothing


# ---- another writer mid-run --------------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["between_rounds", "while_sampling"])
def test_weights_another_writer_changed_mid_run_stop_the_run_and_nothing_is_returned(
    tmp_path, tiny_model, tokenizer, server, when
):
    gen = generator(tiny_model, tokenizer, [server], tmp_path)
    gen.sync_weights(tiny_model)
    if when == "between_rounds":
        version = foreign(server)
    else:  # the version changes after the server answered: the samples it gave may come from the new weights
        original = server._answer

        def answer_then_overwrite(method, path, body, headers=None):
            out = original(method, path, body, headers)
            if path == "/v1/completions":
                foreign(server)
            return out

        server._answer = answer_then_overwrite
        version = None
    with pytest.raises(EngineFailed) as err:
        gen.generate([[1, 2]], num_samples=1)
    text = one_line(err)
    assert f"the weights of the vLLM server at {server.url} were changed by another writer during this run" in text
    assert not err.value.resumable and (version is None or version in text)
    with pytest.raises(EngineFailed):  # nor does the run push over them
        gen.sync_weights(tiny_model)


def test_a_server_restarted_while_it_sampled_stops_the_run(tmp_path, tiny_model, tokenizer, server):
    gen = generator(tiny_model, tokenizer, [server], tmp_path)
    gen.sync_weights(tiny_model)
    original = server._answer

    def answer_then_restart(method, path, body, headers=None):
        out = original(method, path, body, headers)
        if path == "/v1/completions":
            server.restart()
        return out

    server._answer = answer_then_restart
    with pytest.raises(EngineFailed, match="restarted while it sampled") as err:
        gen.generate([[1, 2]], num_samples=1)
    assert err.value.resumable


def test_a_push_interrupted_by_a_killed_run_is_finished_before_the_next_push(tmp_path, tiny_model, tokenizer, server):
    run_dir = tmp_path / "run"
    foreign(server, folder=str(run_dir), host=socket.gethostname())  # the killed process of this same run
    server.updating = True  # killed between /start_weight_update and /finish_weight_update
    gen = generator(tiny_model, tokenizer, [server], tmp_path, log_dir=str(run_dir / "vllm_server"))
    gen.sync_weights(tiny_model)
    assert not server.updating and claims.parse(server.weight_version).pushes == 1
    posts = server.paths()
    first_start = posts.index("POST /start_weight_update")
    assert posts[first_start + 1] == "POST /finish_weight_update"  # the interrupted update closed first
    assert posts[-1] in ("POST /reset_prefix_cache", "POST /v1/completions")


# ---- the another-model bound -------------------------------------------------------------------------------------
def test_the_another_model_bound_stops_a_fresh_round_whatever_on_stale_says():
    guard = StaleWeightGuard(0.05, "warn", another_model=1.0)
    guard.round_sampled()
    guard.check_another_model(0, 0.9)  # a stale adapter's gap: the stale guard's business
    with pytest.raises(EngineFailed, match=r"round 2: rollout/logp_diff_mean = 10.2 before any update") as err:
        guard.check_another_model(2, 10.2)
    assert not err.value.resumable
    guard.round_sampled(stale=True)  # sampled from older weights on purpose: not judged
    guard.check_another_model(3, 10.2)


# ---- transfer_dir ------------------------------------------------------------------------------------------------
def test_transfer_dir_is_checked_before_anything_loads(tmp_path):
    from grpo_lightning.app.validation import validate
    from tests.conftest import make_cfg

    afile = tmp_path / "afile"
    afile.write_text("")
    for value, words in ((afile, "is a file, not a directory"), (afile / "sub", "cannot create")):
        cfg = make_cfg(tmp_path, ["generator=vllm_server", f"generator.transfer_dir={value}"])
        with pytest.raises(ValueError) as err:
            validate(cfg, platform=False)
        assert str(err.value).startswith("generator.transfer_dir: ") and words in one_line(err)


def test_a_transfer_dir_others_can_write_gets_a_private_folder(tmp_path, tiny_model, tokenizer, server):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /dev/shm and /tmp
    gen = generator(tiny_model, tokenizer, [server], tmp_path, transfer_dir=str(shared))
    private = gen.transfer_dir
    info = os.lstat(private)
    assert private.parent == shared and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    own.chmod(0o755)
    assert generator(tiny_model, tokenizer, [server], tmp_path, transfer_dir=str(own)).transfer_dir == own


def test_an_api_key_written_in_the_config_is_refused(tmp_path):
    from grpo_lightning.app.validation import validate
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, ["generator=vllm_server", "generator.api_key=hunter2"])
    with pytest.raises(ValueError) as err:
        validate(cfg, platform=False)
    assert "generator.api_key is written in the config" in one_line(err) and "hunter2" not in str(err.value)
    ok = make_cfg(tmp_path, ["generator=vllm_server", "generator.api_key=${oc.env:MY_KEY,null}"])
    validate(ok, platform=False)


def test_server_client_sends_no_authorization_without_a_key():
    assert "Authorization" not in ServerClient("http://127.0.0.1:1", 1)._headers
    assert ServerClient("http://127.0.0.1:1", 1, "k")._headers["Authorization"] == "Bearer k"


def test_the_api_key_never_reaches_the_trackers(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from grpo_lightning.app.run_record import without_secrets
    from tests.conftest import make_cfg

    monkeypatch.setenv("VLLM_API_KEY", "s3cret-key")
    cfg = make_cfg(tmp_path, ["generator=vllm_server"])
    params = OmegaConf.to_container(cfg, resolve=True)
    assert params["generator"]["api_key"] == "s3cret-key"  # what the tracker would have stored
    assert "s3cret-key" not in str(without_secrets(params)) and params["generator"]["api_key"] == "<set>"
    assert "s3cret-key" not in OmegaConf.to_yaml(cfg)  # the run record keeps the interpolation, not the value


def test_a_closed_run_releases_its_claim(tmp_path, tiny_model, tokenizer, server):
    gen = generator(tiny_model, tokenizer, [server], tmp_path, log_dir=str(tmp_path / "a" / "v"))
    gen.sync_weights(tiny_model)
    gen.close()
    assert claims.parse(server.weight_version).renewed == 0.0  # expired: the next run takes it at once
    generator(tiny_model, tokenizer, [server], tmp_path, log_dir=str(tmp_path / "b" / "v"))


def test_weights_a_server_refuses_at_the_first_push_are_a_config_error_not_a_resume(
    tmp_path, tiny_model, tokenizer, server
):
    """A server whose config this machine cannot read (a remote folder) and whose model takes other shapes answers
    the first push with an error (vLLM: 500): resuming would fail alike, so it is exit 2, not the resume advice."""
    original = server._answer

    def refuse_weights(method, path, body, headers=None):
        if path == "/update_weights":
            return 500, {"error": {"message": "size mismatch for model.embed_tokens.weight"}}
        return original(method, path, body, headers)

    server._answer = refuse_weights
    gen = generator(tiny_model, tokenizer, [server], tmp_path)
    with pytest.raises(ValueError) as err:
        gen.sync_weights(tiny_model)
    assert f"the vLLM server at {server.url} refused the policy's weights at the first push" in one_line(err)
    assert "size mismatch" in str(err.value)
