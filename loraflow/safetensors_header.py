"""What a .safetensors file says it holds, read from its header alone, and checked before anything loads the file.

The format (huggingface/safetensors README): 8 bytes of header length N (little-endian), N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the tensors' bytes. A corrupt
or hostile file (a header length of 2^40, a header that is not JSON, offsets past the end) then fails in one message
naming it, in `loraflow check` as in the stage that reads it, instead of a MemoryError or a loader's traceback minutes
later. Cheap: the tensors' bytes are never read (but by `non_finite_tensors`, which tests a float file's values by
their bits). No torch here: config validation uses it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (MAX_HEADER_SIZE, safetensors/src/tensor.rs)
# Bounds of one file, counted in the header's bytes before it is parsed (a header of 10^6 tensors fits in 100 MB and
# costs 800 MB and 10-30 s to parse in every process that reads it). The largest released component file holds a few
# thousand tensors (a shard of Kandinsky 6 Pro's transformer); a LoRA of every linear layer of it a few thousand more.
MAX_TENSORS = 100_000
MAX_DIMS = 8  # a tensor's dimensions: weights have 1-5 (a 3D convolution's)
MAX_NAME_CHARS = 1000  # a tensor's name: a module path of a few hundred at most
# Bytes per element of every dtype safetensors' torch binding reads (safetensors 0.8, safetensors/torch.py `_TYPES`).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1,
               "F8_E5M2FNUZ": 1, "C64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
               "U8": 1, "BOOL": 1}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what an adapter's weights are (peft trains and saves these)


class UnreadableSafetensors(ValueError):
    """A file that is no readable safetensors file: the message names it and what is wrong."""


def read_header(path: str | Path, key: str = "") -> dict[str, Any]:
    """The file's header (tensor entries and `__metadata__`), once it is known to describe this file: a JSON object
    of at most MAX_HEADER_BYTES and MAX_TENSORS tensors, every tensor of a known dtype, at most MAX_DIMS dimensions,
    none empty, whose bytes lie inside the file, match its shape and follow the tensor before it, the last ending
    where the file does.
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
        raw = f.read(length)
    tensors = raw.count(b'"data_offsets"')  # an upper bound of the entries, counted before anything is parsed
    if tensors > MAX_TENSORS:
        raise unreadable(f"its header lists {tensors} tensors; loraflow reads at most {MAX_TENSORS} per file (the "
                         "largest released model file holds a few thousand)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise unreadable(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    data_bytes = size - 8 - length
    end = 0  # safetensors' own rule (Metadata::validate): the tensors' bytes follow one another and fill the data
    for name, entry in sorted(tensor_entries(header).items(), key=lambda item: _begin(item[1])):
        problem = _entry_problem(name, entry, data_bytes)
        if not problem and entry["data_offsets"][0] != end:
            problem = (f"begins at byte {entry['data_offsets'][0]} of the data, where the tensor before it ends at "
                       f"{end} ({'overlapping it' if entry['data_offsets'][0] < end else 'a gap'})")
        if problem:
            raise unreadable(f"tensor {name[:80]!r} {problem}")
        end = entry["data_offsets"][1]
    if end != data_bytes:
        raise unreadable(f"its tensors hold {end} bytes of the {data_bytes} after the header")
    return header


def _begin(entry: Any) -> int:
    """Where an entry's bytes begin, for sorting (a malformed entry sorts first and is refused there)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets[0] if isinstance(offsets, list) and offsets and isinstance(offsets[0], int) else -1


def _entry_problem(name: str, entry: Any, data_bytes: int) -> str:
    """Why a header entry cannot be a tensor of a file with `data_bytes` bytes of data ("" when it can)."""
    if len(name) > MAX_NAME_CHARS:
        return f"has a name of {len(name)} characters; loraflow reads names of at most {MAX_NAME_CHARS}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return "lacks dtype, shape or data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return f"has dtype {str(dtype)[:40]!r}, none of {', '.join(DTYPE_BYTES)}"
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"has shape {str(shape)[:60]}, not a list of at most {MAX_DIMS} sizes"
    if 0 in shape:  # no weight has an empty dimension: an extra entry a loader trips over later
        return f"has shape {shape}: it holds no values (no weight has an empty dimension)"
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


# Each float dtype's exponent bits as an unsigned integer of its width: all of them set is an infinity or a NaN.
_EXPONENT_BITS = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
                  "BF16": ("<u2", 0x7F80)}
_CHUNK = 1 << 22  # values tested at a time: a hostile file's one huge tensor costs tens of MiB at most


def non_finite_tensors(path: str | Path, header: dict[str, Any]) -> dict[str, int]:
    """Of a float file's tensors (`read_adapter_header`'s header), those holding NaN or inf and how many each holds,
    read by their bits (numpy, no torch: `check` reads an adapter's values so)."""
    import numpy as np

    found = {}
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
        for name, entry in tensor_entries(header).items():
            dtype, mask = _EXPONENT_BITS[entry["dtype"]]
            width = np.dtype(dtype).itemsize
            begin, end = entry["data_offsets"]
            count = 0
            for offset in range(begin, end, _CHUNK * width):
                f.seek(start + offset)
                values = np.frombuffer(f.read(min(_CHUNK * width, end - offset)), dtype)
                count += int(np.count_nonzero((values & np.array(mask, dtype)) == mask))
            if count:
                found[name] = count
    return found


def non_finite_problem(path: str | Path, key: str, header: dict[str, Any], fix: str) -> str:
    """`key` FILE: how many of its tensors hold NaN or inf, one named ("" when none does); `fix`: what to do."""
    broken = non_finite_tensors(path, header)
    if not broken:
        return ""
    name, count = next(iter(broken.items()))
    total = math.prod(header[name]["shape"])
    return (f"`{key}` {path}: {len(broken)} tensor(s) hold NaN or infinite values (e.g. {name}: {count} of {total}): "
            f"the file is broken; {fix}")
