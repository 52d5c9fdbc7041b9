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
