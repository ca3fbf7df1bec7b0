"""Qwen3's q/k RMSNorm and the rotary embedding of q and k in one Triton kernel.

`minirt.fast.ops.norm_and_rotate` is four elementwise passes; compiled with `torch.compile` (`fused_ops`)
they become two kernels, one for q and one for k, because their head counts differ. Here one launch covers both:
one program per (token, head), heads 0 .. H-1 of q then 0 .. Hkv-1 of k. A program loads its head (D values)
and, for the rotation, each channel's partner in the other half (`rotate_half`), normalizes both by the head's
root mean square, and writes `x * cos + rotate_half(x) * sin`, computed in float32 and rounded after each op
as eager torch rounds. At batch 1 a decode step runs this once per layer, so two launches become one (vLLM's
fused `rotary_embedding` custom op does the rotation of q and k in one kernel the same way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, DT: tl.constexpr):
    """float32 x rounded to DT and back, as eager torch stores each op's result. bfloat16 with integer ops
    (round to nearest, ties to even; finite values): a plain `.to(bf16).to(float32)` pair may be folded away by
    the compiler, which would round once at the end instead."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _norm_rotate_kernel(Q, K, QOut, KOut, Cos, Sin, QW, KW, eps, stride_qt, stride_kt, stride_ct,
                        V, VCache, slot_mapping, stride_vt, stride_slot,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        ROT: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr,
                        BLOCK_H: tl.constexpr = 1):
    if PDL:     # programmatic dependent launch: wait for the projection that wrote q and k
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # One program: one token's heads h0 .. h0 + BLOCK_H - 1 of [q heads | k heads | v heads]; BLOCK_H divides
    # NUM_HEADS and NUM_KV_HEADS, so they are all of one kind.
    token = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BLOCK_H
    hh = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    half: tl.constexpr = ROT // 2
    rotated = d < ROT
    partner = tl.where(d < half, d + half, d - half)                 # rotate_half's source channel
    rows = hh * HEAD_DIM
    if STORE:   # KOut is the layer's K cache: token's K goes to its slot, and programs past q's and k's heads copy V
        slot = tl.load(slot_mapping + token).to(tl.int64)
        if h0 >= NUM_HEADS + NUM_KV_HEADS:
            v_head = h0 - NUM_HEADS - NUM_KV_HEADS
            tl.store(VCache + slot * stride_slot + v_head * HEAD_DIM + rows + d,
                     tl.load(V + token * stride_vt + v_head * HEAD_DIM + rows + d))
            return
        k_dst = KOut + slot * stride_slot + (h0 - NUM_HEADS) * HEAD_DIM
    else:
        k_dst = KOut + (token * NUM_KV_HEADS + h0 - NUM_HEADS) * HEAD_DIM
    if h0 < NUM_HEADS:
        src = Q + token * stride_qt + h0 * HEAD_DIM
        dst = QOut + (token * NUM_HEADS + h0) * HEAD_DIM
        w_ptr = QW
    else:
        src = K + token * stride_kt + (h0 - NUM_HEADS) * HEAD_DIM
        dst = k_dst
        w_ptr = KW
    # Rounded to the output dtype after each op, as the eager reference and transformers round, so that a
    # bf16 model gives transformers' values (float32: every cast is a no-op).
    dt = QOut.dtype.element_ty
    x = tl.load(src + rows + d).to(tl.float32)
    xp = tl.load(src + rows + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:                                                          # rms_norm: (x * rstd) rounded, times w
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = _round(tl.load(w_ptr + d).to(tl.float32) * _round(x * rstd, dt), dt)
        xp = _round(tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32) * _round(xp * rstd, dt), dt)
    c = tl.load(Cos + token * stride_ct + d, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(Sin + token * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    rotated_half = tl.where(d < half, -xp, xp)                        # rotate_half(x): exact
    out = tl.where(rotated, _round(_round(x * c, dt) + _round(rotated_half * s, dt), dt), x)
    tl.store(dst + rows + d, out.to(QOut.dtype.element_ty))


MANY_TOKENS, MAX_HEADS_PER_PROGRAM = 64, 8


def heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Heads one program of `_norm_rotate_kernel` takes: 1 for fewer than MANY_TOKENS tokens (a decode step of a
    small batch: one program per head spreads its few rows over the SMs), else the largest power of two up to
    MAX_HEADS_PER_PROGRAM that divides both head counts (a large batch or a prefill chunk: (token, head)
    programs of one head each are too small to pay for themselves)."""
    if num_tokens < MANY_TOKENS:
        return 1
    h = 1
    while h < MAX_HEADS_PER_PROGRAM and num_heads % (2 * h) == 0 and num_kv_heads % (2 * h) == 0:
        h *= 2
    return h


def _check(q, k, cos, sin, q_weight, k_weight):
    """The layouts the kernel reads, or ValueError naming the argument."""
    B, T, num_heads, head_dim = q.shape
    rot = cos.shape[-1]
    if k.shape[:2] != (B, T) or k.shape[3] != head_dim:
        raise ValueError(f"k: must be [{B}, {T}, Hkv, {head_dim}] like q, got {tuple(k.shape)}")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k: must be {q.dtype} on {q.device} like q, got {k.dtype} on {k.device}")
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"q: head_dim must be a power of two, got {head_dim}")
    if rot % 2 or rot > head_dim:
        raise ValueError(f"cos: the rotary dim must be even and at most head_dim = {head_dim}, got {rot}")
    if cos.shape != (B, T, rot) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin: must be contiguous [{B}, {T}, {rot}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    for name, x in (("q", q), ("k", k)):
        if x.stride(3) != 1 or x.stride(2) != head_dim or (B > 1 and x.stride(0) != T * x.stride(1)):
            raise ValueError(f"{name}: each token's heads must be contiguous and tokens evenly strided, "
                             f"got strides {tuple(x.stride())}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight/k_weight: give both or neither")


def _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out, pdl, store=None):
    """One launch: grid (tokens, (q heads + k heads [+ v heads when store = (v, v_cache, slot_mapping)]) / heads per
    program)."""
    B, T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if B * T == 0:
        return
    norm = q_weight is not None
    v, v_cache, slots = store if store is not None else (q, q, q)       # unused without store
    block_h = heads_per_program(B * T, num_heads, num_kv_heads)
    heads = num_heads + num_kv_heads * (2 if store is not None else 1)
    _norm_rotate_kernel[(B * T, heads // block_h)](
        q, k, q_out, k_out, cos, sin, q_weight if norm else q, k_weight if norm else k, eps,
        q.stride(1), k.stride(1), cos.shape[-1], v, v_cache, slots, v.stride(-3), v_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT=cos.shape[-1], NORM=norm, PDL=pdl,
        STORE=store is not None, BLOCK_H=block_h, **({"launch_pdl": True} if pdl else {}))


def norm_and_rotate_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *,
                           pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`minirt.fast.ops.norm_and_rotate` in one kernel: q `[B, T, H, D]`, k `[B, T, Hkv, D]` (each token's
    heads contiguous; tokens may be strided, as slices of a merged q/k/v projection are), cos/sin `[B, T, R]`
    with R <= D even, q_weight/k_weight `[D]` or both None (no q/k norm) -> new contiguous q, k. D must be a power
    of two. Computes in float32, rounding to q's dtype after each op as the eager reference does (equal results
    when cos, sin and the weights are in q's dtype too, as in the model). pdl: launch with
    programmatic dependent launch (see `minirt.kernels.gemv_triton.linear_gemv`). Raises ValueError naming the
    argument for layouts it cannot read."""
    _check(q, k, cos, sin, q_weight, k_weight)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out, pdl)
    return q_out, k_out


def norm_rotate_and_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                                 eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, *, pdl: bool = False) -> torch.Tensor:
    """`minirt.fast.ops.norm_rotate_and_store` in one kernel: `norm_and_rotate_triton` whose programs for k
    write each rotated key straight into its slot of the paged cache, with Hkv more programs copying v into
    v_cache, so the backend's K/V write (`store_kv_triton`) is not launched. vLLM and SGLang fuse the rotary
    embedding with the KV-cache write the same way on their fast decode paths.

    q, k, cos, sin, weights, eps: as `norm_and_rotate_triton`, with B = 1 (a packed batch); v `[1, T, Hkv, D]`
    laid out like k; k_cache/v_cache `[num_blocks, block_size, Hkv, D]` and slot_mapping `[T]`: as
    `minirt.kernels.paged_attention_triton.store_kv_triton`, which checks them. Returns the rotated q
    `[1, T, H, D]`. Raises ValueError naming the argument."""
    from minirt.kernels.paged_attention_triton import check_store_kv_args

    _check(q, k, cos, sin, q_weight, k_weight)
    if q.shape[0] != 1:
        raise ValueError(f"q: must be a packed batch [1, num_tokens, H, D], got {tuple(q.shape)}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: must be {k.dtype} of k's shape {tuple(k.shape)}, got {v.dtype} {tuple(v.shape)}")
    check_store_kv_args(k_cache, v_cache, k[0], v[0], slot_mapping)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_cache, pdl, store=(v, v_cache, slot_mapping))
    return q_out
