"""Evaluation scoring against hand-computed values."""

import pytest

from grpo_lightning.rewards.gsm8k import GSM8KReward
from grpo_lightning.training.evaluation import GSM8KEvaluator, pass_at_k, score_completions
from tests.helpers import StubGenerator


def test_accuracy_format_rate_and_length_on_hand_written_completions():
    texts = [
        "She sells 9 eggs.\n#### 9",  # correct
        "The answer is 18.",  # correct
        "#### 7",  # wrong, but formatted
        "I think it is 5",  # no extractable answer
        "\\boxed{1,000}",  # correct (commas)
    ]
    answers = ["9", "18", "8", "5", "1000"]
    lengths = [10, 6, 3, 7, 4]
    result = score_completions(texts, lengths, answers, GSM8KReward(format_bonus=0.0))
    assert result.accuracy == pytest.approx(3 / 5)
    assert result.format_rate == pytest.approx(4 / 5)
    assert result.completion_len_mean == pytest.approx(30 / 5)


def test_pass_at_k_by_hand():
    assert pass_at_k([[False, True], [False, False], [True, True]]) == pytest.approx(2 / 3)
    assert pass_at_k([]) == 0.0


@pytest.mark.parametrize("key", ["every_n_rounds", "num_problems", "max_new_tokens"])
def test_validation_names_the_key(key):
    with pytest.raises(ValueError, match=f"eval.{key}"):
        GSM8KEvaluator(dataset=None, reward=None, **{key: 0})


# ---- evaluation where the default process group is NCCL (vLLM on CUDA, trainer=ddp on GPUs) ----------------------
NO_CPU = "No backend type associated with device type cpu"
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce", "gather", "scatter")


@pytest.fixture
def nccl_like_group(tmp_path, monkeypatch):
    """A default process group of world size 1 whose collectives refuse CPU tensors, as NCCL's do.

    vLLM's engine on CUDA initialises torch.distributed with the NCCL backend in the training process (one rank);
    gloo stands for it here, with every tensor collective patched to raise NCCL's error on a CPU tensor.
    """
    import torch
    import torch.distributed as dist

    def refusing(name):
        real = getattr(dist, name)

        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" for t in tensors):
                raise RuntimeError(NO_CPU)
            return real(*args, **kwargs)

        return collective

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refusing(name))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_simulated_group_refuses_cpu_tensors(nccl_like_group):
    import torch
    import torch.distributed as dist

    with pytest.raises(RuntimeError, match=NO_CPU):
        dist.all_gather([torch.zeros(1)], torch.zeros(1))


def test_scores_compute_in_a_one_process_nccl_group(nccl_like_group):
    """Same hand-computed values as without a process group: nothing is synchronised a second time."""
    texts = ["#### 9", "The answer is 18.", "#### 7", "no idea"]
    result = score_completions(texts, [4, 6, 2, 8], ["9", "18", "8", "5"], GSM8KReward(format_bonus=0.0))
    assert (result.accuracy, result.format_rate, result.completion_len_mean) == (0.5, 0.75, 5.0)


def test_an_evaluation_runs_in_a_one_process_nccl_group(nccl_like_group):
    """The evaluator end to end (generate, gather, score, log) with a scripted engine: 2 of 3 answers right."""
    from types import SimpleNamespace

    from grpo_lightning.types import Completion, Prompt

    replies = {1: "#### 4", 2: "#### 5", 3: "#### 6"}

    class ScriptedEngine(StubGenerator):
        def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
            return [[Completion([p[0]], [0.0], finished=True)] for p in prefixes]

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: replies[ids[0]])
    logged = []
    trainer = SimpleNamespace(
        is_global_zero=True, global_step=3, loggers=[SimpleNamespace(log_metrics=lambda m, step: logged.append(m))]
    )
    evaluator = GSM8KEvaluator(dataset=None, reward=GSM8KReward(format_bonus=0.0), generator=ScriptedEngine(),
                               tokenizer=tokenizer, num_samples_logged=0)  # fmt: skip
    evaluator.prompts = [Prompt([i], answer, f"q{i}", i) for i, answer in [(1, "4"), (2, "5"), (3, "7")]]
    metrics = evaluator.evaluate(trainer)
    assert metrics["eval/gsm8k_accuracy"] == pytest.approx(2 / 3) and metrics["eval/format_rate"] == 1.0
    assert logged and logged[0]["eval/gsm8k_accuracy"] == pytest.approx(2 / 3)


