"""Values as plain data between the grader and its worker: JSON, with tensors as raw bytes (base64).

Never pickle: what the worker sends is decoded into JSON types, tensors, tuples and dicts only, so nothing
it sends can run code in the grader. Tuples, dicts (any key type) and tensors survive the round trip;
anything else the worker's code returns becomes an `Opaque` (its type name and a short repr), which
compares unequal to every expected value. Dataclasses of the package (the inputs of ex03's paged
attention) are decoded only where `rebuild=True` (in the worker, for the inputs the grader sends).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pkgutil
from typing import Any

import torch

MAX_DEPTH = 64
# the only classes the worker rebuilds from the grader's inputs ("module:qualname")
DATACLASSES = ("minirt.attention:PagedAttentionMetadata",)


class Opaque:
    """A value the worker returned that has no plain-data form: kept as its type name and repr."""

    def __init__(self, type_name: str, text: str):
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.type_name}: {self.text}>"

    def __eq__(self, other) -> bool:
        return False

    __hash__ = None


def _tensor(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"$tensor": {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "data": base64.b64encode(raw).decode()}}


def encode(x: Any, depth: int = 0) -> Any:
    """A JSON-ready form of `x`."""
    if depth > MAX_DEPTH:
        return {"$opaque": "nested too deep", "repr": ""}
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x)
    if isinstance(x, torch.Tensor):
        return _tensor(x)
    if isinstance(x, list):
        return [encode(v, depth + 1) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return {"$tuple": [encode(v, depth + 1) for v in x]}
    if isinstance(x, dict):
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    cls = type(x)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if dataclasses.is_dataclass(x) and name in DATACLASSES:
        return {"$dataclass": name, "fields": {f.name: encode(getattr(x, f.name), depth + 1)
                                               for f in dataclasses.fields(x)}}
    try:
        text = repr(x)[:300]
    except Exception:  # noqa: BLE001 - a repr that raises is still an answer: a wrong one
        text = "<repr failed>"
    return {"$opaque": cls.__qualname__ if isinstance(cls.__qualname__, str) else "?", "repr": text}


def _decode_tensor(spec: dict, device) -> torch.Tensor:
    dtype = getattr(torch, str(spec["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {spec['dtype']!r}")
    shape = [int(s) for s in spec["shape"]]
    raw = base64.b64decode(spec["data"])
    numel = 1
    for s in shape:
        numel *= s
    if len(raw) != numel * torch.empty((), dtype=dtype).element_size():
        raise ValueError("tensor data does not match its shape and dtype")
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if numel \
        else torch.empty(shape, dtype=dtype)
    return t.to(device) if device is not None else t


def decode(x: Any, device=None, rebuild: bool = False, depth: int = 0) -> Any:
    """The value `encode` made (tensors moved to `device`); malformed data raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [decode(v, device, rebuild, depth + 1) for v in x]
    if not isinstance(x, dict) or len(x) not in (1, 2):
        raise ValueError(f"not an encoded value: {type(x).__name__}")
    if "$tensor" in x:
        return _decode_tensor(x["$tensor"], device)
    if "$tuple" in x:
        return tuple(decode(v, device, rebuild, depth + 1) for v in x["$tuple"])
    if "$dict" in x:
        out = {}
        for k, v in x["$dict"]:
            key = decode(k, device, rebuild, depth + 1)
            try:
                hash(key)
            except TypeError:
                raise ValueError("unhashable dict key") from None
            out[key] = decode(v, device, rebuild, depth + 1)
        return out
    if "$opaque" in x:
        return Opaque(str(x["$opaque"])[:100], str(x.get("repr", ""))[:300])
    if "$dataclass" in x and rebuild and x["$dataclass"] in DATACLASSES:
        cls = pkgutil.resolve_name(x["$dataclass"])
        return cls(**{k: decode(v, device, rebuild, depth + 1) for k, v in x["fields"].items()})
    raise ValueError(f"not an encoded value: keys {sorted(map(str, x))[:4]}")


def dumps(x: Any) -> bytes:
    """One protocol message: JSON on one line."""
    return json.dumps(x, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> Any:
    return json.loads(line)
