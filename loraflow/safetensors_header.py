"""What a .safetensors file says it holds, read from its header alone, and checked before anything loads the file.

The format (huggingface/safetensors README): 8 bytes of header length N (little-endian), N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the tensors' bytes. A corrupt
or hostile file (a header length of 2^40, a header that is not JSON, offsets past the end) then fails in one message
naming it, in `loraflow check` as in the stage that reads it, instead of a MemoryError or a loader's traceback minutes
later. Cheap: the tensors' bytes are never read. No torch here: config validation uses it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE, safetensors/src/tensor.rs)
# Bytes per element of every dtype safetensors' torch binding reads (safetensors 0.8, safetensors/torch.py `_TYPES`).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
               "F8_E5M2FNUZ": 1, "C64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
               "U8": 1, "BOOL": 1}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what an adapter's weights are (peft trains and saves these)


class UnreadableSafetensors(ValueError):
    """A file that is no readable safetensors file: the message names it and what is wrong."""


def read_header(path: str | Path, key: str = "") -> dict[str, Any]:
    """The file's header (tensor entries and `__metadata__`), once it is known to describe this file: a JSON object
    of at most MAX_HEADER_BYTES, every tensor of a known dtype whose bytes lie inside the file and match its shape.
    `key`: the config key that named the file, for the message."""
    path = Path(path)
    named = f"`{key}` {path}" if key else str(path)

    def unreadable(why: str) -> UnreadableSafetensors:
        return UnreadableSafetensors(f"{named} is not a readable safetensors file: {why}. Download or export it "
                                     "again (a partial download or a renamed file of another format reads so)")

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        length = int.from_bytes(f.read(8), "little")
        if size < 8:
            raise unreadable(f"{size} bytes, fewer than the 8 of its header length")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise unreadable(f"its header length says {length} bytes; the file holds {size - 8} after it, and "
                             f"safetensors reads at most {MAX_HEADER_BYTES}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise unreadable(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        problem = "" if name == "__metadata__" else _entry_problem(entry, data_bytes)
        if problem:
            raise unreadable(f"tensor {name!r} {problem}")
    return header


def _entry_problem(entry: Any, data_bytes: int) -> str:
    """Why a header entry cannot be a tensor of a file with `data_bytes` bytes of data ("" when it can)."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return "lacks dtype, shape or data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        return f"has dtype {dtype!r}, none of {', '.join(DTYPE_BYTES)}"
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"has shape {shape!r}, not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"has data_offsets {offsets!r}, outside the file's {data_bytes} bytes of data"
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != needed:
        return f"holds {offsets[1] - offsets[0]} bytes; {dtype} {shape} is {needed}"
    return ""


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def read_adapter_header(path: str | Path, key: str) -> dict[str, Any]:
    """`read_header` of a LoRA file a config names (`init_lora`, `validation_adapter_path`): a .safetensors file
    (pickles are never read: they can run code when loaded) whose tensors are all floating point."""
    if not str(path).endswith(".safetensors"):
        raise UnreadableSafetensors(f"`{key}` {str(path)!r} is not a .safetensors file: loraflow reads LoRA files "
                                    "as safetensors only (a pickled .pt/.bin/.ckpt can run code when loaded); convert "
                                    "it with safetensors, or give the diffusers/peft .safetensors export")
    header = read_header(path, key)
    other = {n: e["dtype"] for n, e in tensor_entries(header).items() if e["dtype"] not in FLOAT_DTYPES}
    if other:
        name, dtype = next(iter(other.items()))
        raise UnreadableSafetensors(f"`{key}` {path}: {len(other)} tensor(s) are not floating point (e.g. {name!r} "
                                    f"is {dtype}): not a LoRA's weights, which are {', '.join(FLOAT_DTYPES)}")
    return header