def test_a_tiny_run_with_evaluation_in_a_one_process_nccl_group(nccl_like_group, tiny_cfg):
    """Evaluation at the start and after the last round of a real (tiny) run, as under vLLM on CUDA."""
    from grpo_lightning.app.train import build_run

    metrics = build_run(tiny_cfg("trainer.max_epochs=1", "eval.num_problems=2")).fit()
    assert 0.0 <= metrics["eval/gsm8k_accuracy"] <= 1.0 and metrics["eval/completion_len_mean"] > 0


# ---- statistics a researcher can quote -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_equals_the_mean_over_every_subset_of_k_samples(n):
    """Brute force: pass@k is the chance that k of the n samples, without replacement, hold a correct one."""
    from itertools import combinations

    from grpo_lightning.training.evaluation import pass_at_k_estimate

    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(combinations(samples, k))
            truth = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k_estimate(n, c, k) == pytest.approx(truth, abs=1e-12), (n, c, k)


def test_pass_at_k_over_problems_and_its_limits():
    from grpo_lightning.training.evaluation import pass_at_k_estimate

    # 4 samples, 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2; all wrong: 0
    assert pass_at_k([[True, False, False, False], [False] * 4], k=2) == pytest.approx((0.5 + 0.0) / 2)
    assert pass_at_k([[True, False, False, False]], k=1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k_estimate(2, 1, 3)


@pytest.mark.parametrize(("successes", "trials"), [(0, 10), (1, 32), (16, 32), (32, 32), (7, 128), (93, 128)])
def test_wilson_interval_against_the_score_test_it_inverts(successes, trials):
    """Independent truth: the interval holds exactly the p whose score test does not reject the observed
    proportion, |p_hat - p| <= z sqrt(p (1 - p) / n), found here by bisection on each side of p_hat."""
    import math

    from grpo_lightning.training.evaluation import wilson_interval

    z, p_hat = 1.959964, successes / trials

    def accepted(p):
        return abs(p_hat - p) <= z * math.sqrt(p * (1 - p) / trials)

    def edge(inside, outside):
        for _ in range(200):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if accepted(mid) else (inside, mid)
        return inside

    centre = min(max(p_hat, 1e-12), 1 - 1e-12)
    low = 0.0 if successes == 0 else edge(centre, 0.0)
    high = 1.0 if successes == trials else edge(centre, 1.0)
    assert wilson_interval(successes, trials) == pytest.approx((low, high), abs=1e-9)


def test_num_samples_below_pass_k_names_the_keys():
    with pytest.raises(ValueError, match=r"eval.num_samples \(2\) must be >= eval.pass_k \(4\)"):
        GSM8KEvaluator(dataset=None, reward=None, pass_k=4, num_samples=2)


def test_evaluation_reports_the_interval_and_unbiased_pass_at_k():
    """Scripted engine: greedy answers 2 of 4 right; 4 samples per problem for pass@2 with 1, 0, 2, 4 correct."""
    from types import SimpleNamespace

    from grpo_lightning.training.evaluation import wilson_interval
    from grpo_lightning.types import Completion, Prompt

    greedy_reply = {1: "#### 1", 2: "#### 0", 3: "#### 3", 4: "#### 0"}
    sampled_right = {1: 1, 2: 0, 3: 2, 4: 4}

    class ScriptedEngine(StubGenerator):
        def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
            if greedy:
                return [[Completion([p[0]], [0.0], True)] for p in prefixes]
            return [[Completion([100 * p[0] + int(j < sampled_right[p[0]])], [0.0], True) for j in range(num_samples)]
                    for p in prefixes]  # fmt: skip

    def decode(ids, skip_special_tokens=True):
        token = ids[0]
        if token < 100:
            return greedy_reply[token]
        problem, right = divmod(token, 100)
        return f"#### {problem if right else -1}"

    trainer = SimpleNamespace(is_global_zero=True, global_step=0, loggers=[])
    evaluator = GSM8KEvaluator(dataset=None, reward=GSM8KReward(format_bonus=0.0), generator=ScriptedEngine(),
                               tokenizer=SimpleNamespace(decode=decode), num_samples_logged=0, pass_k=2,
                               num_samples=4)  # fmt: skip
    evaluator.prompts = [Prompt([i], str(i), f"q{i}", i) for i in range(1, 5)]
    metrics = evaluator.evaluate(trainer)
    assert metrics["eval/gsm8k_accuracy"] == 0.5
    assert (metrics["eval/gsm8k_accuracy_ci95_low"], metrics["eval/gsm8k_accuracy_ci95_high"]) == wilson_interval(2, 4)
    # pass@2 from 4 samples: 1 correct -> 1/2, 0 -> 0, 2 -> 1 - C(2,2)/C(4,2) = 5/6, 4 -> 1
    assert metrics["eval/pass@2"] == pytest.approx((0.5 + 0 + 5 / 6 + 1) / 4)


# ---- any data source: the format-independent accuracy, the strict one, the format rate ----------------------------
def scripted_evaluation(prompts, greedy_reply, sampled_replies=None, **settings):
    """An Evaluator over `prompts` whose engine answers prompt i greedily with greedy_reply[i] and samples
    sampled_replies[i] (a list) for pass@k."""
    from types import SimpleNamespace

    from grpo_lightning.training.evaluation import Evaluator
    from grpo_lightning.types import Completion

    texts = {}

    class ScriptedEngine(StubGenerator):
        def generate(self, prefixes, num_samples, max_new_tokens=None, greedy=False):
            out = []
            for p in prefixes:
                replies = [greedy_reply[p[0]]] if greedy else sampled_replies[p[0]][:num_samples]
                for r in replies:
                    texts[len(texts) + 1000] = r
                out.append([Completion([k], [0.0], True) for k in list(texts)[-len(replies) :]])
            return out

    trainer = SimpleNamespace(is_global_zero=True, global_step=5, loggers=[])
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: texts[ids[0]])
    evaluator = Evaluator(dataset=None, generator=ScriptedEngine(), tokenizer=tokenizer, num_samples_logged=0,
                          **settings)  # fmt: skip
    evaluator.prompts = prompts
    return evaluator, evaluator.evaluate(trainer)


