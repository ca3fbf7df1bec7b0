"""A decode step's attention side in one CUDA kernel (Hopper): q/k norm and rotation, the K/V write, split-KV
attention and the splits' combine, where the Triton path launches three kernels (`rotary_triton`'s
`norm_rotate_and_store_triton`, then `paged_attention_triton`'s split-KV kernel and its combine). A probe, not used
by the engine: in the engine at batch 1 it measured 1.261x slower than the three Triton kernels (0.7941 against
0.6298 ms TPOT, every run), and `lab/probes/decode_attention.py` times it between the GEMVs around it
(lab/pages/decode-attention-cuda.md has the figures and what they say).

Each (sequence, KV head) gets a thread block cluster of `num_splits` blocks, each taking one contiguous share of the
keys as the Triton split-KV kernel does; the blocks of a cluster combine their partial softmax results through
distributed shared memory (`decode_attention_cuda.cu` says how), so neither a second kernel nor a trip of the
partials through global memory separates attention from o_proj. Every block normalizes and rotates its query group
itself; the block whose share holds the new position also rotates the new key and writes it and the value to their
cache slot. With PDL the kernel loads the metadata, cos/sin, the norms' weights and its first tile of earlier
steps' keys and values before it waits for the q/k/v projection.

Arithmetic as the Triton path's: the norm and rotation in float32, rounded to the model's dtype after each op as
eager torch rounds (`rotary_triton`); q.k and p.v in float32 with the weights rounded to the dtype before p.v, as
`tl.dot` takes them. The sums run in another order, so results agree with the Triton path to rounding, not bit for
bit. Built on first use by nvcc for each (dtype, head dim, query group); needs compute capability 9.0 and nvcc.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lab.kernels.nvcc_build import build_library, hopper_nvcc_missing

SOURCE = Path(__file__).with_name("decode_attention_cuda.cu")
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
HEAD_DIMS = (16, 32, 64, 128)
GROUPS = (1, 2, 4, 8)
MAX_SPLITS = 16            # a cluster's blocks at most (16: the non-portable cluster size Hopper allows)
THREADS = 256              # a block's threads (decode_attention_cuda.cu's THREADS)


def decode_attention_missing(device: torch.device, dtype: torch.dtype, head_dim: int, group: int,
                             rotary_dim: int) -> list[str]:
    """What the kernel needs for a model and does not have here (empty: it can run): a Hopper GPU and nvcc, bf16 or
    float32, a head dim of 16, 32, 64 or 128 rotated whole, and 1, 2, 4 or 8 query heads per KV head."""
    missing = hopper_nvcc_missing(device)
    for need, ok in ((f"bf16 or float32 (got {dtype})", dtype in DTYPES),
                     (f"a head dim in {HEAD_DIMS} (got {head_dim})", head_dim in HEAD_DIMS),
                     (f"the whole head rotated (rotary dim {rotary_dim} of {head_dim})", rotary_dim == head_dim),
                     (f"query heads per KV head in {GROUPS} (got {group})", group in GROUPS)):
        if not ok:
            missing.append(need)
    return missing


@functools.lru_cache(maxsize=None)
def library(dtype_name: str, head_dim: int, group: int, arch: str = "sm_90", skip: int = 0) -> ctypes.CDLL:
    """The kernel for one (dtype, head dim, query group), built by `build_library` (a few seconds the first time).
    skip: leave out parts, for benchmarks (the source's MINIRT_SKIP: 1 the cluster's combine, 2 the q/k norm and
    rotation, 4 with 1: no clusters)."""
    flags = ["-O3", f"-arch={arch}", "-std=c++17", "-lineinfo", f"-DMINIRT_T_{dtype_name}",
             f"-DMINIRT_D={head_dim}", f"-DMINIRT_G={group}", f"-DMINIRT_SKIP={skip}"]
    lib = build_library(SOURCE, flags, f"decode_attention_cuda-{arch}-{dtype_name}-{head_dim}-{group}-{skip}")
    lib.minirt_decode_attention_launch.restype = ctypes.c_int
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_float, ctypes.c_int
    lib.minirt_decode_attention_launch.argtypes = [
        ptr, ptr, ptr, i64, i64, i64,            # q, k, v and their token strides
        ptr, ptr, i64, ptr, ptr, f32, f32,       # cos, sin, their token stride, the norms' weights, eps, scale
        ptr, ptr, i64, ptr,                      # k_cache, v_cache, slot stride, slot_mapping
        ptr, i64, ptr, i32,                      # block_tables, its row stride, context_lens, block_size
        ptr, i64, i32, i32, i32, i32, ptr]       # out, its token stride, seqs, KV heads, splits, pdl, stream
    lib.minirt_decode_attention_max_clusters.restype = ctypes.c_int
    lib.minirt_decode_attention_max_clusters.argtypes = [ctypes.c_int]
    lib.minirt_decode_attention_error.restype = ctypes.c_char_p
    lib.minirt_decode_attention_error.argtypes = [ctypes.c_int]
    return lib


def min_splits(group: int, head_dim: int) -> int:
    """The fewest blocks a cluster may have: the combine gives each block's THREADS threads one output each of the
    query group's group * head_dim."""
    return -(-group * head_dim // THREADS)


def choose_splits(num_seqs: int, num_kv_heads: int, group: int, head_dim: int, device: torch.device) -> int:
    """Blocks per cluster: as many as the Triton split-KV kernel's programs per (sequence, KV head)
    (`paged_attention_triton.splits_for`: at least twice the GPU's SMs in all), at most MAX_SPLITS, at least
    `min_splits`."""
    from minirt.kernels.paged_attention_triton import splits_for

    return max(min_splits(group, head_dim), min(MAX_SPLITS, splits_for(num_seqs * num_kv_heads, device)))


def decode_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, *, num_splits: int | None = None,
                          pdl: bool = False, skip: int = 0) -> torch.Tensor:
    """One decode step's attention for `num_seqs` sequences of one new token each, from the raw projections.

    q `[1, T, H, D]`, k and v `[1, T, Hkv, D]` (each token's heads contiguous; tokens evenly strided, as slices of
    the merged q/k/v projection are), T = num_seqs; cos/sin `[1, T, D]` (rows evenly strided; cos and sin alike);
    q_weight/k_weight `[D]` (the q/k RMSNorm) or both None; k_cache/v_cache `[num_blocks, block_size, Hkv, D]`;
    slot_mapping `[T]` int64 (where each new K/V goes); block_tables `[num_seqs, max_blocks]` and context_lens
    `[num_seqs]` int64, context_lens counting the new token, so at least 1
    (`minirt.attention.PagedAttentionMetadata`). Writes the rotated k and v to their slots and returns the
    attention output `[1, T, H, D]`, contiguous, in q's dtype: `norm_rotate_and_store_triton` followed by
    `paged_attention_triton` on a decode batch, to rounding.

    num_splits: blocks per (sequence, KV head), a power of two from `min_splits` up to MAX_SPLITS (None:
    `choose_splits`). pdl: launch with programmatic dependent launch, as the Triton kernels do. skip: `library`'s
    (benchmarks only). Raises ValueError naming the argument for shapes, dtypes, devices or layouts the kernel does
    not take, and naming q where this machine or model cannot run it (`decode_attention_missing`); RuntimeError if
    the launch fails."""
    _, T, H, D = q.shape
    Hkv = k.shape[2]
    num_seqs = context_lens.shape[0]
    group = H // Hkv if Hkv and H % Hkv == 0 else 0
    if q.shape[0] != 1 or T != num_seqs:
        raise ValueError(f"q: must be [1, num_seqs, H, D] with one token per sequence ({num_seqs}), "
                         f"got {tuple(q.shape)}")
    for name, x, heads in (("q", q, H), ("k", k, Hkv), ("v", v, Hkv)):
        if (x.shape != (1, T, heads, D) or x.dtype != q.dtype or x.device != q.device or x.stride(3) != 1
                or x.stride(2) != D):
            raise ValueError(f"{name}: must be {q.dtype} [1, {T}, {heads}, {D}] on {q.device}, each token's heads "
                             f"contiguous, got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    for name, x in (("cos", cos), ("sin", sin)):
        if (x.shape != (1, T, D) or x.dtype != q.dtype or x.device != q.device or x.stride(2) != 1
                or x.stride(1) != cos.stride(1)):
            raise ValueError(f"{name}: must be {q.dtype} [1, {T}, {D}] on {q.device}, rows evenly strided like cos, "
                             f"got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight/k_weight: give both or neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (D,) or w.dtype != q.dtype or w.device != q.device or not w.is_contiguous()):
            raise ValueError(f"{name}: must be a contiguous {q.dtype} [{D}] on {q.device}, got {w.dtype} "
                             f"{tuple(w.shape)} on {w.device}")
    block_size = k_cache.shape[1] if k_cache.dim() == 4 else 0
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (x.dim() != 4 or x.shape[2:] != (Hkv, D) or x.dtype != q.dtype or x.device != q.device or x.stride(3) != 1
                or x.stride(2) != D or x.stride(1) != k_cache.stride(1) or x.stride(1) % max(1, D // 4)
                or x.stride(0) != block_size * x.stride(1) or x.shape[:2] != k_cache.shape[:2] or x.data_ptr() % 16):
            raise ValueError(f"{name}: must be {q.dtype} [num_blocks, block_size, {Hkv}, {D}] on {q.device}, slots "
                             f"contiguous and 16-byte aligned like k_cache's, got {x.dtype} {tuple(x.shape)} strides "
                             f"{x.stride()} on {x.device}")
    for name, x, shape in (("slot_mapping", slot_mapping, (T,)), ("context_lens", context_lens, (num_seqs,)),
                           ("block_tables", block_tables, (num_seqs, block_tables.shape[-1]))):
        if x.shape != shape or x.dtype != torch.int64 or x.device != q.device or x.stride(-1) != 1:
            raise ValueError(f"{name}: must be int64 {list(shape)} on {q.device}, got {x.dtype} {tuple(x.shape)} on "
                             f"{x.device}")
    if num_splits is not None:
        least = min_splits(group or 1, D)
        if (not isinstance(num_splits, int) or num_splits < least or num_splits > MAX_SPLITS
                or num_splits & (num_splits - 1)):
            raise ValueError(f"num_splits: must be a power of two from {least} (this query group's outputs over "
                             f"{THREADS} threads a block) to {MAX_SPLITS}, got {num_splits!r}")
    if missing := decode_attention_missing(q.device, q.dtype, D, group, cos.shape[-1]):
        raise ValueError(f"q: the CUDA decode attention cannot run here: needs {'; '.join(missing)}")
    if num_splits is None:
        num_splits = choose_splits(num_seqs, Hkv, group, D, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    lib = library(DTYPES[q.dtype], D, group, skip=skip)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    with torch.cuda.device(q.device):
        err = lib.minirt_decode_attention_launch(
            ptr(q), ptr(k), ptr(v), q.stride(1), k.stride(1), v.stride(1),
            ptr(cos), ptr(sin), cos.stride(1), ptr(q_weight), ptr(k_weight), eps, D ** -0.5,
            ptr(k_cache), ptr(v_cache), k_cache.stride(1), ptr(slot_mapping),
            ptr(block_tables), block_tables.stride(0), ptr(context_lens), block_size,
            ptr(out), out.stride(1), num_seqs, Hkv, num_splits, int(pdl),
            torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"decode_attention_cuda: the launch failed: "
                           f"{lib.minirt_decode_attention_error(err).decode()}")
    return out
