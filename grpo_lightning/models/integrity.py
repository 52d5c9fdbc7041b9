"""Whether the files of a saved model folder are whole, checked before transformers reads them.

A truncated or damaged weights file otherwise surfaces as a `SafetensorError` traceback (or a zip error deep in
`torch.load`) naming no file. The checks read structure, not data, so they cost next to nothing beside a load:

- a safetensors file: its 8-byte header length and JSON header are read (a few KB), and every tensor's byte range
  is checked against its dtype and shape, each range starting where the previous one ended and the last one ending
  where the file does. This is what truncation (an interrupted copy, a full disk, a crash before the data reached
  the disk) and a damaged header break; the tensor whose bytes are missing is named.
- a `pytorch_model*.bin` zip archive (torch >= 1.6): its central directory, at the end of the file, is read.
- a JSON file (config, tokenizer): parsed (~50 ms for a 3.5 MB tokenizer.json).

A flipped bit inside tensor data passes: finding one would take a checksum over every byte on every load (0.6 to
1.2 s for the embedded model's 540 MB, on every run), against the milliseconds these take.
"""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

SAFETENSORS_WEIGHTS = "*.safetensors"
TORCH_WEIGHTS = "pytorch_model*.bin"
MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors library refuses larger headers; a larger length is a damaged one."""
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
"""Bits per element of the safetensors dtypes; a dtype not listed has its byte ranges checked, not their sizes."""


class DamagedFile(ValueError):
    """A file of a saved model whose structure is broken: `path` and what is wrong (`reason`)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} is damaged or truncated: {reason}")
        self.path = path
        self.reason = reason


def check_weights(folder: Path) -> None:
    """Raise DamagedFile for the first weights file of `folder` (a `save_pretrained` folder) that is not whole."""
    for path in sorted(folder.glob(SAFETENSORS_WEIGHTS)):
        check_safetensors(path)
    for path in sorted(folder.glob(TORCH_WEIGHTS)):
        check_torch_archive(path)


def check_saved_files(folder: Path) -> None:
    """Raise DamagedFile for the first JSON file (config, tokenizer, generation config) or weights file of
    `folder` that is not whole."""
    for path in sorted(folder.glob("*.json")):
        check_json(path)
    check_weights(folder)


def check_saved_folder(folder: Path) -> None:
    """Raise DamagedFile unless `folder` holds a config.json and every weights and JSON file in it is whole."""
    if not (folder / "config.json").is_file():
        raise DamagedFile(folder / "config.json", "missing")
    check_saved_files(folder)


def check_json(path: Path) -> None:
    try:
        json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedFile(path, f"not valid JSON ({err})") from None


def check_torch_archive(path: Path) -> None:
    """A zip archive (what torch.save writes) whose central directory is readable; a file of the legacy pickle
    format has no directory to read and passes."""
    with path.open("rb") as file:
        magic = file.read(4)
    if not magic:
        raise DamagedFile(path, "the file is empty")
    if magic != b"PK\x03\x04":
        return
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        raise DamagedFile(path, f"its zip directory cannot be read ({err})") from None


def check_safetensors(path: Path) -> None:
    """The header parses and the tensors' byte ranges tile the data exactly (module docstring)."""
    size = path.stat().st_size
    with path.open("rb") as file:
        length_bytes = file.read(8)
        if len(length_bytes) < 8:
            raise DamagedFile(path, f"{size} bytes, fewer than the 8 that give the header's length")
        length = int.from_bytes(length_bytes, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise DamagedFile(path, f"the header's length reads {length} bytes, the file holds {size - 8} after it")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DamagedFile(path, f"its header is not valid JSON ({err})") from None
    if not isinstance(header, dict):
        raise DamagedFile(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    check_tensor_ranges(path, header, size - 8 - length)


def check_tensor_ranges(path: Path, header: dict, data_bytes: int) -> None:
    """Each tensor's [begin, end) fits its dtype and shape and starts where the previous one ended; the last one
    ends at `data_bytes`, the bytes after the header."""
    entries = [(name, tensor_range(path, name, info)) for name, info in header.items()]
    end = 0
    for name, (begin, stop) in sorted(entries, key=lambda entry: entry[1]):
        if begin != end:
            raise DamagedFile(path, f"tensor {name!r} starts at byte {begin} of the data, the one before ends at {end}")
        if stop > data_bytes:
            raise DamagedFile(
                path, f"tensor {name!r} ends at byte {stop} of the data, the file holds {data_bytes} (truncated)"
            )
        end = stop
    if end != data_bytes:
        raise DamagedFile(path, f"the tensors end at byte {end} of the data, the file holds {data_bytes}")


def tensor_range(path: Path, name: str, info) -> tuple[int, int]:
    """A header entry's (begin, end), checked against its dtype and shape."""
    entry = info if isinstance(info, dict) else {}
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1] and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        and isinstance(dtype, str)
    ):  # fmt: skip
        raise DamagedFile(path, f"the header's entry for tensor {name!r} is malformed ({info!r:.200})")
    begin, stop = offsets
    bits = DTYPE_BITS.get(dtype)
    if bits is not None and (stop - begin) * 8 != math.prod(shape) * bits:
        expected = math.prod(shape) * bits // 8
        raise DamagedFile(
            path, f"tensor {name!r} has {stop - begin} bytes for shape {shape} of {dtype} ({expected} expected)"
        )
    return begin, stop
