"""A damaged model file is named before anything loads (models/integrity.py); a damaged cache entry is converted
again (models/cache.py).

The truth each check is held to is the safetensors library's own reader (and torch.load for a .bin): every file
called damaged here is one it refuses, every file called whole one it reads, and a rebuilt entry holds, bit for
bit, what a fresh conversion and the model itself hold. The tiny random model (tests/conftest.py) stands in for
the converted SmolLM2, so nothing here converts the GGUF.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from grpo_lightning.models.cache import ensure_cached
from grpo_lightning.models.integrity import DamagedFile, check_safetensors, check_weights
from grpo_lightning.models.sources import LocalSource, PackagedGGUFSource


def readable(path: Path) -> bool:
    """Whether the safetensors library reads every tensor of `path`."""
    try:
        with safe_open(path, "pt") as file:
            for key in file.keys():  # noqa: SIM118 - safe_open has no __iter__
                file.get_tensor(key)
    except SafetensorError:
        return False
    return True


def header_of(path: Path) -> tuple[int, dict]:
    """(header length, header) as the format defines them: a little-endian u64, then that many bytes of JSON."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return length, json.loads(raw[8 : 8 + length])


def truncate(path: Path, fraction: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * fraction)])


def garble_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"[}{]"  # the header's first bytes: not JSON any more, the length unchanged
    path.write_bytes(bytes(raw))


def wrong_length(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[:8] = (2**40).to_bytes(8, "little")
    path.write_bytes(bytes(raw))


def dtype_changed(path: Path) -> None:
    """One float32 tensor declared float16 in the header, which keeps its length (the bytes no longer fit)."""
    length, header = header_of(path)
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    header[name]["dtype"] = "F16"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length :])  # (spaces pad a header)


DAMAGES = {"truncated": truncate, "garbled header": garble_header, "header length": wrong_length,
           "dtype changed": dtype_changed, "empty": lambda path: path.write_bytes(b"")}  # fmt: skip


@pytest.fixture
def saved(tmp_path, tiny_model, tokenizer) -> Path:
    """The tiny model and its tokenizer as `save_pretrained` writes them."""
    folder = tmp_path / "saved"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ---- the checks against the safetensors reader ---------------------------------------------------------------------
def test_whole_files_of_every_dtype_pass(tmp_path, saved):
    path = tmp_path / "dtypes.safetensors"
    tensors = {str(dtype): torch.arange(6).reshape(2, 3).to(dtype) for dtype in
               (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
                torch.uint8, torch.int32, torch.float8_e4m3fn)}  # fmt: skip
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, path, metadata={"format": "pt"})
    for whole in (path, saved / "model.safetensors"):
        assert readable(whole)
        check_safetensors(whole)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_the_reader_refuses_is_named(saved, damage):
    path = saved / "model.safetensors"
    DAMAGES[damage](path)
    assert not readable(path)
    with pytest.raises(DamagedFile) as err:
        check_safetensors(path)
    assert err.value.path == path and str(err.value).startswith(f"{path} is damaged or truncated: ")


def test_a_truncated_file_names_the_tensor_the_cut_falls_in(saved):
    path = saved / "model.safetensors"
    length, header = header_of(path)
    cut = path.stat().st_size // 2
    offset = cut - 8 - length  # the cut, as a byte of the data
    ranges = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    (cut_tensor,) = [name for name, (begin, end) in ranges.items() if begin <= offset < end]
    truncate(path)
    with pytest.raises(DamagedFile, match=rf"tensor '{cut_tensor}' ends at byte \d+ of the data, the file holds "
                       rf"{offset} \(truncated\)"):  # fmt: skip
        check_safetensors(path)


def test_a_truncated_torch_archive_is_named(tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.arange(10_000.0)}, path)
    check_weights(tmp_path)
    truncate(path)
    with pytest.raises((RuntimeError, OSError)):  # torch's own reader refuses it too
        torch.load(path)
    with pytest.raises(DamagedFile, match=r"pytorch_model.bin is damaged or truncated: its zip directory"):
        check_weights(tmp_path)


# ---- model=local ---------------------------------------------------------------------------------------------------
def test_a_truncated_local_model_is_one_line_naming_the_file_exit_2(tmp_path, saved):
    from tests.test_bad_input import assert_clean_failure, cli

    truncate(saved / "model.safetensors")
    result = cli("model=local", f"model.source.path={saved}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_failure(result, code=2)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.source.path: {saved / 'model.safetensors'} is damaged or truncated: tensor")
    assert "(truncated)" in line and "save_pretrained" in line


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_file_of_a_local_model_is_one_line_naming_it(tmp_path, saved, name):
    """The truth: transformers' own tokenizer loader refuses the truncated file (with a traceback naming none)."""
    from transformers import AutoTokenizer

    from tests.test_bad_input import assert_clean_failure, cli

    truncate(saved / name)
    with pytest.raises(Exception):  # noqa: B017 (whatever transformers raises: the point is that it refuses)
        AutoTokenizer.from_pretrained(saved)
    result = cli("model=local", f"model.source.path={saved}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_failure(result, code=2)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.source.path: {saved / name} is damaged or truncated: not valid JSON")


def test_a_damaged_local_model_is_refused_by_load_too(saved):
    source = LocalSource(path=str(saved))
    source.check_available()  # whole: passes
    garble_header(saved / "model.safetensors")
    with pytest.raises(ValueError, match=r"^model.source.path: .*model.safetensors is damaged .* not valid JSON"):
        source.load(torch.float32)


