"""Symmetric weight-only quantization: int8 and FP8 (e4m3), one scale per output channel or per B x B block.

A weight `W [N, K]` (N output channels, K input channels) is stored as `q [N, K]` in int8 or `torch.float8_e4m3fn`
and float32 scales, with `W ~ q * scale` broadcast over the group each scale covers:

* per channel (`block_size=None`): `scale [N]`, one per output row, `amax(|W[n, :]|) / QMAX`;
* per block (`block_size=B`): `scale [ceil(N/B), ceil(K/B)]`, one per B x B tile, `amax(|tile|) / QMAX`; edge tiles
  may be partial. This is the layout of the FP8 checkpoints of DeepSeek-V3 and Qwen3 (`weight_block_size: [128,
  128]`), whose scale tensors are named `weight_scale_inv`: they multiply, as `scale` does here.

QMAX is the largest value the format holds: 127 for int8 (symmetric: -128 is never used), 448 for e4m3. int8 rounds
to a uniform grid of step `scale`; e4m3 rounds to 3 mantissa bits, so its relative error is about the same (2^-4)
for every magnitude above its subnormals, while int8's is smallest for the largest values of the group.
Symmetric absmax scaling is the scheme of vLLM's "fp8" dynamic quantization and of LLM.int8()'s weights
(Dettmers et al. 2022), per channel; block scales follow DeepSeek-V3 (DeepSeek-AI 2024, section 3.3).
"""

from __future__ import annotations

import torch

METHODS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": float(torch.finfo(torch.float8_e4m3fn).max)}
STORAGE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# The smallest scale used: an all-zero group gets this scale, so its zeros dequantize to exact zeros.
MIN_SCALE = 1e-12


def method_of(dtype: torch.dtype) -> str:
    """The method whose storage dtype is `dtype` ("int8" or "fp8"). Raises ValueError for any other dtype."""
    for method, storage in STORAGE_DTYPE.items():
        if dtype == storage:
            return method
    raise ValueError(f"weight: a quantized weight is int8 or float8_e4m3fn, got {dtype}")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"quantization: must be one of {METHODS}, got {method!r}")


def scale_shape(shape: tuple[int, int], block_size: int | None) -> tuple[int, ...]:
    """The shape of the scales of a `[N, K]` weight: `(N,)` per channel, `(ceil(N/B), ceil(K/B))` per block."""
    n, k = shape
    if block_size is None:
        return (n,)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"weight_block_size: must be an integer >= 1 or None, got {block_size!r}")
    return (-(n // -block_size), -(k // -block_size))


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: int | None) -> torch.Tensor:
    """The scales broadcast to one per weight element, `[N, K]` (per channel: `[N, 1]`, which broadcasts)."""
    n, k = shape
    if block_size is None:
        return scale[:, None]
    return scale.repeat_interleave(block_size, 0)[:n].repeat_interleave(block_size, 1)[:, :k]


def group_amax(weight: torch.Tensor, block_size: int | None) -> torch.Tensor:
    """`max |W|` over each scale's group, float32, in the scales' shape (see `scale_shape`)."""
    w = weight.detach().float().abs()
    if block_size is None:
        return w.amax(dim=1)
    n, k = w.shape
    rows, cols = scale_shape((n, k), block_size)
    padded = torch.zeros(rows * block_size, cols * block_size, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(rows, block_size, cols, block_size).amax(dim=(1, 3))


def quantize(weight: torch.Tensor, method: str, block_size: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`W [N, K]` (any float dtype) -> `(q [N, K]` int8 or float8_e4m3fn, `scale` float32 in `scale_shape`).

    `scale = amax / QMAX` over each group; `q = round(W / scale)` clamped to [-127, 127] for int8,
    `(W / scale).to(float8_e4m3fn)` (round to nearest even) for fp8. Raises ValueError for an unknown method, a
    weight that is not 2-D, or a bad block_size.
    """
    check_method(method)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}")
    scale = (group_amax(weight, block_size) / QMAX[method]).clamp(min=MIN_SCALE)
    scaled = weight.detach().float() / expand_scale(scale, tuple(weight.shape), block_size)
    if method == "int8":
        q = scaled.round().clamp(-QMAX["int8"], QMAX["int8"]).to(torch.int8)
    else:
        q = scaled.clamp(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block_size: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q [N, K]`, `scale` (see `scale_shape`) -> `q * scale` in float32, then cast to `dtype`, `[N, K]`.

    Raises ValueError when `scale`'s shape is not the one `block_size` gives for `q`'s shape."""
    method_of(q.dtype)
    expected = scale_shape(tuple(q.shape), block_size)
    if tuple(scale.shape) != expected:
        raise ValueError(f"weight_scale: expected shape {expected} for a {tuple(q.shape)} weight with "
                         f"weight_block_size={block_size}, got {tuple(scale.shape)}")
    w = q.float() * expand_scale(scale.float(), tuple(q.shape), block_size)
    return w.to(dtype)