def test_reasoning_gym_evaluation_by_hand():
    """Four problems, tag format. Greedy replies: right in the asked format; right but untagged; tagged right but
    ending in another number; wrong. eval/accuracy (last number) 2/4, strict 2/4, format rate 3/4; pass@2 from
    3 samples of which 1, 0, 3, 2 are right by the format-independent reading."""
    from grpo_lightning.rewards.reasoning_gym import ReasoningGymChecker
    from grpo_lightning.training.evaluation import wilson_interval
    from grpo_lightning.types import Prompt
    from tests.unit.test_answers import record

    answers = {0: "7", 1: "12", 2: "3", 3: "-4"}
    greedy = {0: "3 + 4 = 7\n<answer>7</answer>", 1: "5 + 7 = 12", 2: "<answer>3</answer> from 1 and 2",
              3: "<answer>4</answer>"}  # fmt: skip
    sampled = {0: ["7", "8", "9"], 1: ["11", "13", "<answer>1</answer>"], 2: ["3", "so 3", "<answer>3</answer>"],
               3: ["-4", "#### -4", "4"]}  # fmt: skip
    prompts = [Prompt([i], a, f"q{i}", i, record=record(a)) for i, a in answers.items()]
    evaluator, metrics = scripted_evaluation(prompts, greedy, sampled, checker=ReasoningGymChecker(), pass_k=2,
                                             num_samples=3)  # fmt: skip
    assert metrics["eval/accuracy"] == 0.5
    assert (metrics["eval/accuracy_ci95_low"], metrics["eval/accuracy_ci95_high"]) == wilson_interval(2, 4)
    assert metrics["eval/accuracy_strict"] == 0.5 and metrics["eval/format_rate"] == 0.75
    # pass@2 of 3 samples: c=1 -> 1 - C(2,2)/C(3,2) = 2/3; c=0 -> 0; c=3 -> 1; c=2 -> 1
    assert metrics["eval/pass@2"] == pytest.approx((2 / 3 + 0 + 1 + 1) / 4)
    assert "eval/gsm8k_accuracy" not in metrics
    assert [r["completion"] for r in evaluator.last_replies] == list(greedy.values())
    assert [r["verdict"].correct for r in evaluator.last_replies] == [True, True, False, False]


