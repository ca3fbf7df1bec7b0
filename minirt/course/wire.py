"""Values as plain data between the grader and its worker: JSON, with tensors as raw bytes (base64).

Never pickle: what the worker sends is decoded into JSON types, tensors, tuples and dicts only, so nothing
it sends can run code in the grader. Decoding is strict and bounded (`parse`, `decode`): a message nests at most
`MAX_DEPTH` deep (checked before `json.loads` sees it), a tensor has a dtype of `DTYPES`, at most `MAX_NDIM`
non-negative dimensions and `MAX_NUMEL` elements, and its bytes match its shape; anything else raises ValueError. Tuples, dicts (any key type) and tensors survive the round trip;
anything else the worker's code returns becomes an `Opaque` (its type name and a short repr), which
compares unequal to every expected value. Dataclasses of the package (the inputs of ex03's paged
attention) are decoded only where `rebuild=True` (in the worker, for the inputs the grader sends).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pkgutil
import re
from typing import Any

import torch

MAX_DEPTH = 64
MAX_NDIM = 8
MAX_NUMEL = 1 << 24
DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
DICT_KEYS = (str, int, float, bool, type(None), tuple)
# the only classes the worker rebuilds from the grader's inputs ("module:qualname")
DATACLASSES = ("minirt.attention:PagedAttentionMetadata", "minirt.request:StreamDelta",
               "minirt.request:RequestOutput", "minirt.request:RequestMetrics")
# torch modules the worker rebuilds from the grader's inputs: their constructor arguments and their tensors
MODULES = {"torch.nn:Linear": (("in_features", "out_features"), ("weight", "bias")),
           "torch.nn:Embedding": (("num_embeddings", "embedding_dim"), ("weight",))}


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
    if isinstance(x, tuple):               # a namedtuple too: the check compares it as the tuple it is
        return {"$tuple": [encode(v, depth + 1) for v in x]}
    if isinstance(x, dict):
        return {"$dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    cls = type(x)
    name = f"{cls.__module__}:{cls.__qualname__}"
    if type(x) in (torch.nn.Linear, torch.nn.Embedding):
        name = f"torch.nn:{cls.__name__}"
        args, tensors = MODULES[name]
        kw = {a: int(getattr(x, a)) for a in args}
        if name == "torch.nn:Linear":
            kw["bias"] = x.bias is not None
        return {"$module": name, "args": kw,
                "tensors": {t: encode(getattr(x, t).detach(), depth + 1) for t in tensors if getattr(x, t) is not None}}
    if dataclasses.is_dataclass(x) and name in DATACLASSES:
        return {"$dataclass": name, "fields": {f.name: encode(getattr(x, f.name), depth + 1)
                                               for f in dataclasses.fields(x)}}
    try:
        text = repr(x)[:300]
    except Exception:  # noqa: BLE001 - a repr that raises is still an answer: a wrong one
        text = "<repr failed>"
    return {"$opaque": cls.__qualname__ if isinstance(cls.__qualname__, str) else "?", "repr": text}


def _decode_tensor(spec: Any, device) -> torch.Tensor:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise ValueError("a tensor needs exactly dtype, shape and data")
    if spec["dtype"] not in DTYPES:
        raise ValueError(f"dtype not allowed: {str(spec['dtype'])[:40]!r}")
    dtype = getattr(torch, spec["dtype"])
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or \
            not all(type(s) is int and 0 <= s <= MAX_NUMEL for s in shape):
        raise ValueError(f"bad tensor shape (at most {MAX_NDIM} non-negative dimensions)")
    numel = 1
    for s in shape:
        numel *= s
    if numel > MAX_NUMEL:
        raise ValueError(f"tensor too large ({numel} elements, at most {MAX_NUMEL})")
    if not isinstance(spec["data"], str):
        raise ValueError("tensor data must be base64 text")
    try:
        raw = base64.b64decode(spec["data"], validate=True)
    except (ValueError, TypeError):
        raise ValueError("tensor data is not base64") from None
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
    if not isinstance(x, dict) or len(x) not in (1, 2, 3):
        raise ValueError(f"not an encoded value: {type(x).__name__}")
    if "$dict" in x and not (isinstance(x["$dict"], list) and all(isinstance(kv, list) and len(kv) == 2
                                                                  for kv in x["$dict"])):
        raise ValueError("a dict is a list of [key, value] pairs")
    if "$tuple" in x and not isinstance(x["$tuple"], list):
        raise ValueError("a tuple is a list of values")
    if "$tensor" in x:
        return _decode_tensor(x["$tensor"], device)
    if "$tuple" in x:
        return tuple(decode(v, device, rebuild, depth + 1) for v in x["$tuple"])
    if "$dict" in x:
        out = {}
        for k, v in x["$dict"]:
            key = decode(k, device, rebuild, depth + 1)
            if not _plain_key(key):
                raise ValueError("a dict key must be a string, number, None or a tuple of them")
            out[key] = decode(v, device, rebuild, depth + 1)
        return out
    if "$opaque" in x:
        return Opaque(str(x["$opaque"])[:100], str(x.get("repr", ""))[:300])
    if "$module" in x and rebuild and x["$module"] in MODULES and set(x) == {"$module", "args", "tensors"}:
        return _module(x, device, depth)
    if "$dataclass" in x and rebuild and x["$dataclass"] in DATACLASSES:
        cls = pkgutil.resolve_name(x["$dataclass"])
        return cls(**{k: decode(v, device, rebuild, depth + 1) for k, v in x["fields"].items()})
    raise ValueError(f"not an encoded value: keys {sorted(map(str, x))[:4]}")


def _module(x: dict, device, depth: int) -> torch.nn.Module:
    """An nn.Linear / nn.Embedding as the grader built it: constructed from its arguments, its tensors copied in,
    no gradients (as the checks make them)."""
    cls = pkgutil.resolve_name(x["$module"])
    module = cls(**x["args"]).requires_grad_(False)
    with torch.no_grad():
        for name, value in x["tensors"].items():
            getattr(module, name).copy_(decode(value, None, True, depth + 1))
    return module.to(device) if device is not None else module


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return isinstance(key, DICT_KEYS)


def nesting_ok(line: bytes, limit: int = MAX_DEPTH + 8) -> bool:
    """Whether the JSON text `line` nests at most `limit` brackets deep (strings skipped), in C-speed passes so that
    `json.loads` never recurses deeper than that on what the worker sent."""
    import numpy as np

    text = re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', line)
    a = np.frombuffer(text, dtype=np.uint8)
    if a.size == 0:
        return True
    step = (a == ord("[")).astype(np.int32) + (a == ord("{")) - (a == ord("]")) - (a == ord("}"))
    return int(np.cumsum(step).max()) <= limit


def parse(line: bytes) -> Any:
    """One protocol message from the worker, bounded: ValueError when it nests too deep or is not JSON."""
    if not nesting_ok(line):
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deep") from None


def dumps(x: Any) -> bytes:
    """One protocol message: JSON on one line."""
    return json.dumps(x, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> Any:
    return json.loads(line)
