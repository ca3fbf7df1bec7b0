"""flash-attn as minirt's paged-attention kernel: `attention_backend="flash_attn"` (chapter 07).

FlashAttention (Dao et al. 2022; Dao 2023, "FlashAttention-2"; Shah et al. 2024, "FlashAttention-3") reads a
paged KV cache through a block table, in the layout minirt's cache already has: per layer
`[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V. So nothing is copied or converted; what
changes is how the step's metadata is spelled (`FlashMetadata`): int32 instead of int64, and flash-attn 2 wants
cumulative key lengths where minirt keeps per-sequence context lengths. Two packages provide it:

* flash-attn-4 (`pip install flash-attn-4`, imported as `flash_attn.cute`: CuTe-DSL kernels, compiled on first
  use): `flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, seqused_k=, page_table=, causal=True)`
  for every step, prefill chunks and decodes alike. Any block size.
* flash-attn 2 (`pip install flash-attn`, built from source against the local CUDA and torch):
  `flash_attn_varlen_func(..., cu_seqlens_k=, block_table=)` for steps with prefill chunks and
  `flash_attn_with_kvcache(q[:, None], ..., cache_seqlens=, block_table=)` for all-decode steps, as nano-vllm
  does (`nanovllm/layers/attention.py`). Its paged kernels need block_size a multiple of 256.

Both put the causal mask at the bottom right (query `i` of a sequence with `q_len` new tokens and `ctx` keys
sees keys `0 .. ctx - q_len + i`), which is minirt's contract (`minirt.attention.paged_attention_reference`).
Where one of them cannot run, `flash_attn_missing` says why, and the plan refuses the backend by name before
the model loads (`minirt.fast.plan`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from minirt.attention import PagedAttentionMetadata

FA4, FA2 = "flash-attn-4", "flash-attn 2"


@functools.lru_cache(maxsize=None)
def flash_attn_api() -> tuple[str, ModuleType] | tuple[None, str]:
    """The flash-attn interface this Python can import: `(FA4, flash_attn.cute)` where flash-attn-4 is
    installed (preferred), else `(FA2, flash_attn)` for flash-attn 2 (>= 2.5, which has `block_table`);
    `(None, why)` where neither imports."""
    errors = []
    for name, module, needs in ((FA4, "flash_attn.cute", ("flash_attn_varlen_func",)),
                                (FA2, "flash_attn", ("flash_attn_varlen_func", "flash_attn_with_kvcache"))):
        try:
            mod = importlib.import_module(module)
        except Exception as e:                                # not installed, or built for another CUDA/torch
            errors.append(f"{module}: {type(e).__name__}: {e}"[:160])
            continue
        if all(hasattr(mod, n) for n in needs):
            return name, mod
        errors.append(f"{module} has no {' / '.join(needs)}")
    return None, "; ".join(errors)


def flash_attn_missing(device: torch.device, head_dim: int, dtype: torch.dtype, block_size: int,
                       api: tuple | None = None) -> list[str]:
    """What `attention_backend="flash_attn"` needs and does not have here (phrases; empty: it can run): a CUDA
    device of compute capability 8.0 or later, flash-attn-4 or flash-attn 2 importable, float16 or bfloat16,
    head_dim a multiple of 8 up to 256, and for flash-attn 2 a block_size that is a multiple of 256.
    `api` overrides `flash_attn_api()` (tests)."""
    from minirt.kernels import capability_missing

    missing = capability_missing(device, 8)
    if device.type != "cuda":
        return missing
    name, mod = api if api is not None else flash_attn_api()
    if name is None:
        missing.append(f"flash-attn-4 or flash-attn installed (pip install flash-attn-4; got {mod})")
    missing += flash_attn_shape_missing(name, head_dim, dtype, block_size)
    return missing


def flash_attn_shape_missing(name: str | None, head_dim: int, dtype: torch.dtype, block_size: int) -> list[str]:
    """The part of `flash_attn_missing` that does not depend on the machine: dtype, head_dim, block_size."""
    missing = []
    if dtype not in (torch.float16, torch.bfloat16):
        missing.append(f"dtype float16 or bfloat16 (got {str(dtype).removeprefix('torch.')})")
    if head_dim % 8 or not 8 <= head_dim <= 256:
        missing.append(f"a head_dim that is a multiple of 8 from 8 to 256 (got {head_dim})")
    if name == FA2 and block_size % 256:
        missing.append(f"block_size a multiple of 256 for flash-attn 2's paged kernels (got {block_size}; "
                       "flash-attn-4 takes any)")
    return missing


@dataclass
class FlashMetadata:
    """A step's `PagedAttentionMetadata` as flash-attn reads it (int32, contiguous).

    cu_seqlens_q `[num_seqs + 1]`: `query_start_loc`. seqused_k `[num_seqs]`: `context_lens` (keys of each
    sequence, new tokens included). cu_seqlens_k `[num_seqs + 1]`: their running sum, from 0 (flash-attn 2's
    varlen call; None for flash-attn-4). page_table `[num_seqs, max_blocks]`: `block_tables`.
    max_query_len, max_context_len: host bounds (flash-attn-4 sizes its grid from them; a CUDA graph passes
    the largest context it replays)."""

    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    cu_seqlens_k: torch.Tensor | None
    page_table: torch.Tensor
    max_query_len: int
    max_context_len: int


class FlashAttnPagedAttention:
    """A paged-attention kernel with `paged_attention_reference`'s contract, through flash-attn.

    `kernel(q, k_cache, v_cache, meta)`: q `[num_tokens, H, D]`, k/v cache `[num_blocks, block_size, Hkv, D]`
    (minirt's layout, float16 or bfloat16) -> `[num_tokens, H, D]`. An engine step calls `prepare(meta)` once
    per forward and `run(q, k_cache, v_cache, prepared)` per layer (`minirt.fast.attention.KernelPagedAttention`),
    so that the int32 metadata is built once per forward, not once per layer.

    name: FA4 or FA2; module: its interface (`flash_attn.cute` or `flash_attn`). num_splits: flash-attn's split-KV
    (1: none; 0: its own heuristic, flash-attn-4's `num_splits_heuristic`, flash-attn 2's `num_splits=0`;
    None: the package's default, 1 for flash-attn-4 and for flash-attn 2's varlen call, 0 for its decode call).
    """

    def __init__(self, name: str, module: ModuleType, num_splits: int | None = None):
        if name not in (FA4, FA2):
            raise ValueError(f"name: must be {FA4!r} or {FA2!r}, got {name!r}")
        self.name, self.module, self.num_splits = name, module, num_splits

    def prepare(self, meta: PagedAttentionMetadata) -> FlashMetadata:
        ctx = meta.context_lens.to(torch.int32)
        cu_k = None
        if self.name == FA2:
            cu_k = torch.zeros(ctx.shape[0] + 1, dtype=torch.int32, device=ctx.device)
            torch.cumsum(ctx, 0, out=cu_k[1:])
        return FlashMetadata(meta.query_start_loc.to(torch.int32), ctx, cu_k,
                             meta.block_tables.to(torch.int32).contiguous(), meta.max_query_len,
                             meta.max_context_len)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fm: FlashMetadata) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5
        splits = {} if self.num_splits is None else {"num_splits": self.num_splits}
        if self.name == FA4:
            out = self.module.flash_attn_varlen_func(
                q, k_cache, v_cache, cu_seqlens_q=fm.cu_seqlens_q, seqused_k=fm.seqused_k,
                max_seqlen_q=fm.max_query_len, max_seqlen_k=fm.max_context_len, page_table=fm.page_table,
                softmax_scale=scale, causal=True, **splits)
        elif fm.max_query_len == 1:                   # flash-attn 2, all decodes: its split-KV decode kernel
            out = self.module.flash_attn_with_kvcache(
                q[:, None], k_cache, v_cache, cache_seqlens=fm.seqused_k, block_table=fm.page_table,
                softmax_scale=scale, causal=True, **splits)
            out = (out[0] if isinstance(out, tuple) else out)[:, 0]
        else:                                         # its varlen call has no num_splits
            out = self.module.flash_attn_varlen_func(
                q, k_cache, v_cache, fm.cu_seqlens_q, fm.cu_seqlens_k, fm.max_query_len, fm.max_context_len,
                softmax_scale=scale, causal=True, block_table=fm.page_table)
        return out[0] if isinstance(out, tuple) else out          # flash-attn-4 returns (out, lse)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: PagedAttentionMetadata) -> torch.Tensor:
        return self.run(q, k_cache, v_cache, self.prepare(meta))


def flash_attn_kernel(num_splits: int | None = None) -> FlashAttnPagedAttention:
    """The kernel over the installed flash-attn (`flash_attn_api`). Raises ValueError naming
    attention_backend where none imports."""
    name, module = flash_attn_api()
    if name is None:
        raise ValueError(f"attention_backend: 'flash_attn' needs flash-attn-4 or flash-attn installed ({module})")
    return FlashAttnPagedAttention(name, module, num_splits)