def test_every_evaluation_writes_its_replies_in_problem_order(tmp_path):
    """`eval.replies_dir`: one line per problem, in the subset's order, with the verdicts the metrics counted
    (hand-judged: the first and third replies end in the answer)."""
    import json

    from grpo_lightning.types import Prompt

    answers = {0: "7", 1: "12", 2: "3"}
    greedy = {0: "#### 7", 1: "#### 13", 2: "so 3"}
    prompts = [Prompt([i], a, f"q{i}", i) for i, a in answers.items()]
    evaluator, metrics = scripted_evaluation(prompts, greedy, replies_dir=str(tmp_path / "replies"))
    lines = [json.loads(x) for x in (tmp_path / "replies" / "step_5.jsonl").read_text().splitlines()]
    assert [(x["question"], x["answer"], x["completion"]) for x in lines] == [
        (f"q{i}", answers[i], greedy[i]) for i in range(3)
    ]
    assert [x["correct"] for x in lines] == [True, False, True]
    assert metrics["eval/accuracy"] == pytest.approx(2 / 3)
    assert [x.name for x in (tmp_path / "replies").iterdir()] == ["step_5.jsonl"]  # no temporary file left


def test_gsm8k_evaluation_keeps_its_accuracy_and_adds_the_new_ones():
    """GSM8K replies: eval/gsm8k_accuracy is the reward's own (any of its formats), eval/accuracy the last number,
    eval/accuracy_strict the `####` line only."""
    from grpo_lightning.training.evaluation import wilson_interval
    from grpo_lightning.types import Prompt

    greedy = {0: "#### 9", 1: "The answer is 18.", 2: "I get 5", 3: "#### 6\nsince 2 x 3"}
    prompts = [Prompt([i], a, f"q{i}", i) for i, a in enumerate(["9", "18", "5", "6"])]
    _, metrics = scripted_evaluation(prompts, greedy, reward=GSM8KReward(format_bonus=0.0))
    assert metrics["eval/gsm8k_accuracy"] == 0.75  # 9, 18, 6 in a recognised format; "I get 5" has none
    assert (metrics["eval/gsm8k_accuracy_ci95_low"], metrics["eval/gsm8k_accuracy_ci95_high"]) == wilson_interval(3, 4)
    assert metrics["eval/accuracy"] == 0.75  # last numbers 9, 18, 5 right; 3 wrong
    assert metrics["eval/accuracy_strict"] == 0.5  # `#### 9`, `#### 6`
    assert metrics["eval/format_rate"] == 0.75


def test_the_checker_comes_from_the_data_source():
    from grpo_lightning.data.gsm8k import GSM8K
    from grpo_lightning.data.reasoning_gym import ReasoningGym
    from grpo_lightning.rewards.checkers import GSM8KChecker
    from grpo_lightning.rewards.reasoning_gym import ReasoningGymChecker
    from grpo_lightning.training.evaluation import Evaluator, GSM8KEvaluator

    reward = GSM8KReward(format_bonus=0.0)
    assert Evaluator(dataset=GSM8K().test_split(), reward=reward).checker == GSM8KChecker(reward)
    assert isinstance(Evaluator(dataset=ReasoningGym().test_split(num_problems=4)).checker, ReasoningGymChecker)
    mine = ReasoningGymChecker()
    assert Evaluator(dataset=GSM8K(), checker=mine).checker is mine
    assert GSM8KEvaluator is Evaluator  # the old `_target_` still builds it