# ---- the cache -----------------------------------------------------------------------------------------------------
def faked_source(cache: Path, model, tokenizer) -> PackagedGGUFSource:
    """The packaged source whose conversion yields the tiny model (the save and the cache are real)."""
    source = PackagedGGUFSource(cache_dir=str(cache))
    source._build_plain_model = lambda: (model, tokenizer)
    return source


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


CACHE_DAMAGES = {  # (every kind of damage to a weights file is held to the reader above)
    "weights truncated": lambda folder: truncate(folder / "model.safetensors"),
    "weights header garbled": lambda folder: garble_header(folder / "model.safetensors"),
    "tokenizer.json truncated": lambda folder: truncate(folder / "tokenizer.json"),
    "config.json removed": lambda folder: (folder / "config.json").unlink(),
}


@pytest.mark.parametrize("damage", list(CACHE_DAMAGES))
def test_a_damaged_cache_entry_is_rebuilt_with_a_fresh_conversions_tensors(tmp_path, tiny_model, tokenizer, caplog,
                                                                           damage):  # fmt: skip
    source = faked_source(tmp_path / "cache", tiny_model, tokenizer)
    folder = source.ensure_converted()
    fresh = faked_source(tmp_path / "fresh", tiny_model, tokenizer).ensure_converted()
    CACHE_DAMAGES[damage](folder)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.models.cache"):
        assert source.ensure_converted() == folder
    (record,) = [r for r in caplog.records if r.name == "grpo_lightning.models.cache"]
    assert str(folder) in record.getMessage() and "again" in record.getMessage()
    rebuilt, expected = load_file(folder / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert rebuilt.keys() == expected.keys()
    assert all(rebuilt[k].dtype == expected[k].dtype and bits(rebuilt[k]) == bits(expected[k]) for k in expected)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    truth = tiny_model.state_dict()
    assert all(bits(p) == bits(truth[k]) for k, p in model.state_dict().items())
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([folder.name, f"{folder.name}.lock"])


def test_a_rebuild_damaged_again_is_one_line_naming_the_file(tmp_path, tiny_model, tokenizer):
    def write(folder: Path) -> None:
        tiny_model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        truncate(folder / "model.safetensors")  # a disk that loses the end of what is written

    target = tmp_path / "cache" / "entry"
    ensure_cached(target, write, origin="the.gguf")  # a first conversion is read, and checked, at its next use
    with pytest.raises(ValueError) as err:
        ensure_cached(target, write, origin="the.gguf")
    message = str(err.value)
    assert message.startswith(f"paths.cache_dir: {target / 'model.safetensors'} is damaged again right after")
    assert "\n" not in message and "the.gguf" in message and "GRPO_LIGHTNING_CACHE" in message


def test_a_rebuild_that_fails_names_the_damaged_file(tmp_path, saved):
    target = tmp_path / "cache" / "entry"
    target.parent.mkdir()
    saved.rename(target)
    truncate(target / "model.safetensors")

    def write(folder: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(ValueError) as err:
        ensure_cached(target, write, origin="the.gguf")
    message = str(err.value)
    assert message.startswith(f"paths.cache_dir: {target / 'model.safetensors'} was damaged (tensor")
    assert "converting the.gguf again failed (OSError: [Errno 28] No space left on device)" in message
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == ["entry.lock"]


def test_two_processes_finding_the_same_damage_rebuild_once(tmp_path, saved, caplog):
    """Two threads stand for two processes: each holds the lock file through its own descriptor, which the
    kernel's flock excludes as it does another process's."""
    target = tmp_path / "cache" / "entry"
    target.parent.mkdir()
    saved.rename(target)
    expected = (target / "model.safetensors").read_bytes()
    truncate(target / "model.safetensors")
    writes, start = [], threading.Barrier(2)

    def write(folder: Path) -> None:
        writes.append(folder)
        folder.mkdir()
        for name in ("config.json", "tokenizer.json"):
            (folder / name).write_text("{}")
        time.sleep(0.5)  # long enough for the other thread to find the damage and wait for the lock
        (folder / "model.safetensors").write_bytes(expected)

    def use() -> None:
        start.wait()
        results.append(ensure_cached(target, write, origin="the.gguf"))

    results: list[Path] = []
    threads = [threading.Thread(target=use) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="grpo_lightning.models.cache"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert results == [target, target] and len(writes) == 1
    assert (target / "model.safetensors").read_bytes() == expected
    assert len([r for r in caplog.records if r.name == "grpo_lightning.models.cache"]) == 1


def test_an_entry_vanishing_during_the_unlocked_check_is_asked_again_under_the_lock(tmp_path, saved, monkeypatch):
    """Another process moving a damaged entry aside while this one reads it (a file gone mid-check) is no error:
    the entry is checked again under the lock, found whole, and neither written nor warned about."""
    from grpo_lightning.models import cache

    target = tmp_path / "cache" / "entry"
    target.parent.mkdir()
    saved.rename(target)
    real, calls = cache.check_saved_folder, []

    def vanishing_once(folder):
        calls.append(folder)
        if len(calls) == 1:
            raise FileNotFoundError(folder / "tokenizer_config.json")
        return real(folder)

    monkeypatch.setattr(cache, "check_saved_folder", vanishing_once)
    written = []
    assert ensure_cached(target, written.append, origin="the.gguf") == target
    assert written == [] and len(calls) == 2
