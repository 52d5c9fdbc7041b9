"""Shared fixtures: composed configs (Hydra compose API), the tiny random model, and one load of each model.

Test tiers and markers: tests/README.md.
"""

from __future__ import annotations

import copy
import gc
import os
from collections import Counter
from pathlib import Path

import hydra
import pytest
import torch
from hydra import initialize_config_dir
from omegaconf import DictConfig, open_dict

from tests import compose_cache

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "grpo_lightning" / "conf")
# Files whose every test runs training in other processes (killed runs, DDP ranks): the slow tier.
SLOW_FILES = {
    "tests/test_resume.py",
    "tests/test_ddp.py",
    "tests/test_failures.py",
    "tests/test_reward_pipeline_run.py",
    "tests/test_fsdp.py",
}
# The slow tier's longest files, longest first: a file's seconds in its worker in one `make test` on a 2-core AMD
# EPYC Zen 4. `pytest -n` hands them out first (pytest_collection_modifyitems).
LONGEST_FILES = (
    "tests/slow/test_plan_bounds_peak.py",  # 166 s
    "tests/test_resume.py",  # 124 s
    "tests/slow/test_embedded_default.py",  # 102 s
    "tests/test_ddp.py",  # 62 s
    "tests/test_learning.py",  # 48 s
    "tests/slow/test_forked_cli.py",  # 36 s
    "tests/test_train.py",  # 33 s
    "tests/probes/test_gns_brute_force.py",  # 30 s
    "tests/probes/test_entropy_brute_force.py",  # 29 s
    "tests/test_overlap.py",  # 28 s
)


def pytest_configure(config):
    """No experiment tracker reaches the network or the home directory from a test, whatever a test builds:
    MLflow's usage telemetry off, W&B offline (tests/test_tracking_runs.py also moves W&B's caches)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `pytest -n N`'s processes: N of them share the cores
        one_thread_per_worker()
    elif getattr(config.option, "numprocesses", None):  # the controller of `pytest -n N`, before its workers start
        config.option.loadscopereorder = False  # files handed out in this file's order (collection_modifyitems)
        # OpenMP threads waiting at a barrier sleep instead of spinning: read when torch loads OpenMP, so only
        # processes started from here on (the workers and theirs) get it. A test with two threads beside another
        # worker (`two_torch_threads`), or the whole suite beside other jobs on the cores, would otherwise spin
        # on cores others need: 3,000 small matmuls with 2 threads took 22 s that way beside two busy
        # processes, 0.4 s with passive waiting.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def one_thread_per_worker() -> None:
    """One torch (OpenMP) thread in this worker and in every process it starts (CLI runs, DDP ranks).

    Two workers with a thread pool each as wide as the machine oversubscribe the cores, and OpenMP threads that
    wait for a busy core spin: beside other busy processes a test of the fast tier took 13 s that way, 0.4 s
    with one thread. Tests whose point is a thread count that changes and comes back take `two_torch_threads`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture
def two_torch_threads():
    """At least two torch threads during the test (a worker of `pytest -n` runs with one), then the count before:
    for a test of thread shares and counts given back, which one thread would pass without showing anything."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


compose_cache.install(CONF_DIR)  # each distinct config composed once per process (tests/compose_cache.py)


def pytest_collection_finish(session):
    """A session with slow tests (they train): what collection imported (torch, transformers, Lightning, every
    test module) stays alive for the session, and `gc.freeze` takes it out of the cyclic collector's scans. A full
    collection otherwise walks those millions of objects again and again as the tests allocate (about 5% of a
    training-heavy file's time, tests/test_train.py and tests/test_overlap.py with one worker, on a 2-core AMD
    EPYC Zen 4). Objects the tests make are collected as before. The fast tier allocates too little to gain:
    there the freeze's own collection cost about 1.5 s of `make check`, so it is skipped."""
    if any(item.get_closest_marker("slow") for item in session.items):
        gc.collect()
        gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Frozen objects back to the collector before the interpreter's shutdown, which frees them: extension
    modules (triton's, in the vLLM venv) would otherwise report every object of theirs left alive as leaked.

    A worker of `pytest -n N` then ends without that shutdown (`exit_without_teardown`): the shutdown frees every
    module torch, transformers and Lightning loaded, about 3.5 s on a 2-core AMD EPYC Zen 4, and the controller
    waits for it (xdist's teardown) before it prints the summary and exits. A worker has reported everything by
    now: its results, and that it finished (pytest_sessionfinish)."""
    gc.unfreeze()
    if getattr(config, "workerinput", None) is not None:  # xdist's mark of a worker (its environment variable
        exit_without_teardown()  # reaches the processes a worker starts, a pytest among them)


def exit_without_teardown(code: int = 0) -> None:
    """End this process as the interpreter would, less freeing its modules: the exit handlers (atexit: the
    forked-CLI servers closed, pytest's temporary-folder upkeep) and the standard streams flushed, then `os._exit`
    (a thread still running ends with it; the interpreter would wait for a non-daemon one)."""
    from tests.forked_cli import run_exit_handlers  # here: importing it reads the environment tests start from

    run_exit_handlers()
    os._exit(code)


def pytest_collection_modifyitems(config, items):
    """Mark `slow` what trains end to end, runs processes or loads the real model (tests/README.md), and order the
    files as `pytest -n` hands them out: the longest first, the real vLLM engines last.

    Beside explicit `@pytest.mark.slow` marks: everything under tests/slow/, the files in SLOW_FILES, and every
    test that uses the `tiny_cfg` fixture (a full training run, however tiny). The in-process vLLM engine
    (tests/test_vllm.py) initialises torch.distributed and keeps its memory for the session, so nothing else runs
    after it in the same process.

    The order: `--dist loadfile` hands each worker a whole file when its last one is nearly done, in the order
    here (`pytest_configure` turns off xdist's own reordering, by test count, which used to start the real
    model's 100 s file after five minutes). Longest first, as a scheduler of jobs of known length does: the files
    of LONGEST_FILES in their order, then the other files with slow tests, then the fast files, these two groups
    by test count, most first (xdist's own order); so the last files handed out are short, and neither worker
    waits long for the other at the end.
    """
    relative = {path: path.resolve().relative_to(ROOT).as_posix() for path in {item.path for item in items}}
    for item in items:
        path = relative[item.path]
        if path.startswith("tests/slow/") or path in SLOW_FILES or "tiny_cfg" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    tests_per_file = Counter(item.path for item in items)

    def order(item) -> tuple:
        path = relative[item.path]
        rank = LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)
        vllm = item.get_closest_marker("vllm") is not None
        return vllm, item.path not in slow_files, rank, -tests_per_file[item.path]

    items.sort(key=order)  # stable: each file's tests stay together, in their order


def group_size_for_variant(overrides: list[str]) -> list[str]:
    """Shared test overrides set G as `variant.num_generations` (variant=grpo's); for a STORPO run the same G is its
    plainly sampled group, `variant.fallback_generations` (each variant owns its group's keys)."""
    if "variant=storpo" not in overrides:
        return list(overrides)
    return [o.replace("variant.num_generations=", "variant.fallback_generations=", 1) for o in overrides]


def make_cfg(output_dir: Path, overrides: list[str] | None = None) -> DictConfig:
    """Compose `grpo_lightning/conf/config.yaml` with overrides, as the CLI would, writing into `output_dir`."""
    import grpo_lightning  # noqa: F401 - registers the config's resolvers (hf_decode_dtype), as the CLI does

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra.compose(config_name="config", overrides=group_size_for_variant(overrides or []))  # cached
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
    return cfg


TINY = [
    "model=tiny",
    "trainer.max_epochs=2",
    "generator.max_new_tokens=16",
    "trainer.enable_progress_bar=false",
    # A dense reward so a random model gets non-zero advantages (GSM8K correctness would be 0 everywhere).
    "~reward.terms.gsm8k",
    "+reward.terms.vowels._target_=tests.helpers.VowelFractionReward",
    "optim.optimizer.lr=1e-3",
    "eval.num_problems=4",
]


@pytest.fixture
def tiny_cfg(tmp_path):
    """Factory: a tiny-model config in a fresh output dir, plus extra overrides."""

    counter = iter(range(1000))

    def factory(*overrides: str) -> DictConfig:
        return make_cfg(tmp_path / f"run{next(counter)}", TINY + list(overrides))

    return factory


@pytest.fixture(scope="session")
def tokenizer():
    cache = os.environ.get("GRPO_LIGHTNING_CACHE", "~/.cache/grpo_lightning")
    return _tokenizer_source(cache).load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from grpo_lightning.models.sources import RandomSource

    cache = os.environ.get("GRPO_LIGHTNING_CACHE", "~/.cache/grpo_lightning")
    source = RandomSource(tokenizer_source=_tokenizer_source(cache), seed=0)
    model, _ = source.load(torch.float32)
    return model.eval()


def _tokenizer_source(cache: str):
    """The embedded tokenizer's source; on a machine without the package (a GPU node), the folder that
    GRPO_LIGHTNING_TOKENIZER_DIR names, where the same tokenizer was saved (tests/README.md, GPU tests)."""
    from grpo_lightning.models.sources import PackagedGGUFSource, TokenizerFolder

    if os.environ.get("GRPO_LIGHTNING_TOKENIZER_DIR"):
        return TokenizerFolder(os.environ["GRPO_LIGHTNING_TOKENIZER_DIR"])
    return PackagedGGUFSource(cache_dir=cache)


@pytest.fixture(scope="session", autouse=True)
def _each_model_loaded_once(request):
    """Every test that loads the packaged model or tokenizer gets the first load's objects (the model copied).

    Reading SmolLM2's weights and tokenizer from disk costs seconds; dozens of tests build runs through
    `PackagedGGUFSource`, which now reads each file once per test run. The model is deep-copied for every
    caller, so a test that trains it changes no other test's model. In the fast tier (`-m "not slow"`) any load
    of model weights is an error: that tier promises to load none.
    """
    from grpo_lightning.models.sources import PackagedGGUFSource

    real_load, real_tokenizer = PackagedGGUFSource.load, PackagedGGUFSource.load_tokenizer
    fast_tier = "not slow" in (request.config.getoption("markexpr") or "")
    models, tokenizers = {}, {}

    def load_tokenizer(self):
        key = str(self.converted_dir())
        if key not in tokenizers:
            tokenizers[key] = real_tokenizer(self)
        return tokenizers[key]

    def load(self, dtype, trust_remote_code=False):
        key = (str(self.converted_dir()), dtype)  # a missing package raises its own error first
        if fast_tier:
            raise AssertionError("a test of the fast tier loaded model weights: mark it slow")
        if key not in models:
            models[key] = real_load(self, dtype, trust_remote_code)
        model, tokenizer = models[key]
        return copy.deepcopy(model), tokenizer

    patch = pytest.MonkeyPatch()
    patch.setattr(PackagedGGUFSource, "load", load)
    patch.setattr(PackagedGGUFSource, "load_tokenizer", load_tokenizer)
    yield
    patch.undo()


def random_lm_config(model_type: str, tokenizer, hidden_size: int, heads: int, kv_heads: int):
    """The config of a random 2-layer causal LM for the vLLM tests (which load models from disk): the SmolLM2
    tokenizer's vocabulary and special ids, tied embeddings, an MLP twice the hidden size."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,  # peakier than the default 0.02: samples differ visibly when weights change
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tokenizer) -> Path:
    """A random Llama (hidden 128, 2 heads of 64, 1 KV head, 2 layers) saved with the SmolLM2 tokenizer: the model
    of the vLLM tests (tests/test_vllm.py, tests/test_vllm_resume.py), which vLLM loads from disk."""
    from transformers import AutoModelForCausalLM

    config = random_lm_config("llama", tokenizer, hidden_size=128, heads=2, kv_heads=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
