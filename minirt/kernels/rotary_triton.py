"""Qwen3's q/k RMSNorm and the rotary embedding of q and k in one Triton kernel.

`minirt.fast.ops.norm_and_rotate` is four elementwise passes; compiled with `torch.compile` (`fused_ops`)
they become two kernels, one for q and one for k, because their head counts differ. Here one launch covers both:
programs of one token's head (a decode step), of several heads of a token (a larger batch) or of several heads of
several tokens (a prefill of thousands of tokens), heads 0 .. H-1 of q then 0 .. Hkv-1 of k (`launch_config`).
A program loads each head's two halves (D / 2 values each, the other's partner in `rotate_half`; with a partial
rotary dim, each rotated channel's partner), normalizes them by the head's root mean square, and writes
`x * cos + rotate_half(x) * sin`, computed in float32 and rounded after each op as eager torch rounds. At batch 1
a decode step runs this once per layer, so two launches become one (vLLM's fused `rotary_embedding` custom op
does the rotation of q and k in one kernel the same way).
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
def _wait(PDL: tl.constexpr):
    """With PDL, wait until the kernel before has finished and its writes are visible (`griddepcontrol.wait`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit(do_not_specialize=["num_tokens"])
def _norm_rotate_kernel(Q, K, QOut, KOut, Cos, Sin, QW, KW, eps, num_tokens, stride_qt, stride_kt, stride_ct,
                        V, VCache, slot_mapping, stride_vt, stride_slot,
                        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        ROT: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr,
                        BLOCK_H: tl.constexpr = 1, BLOCK_T: tl.constexpr = 1):
    if PDL:     # programmatic dependent launch: the next kernel may start; this one waits (`_wait`) only before it
        tl.extra.cuda.gdc_launch_dependents()       # reads the projection's q, k and v: cos, sin, the norms' weights
                                                    # and the slots load before (written before this run of PDL
                                                    # launches began: by the host or by kernels launched without PDL)
    # One program: heads h0 .. h0 + BLOCK_H - 1 of [q heads | k heads | v heads] of tokens t0 .. t0 + BLOCK_T - 1,
    # as BLOCK_T * BLOCK_H rows (a token's heads adjacent); BLOCK_H divides NUM_HEADS and NUM_KV_HEADS, so the
    # heads are all of one kind. `token` and `head` are each row's.
    h0 = tl.program_id(1) * BLOCK_H
    r = tl.arange(0, BLOCK_T * BLOCK_H)[:, None]
    if BLOCK_T == 1:    # one token: a scalar, so its cos/sin load once, not once per row
        token = tl.program_id(0).to(tl.int64)
        head = r
        live = None
    else:               # the last program's rows past the last token store nothing
        token = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H
        head = r % BLOCK_H
        live = token < num_tokens
        token = tl.minimum(token, num_tokens - 1)   # and load the last token's values: loads need no mask
    if STORE:   # KOut is the layer's K cache: programs past q's and k's heads copy V into each token's slot
        if h0 >= NUM_HEADS + NUM_KV_HEADS:
            v_head = h0 - NUM_HEADS - NUM_KV_HEADS + head
            dv = tl.arange(0, HEAD_DIM)[None, :]
            slot = tl.load(slot_mapping + token).to(tl.int64)
            _wait(PDL)
            tl.store(VCache + slot * stride_slot + v_head * HEAD_DIM + dv,
                     tl.load(V + token * stride_vt + v_head * HEAD_DIM + dv), mask=live)
            return
    if h0 < NUM_HEADS:
        src = Q + token * stride_qt + (h0 + head) * HEAD_DIM
        dst = QOut + (token * NUM_HEADS + h0 + head) * HEAD_DIM
        w_ptr = QW
    else:
        kv_head = h0 - NUM_HEADS + head
        src = K + token * stride_kt + kv_head * HEAD_DIM
        if STORE:   # each token's K goes to its slot of the cache
            dst = KOut + tl.load(slot_mapping + token).to(tl.int64) * stride_slot + kv_head * HEAD_DIM
        else:
            dst = KOut + (token * NUM_KV_HEADS + kv_head) * HEAD_DIM
        w_ptr = KW
    # Rounded to the output dtype after each op, as the eager reference and transformers round, so that a
    # bf16 model gives transformers' values (float32: every cast is a no-op).
    dt = QOut.dtype.element_ty
    if ROT == HEAD_DIM:
        # The whole head rotates (every model here): its halves x1, x2 load as two contiguous tiles, each the
        # other's rotate_half partner, so no load gathers; rotate_half(x) = [-x2, x1].
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, half)[None, :]
        # Every load first, so that none waits on the norm's reduction in program order.
        cs = token * stride_ct + d
        c1 = tl.load(Cos + cs).to(tl.float32)
        c2 = tl.load(Cos + cs + half).to(tl.float32)
        s1 = tl.load(Sin + cs).to(tl.float32)
        s2 = tl.load(Sin + cs + half).to(tl.float32)
        if NORM:
            w1 = tl.load(w_ptr + d).to(tl.float32)
            w2 = tl.load(w_ptr + half + d).to(tl.float32)
        _wait(PDL)
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + half + d).to(tl.float32)
        if NORM:                                                      # rms_norm: (x * rstd) rounded, times w
            rstd = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / HEAD_DIM + eps)[:, None]
            x1 = _round(w1 * _round(x1 * rstd, dt), dt)
            x2 = _round(w2 * _round(x2 * rstd, dt), dt)
        tl.store(dst + d, _round(_round(x1 * c1, dt) + _round(-x2 * s1, dt), dt).to(dt), mask=live)
        tl.store(dst + half + d, _round(_round(x2 * c2, dt) + _round(x1 * s2, dt), dt).to(dt), mask=live)
    else:
        # Partial rotary: channels ROT .. HEAD_DIM - 1 pass through, and each rotated channel's partner in the
        # other half of the rotary dims is gathered.
        d = tl.arange(0, HEAD_DIM)[None, :]
        half: tl.constexpr = ROT // 2
        rotated = d < ROT
        partner = tl.where(d < half, d + half, d - half)              # rotate_half's source channel
        c = tl.load(Cos + token * stride_ct + d, mask=rotated, other=1.0).to(tl.float32)
        s = tl.load(Sin + token * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
        if NORM:
            w = tl.load(w_ptr + d).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        _wait(PDL)
        x = tl.load(src + d).to(tl.float32)
        xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
            x = _round(w * _round(x * rstd, dt), dt)
            xp = _round(wp * _round(xp * rstd, dt), dt)
        rotated_half = tl.where(d < half, -xp, xp)                    # rotate_half(x): exact
        out = tl.where(rotated, _round(_round(x * c, dt) + _round(rotated_half * s, dt), dt), x)
        tl.store(dst + d, out.to(dt), mask=live)


MANY_TOKENS, MAX_HEADS_PER_PROGRAM = 64, 8
MAX_ROWS_PER_PROGRAM, MIN_TOKEN_GROUPS = 32, 512


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


def launch_config(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  tokens_per_program: int | None = None, num_warps: int | None = None) -> tuple[int, int, int]:
    """(tokens, heads, warps) of one program of `_norm_rotate_kernel` for num_tokens tokens. Heads:
    `heads_per_program`. Tokens: 1, or from 2 * MIN_TOKEN_GROUPS tokens on (a prefill of thousands of tokens)
    the largest power of two that keeps a program's rows (tokens x heads) within MAX_ROWS_PER_PROGRAM and the
    programs along the tokens at least MIN_TOKEN_GROUPS: 8,192 tokens of Qwen3-0.6B take 4 tokens of 8 heads a
    program, 8 KB of bf16 in, where programs of one token's 2 KB are too small to pay for themselves. Warps: 4
    (Triton's default) for one token, else enough that each thread holds 32 of the program's values (four 16-byte
    vectors of bf16), up to 16 (the sweep behind it: lab/probes/prefill_kernels.py).
    tokens_per_program and num_warps override the choice (a benchmark sweeping variants in one process); both must be
    powers of two, else ValueError naming them."""
    block_h = heads_per_program(num_tokens, num_heads, num_kv_heads)
    for name, n, top in (("tokens_per_program", tokens_per_program, None), ("num_warps", num_warps, 32)):
        if n is not None and (not isinstance(n, int) or n < 1 or n & (n - 1) or (top and n > top)):
            raise ValueError(f"{name}: must be a power of two{f' up to {top}' if top else ''}, got {n!r}")
    block_t = tokens_per_program
    if block_t is None:
        block_t = 1
        while 2 * block_t * block_h <= MAX_ROWS_PER_PROGRAM and num_tokens >= 2 * block_t * MIN_TOKEN_GROUPS:
            block_t *= 2
    if num_warps is None:
        num_warps = 4 if block_t == 1 else min(16, max(4, block_t * block_h * head_dim // (32 * 32)))
    return block_t, block_h, num_warps


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
    if (cos.shape != (B, T, rot) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(2) != 1
            or (B > 1 and T > 1 and cos.stride(0) != T * cos.stride(1))):
        raise ValueError(f"cos/sin: must be [{B}, {T}, {rot}] with contiguous rows, evenly strided and alike, got "
                         f"{tuple(cos.shape)} strides {cos.stride()}, {tuple(sin.shape)} strides {sin.stride()}")
    for name, x in (("q", q), ("k", k)):
        if x.stride(3) != 1 or x.stride(2) != head_dim or (B > 1 and x.stride(0) != T * x.stride(1)):
            raise ValueError(f"{name}: each token's heads must be contiguous and tokens evenly strided, "
                             f"got strides {tuple(x.stride())}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight/k_weight: give both or neither")


def _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out, pdl, store=None, tokens_per_program=None,
            num_warps=None):
    """One launch: grid (tokens / tokens per program, (q heads + k heads [+ v heads when store = (v, v_cache,
    slot_mapping)]) / heads per program), as `launch_config` chooses."""
    B, T, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    block_t, block_h, warps = launch_config(B * T, num_heads, num_kv_heads, head_dim, tokens_per_program, num_warps)
    if B * T == 0:
        return
    norm = q_weight is not None
    v, v_cache, slots = store if store is not None else (q, q, q)       # unused without store
    heads = num_heads + num_kv_heads * (2 if store is not None else 1)
    _norm_rotate_kernel[(triton.cdiv(B * T, block_t), heads // block_h)](
        q, k, q_out, k_out, cos, sin, q_weight if norm else q, k_weight if norm else k, eps, B * T,
        q.stride(1), k.stride(1), cos.stride(1) if T > 1 else cos.stride(0), v, v_cache, slots, v.stride(-3),
        v_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROT=cos.shape[-1], NORM=norm, PDL=pdl,
        STORE=store is not None, BLOCK_H=block_h, BLOCK_T=block_t, num_warps=warps,
        **({"launch_pdl": True} if pdl else {}))


def norm_and_rotate_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, *,
                           pdl: bool = False, tokens_per_program: int | None = None,
                           num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`minirt.fast.ops.norm_and_rotate` in one kernel: q `[B, T, H, D]`, k `[B, T, Hkv, D]` (each token's
    heads contiguous; tokens may be strided, as slices of a merged q/k/v projection are), cos/sin `[B, T, R]`
    with R <= D even (rows contiguous, evenly strided and the same in both: the halves of one gathered table may be
    passed), q_weight/k_weight `[D]` or both None (no q/k norm) -> new contiguous q, k. D must be a power
    of two. Computes in float32, rounding to q's dtype after each op as the eager reference does (equal results
    when cos, sin and the weights are in q's dtype too, as in the model). pdl: launch with
    programmatic dependent launch (see `minirt.kernels.gemv_triton.linear_gemv`). tokens_per_program, num_warps:
    override `launch_config`'s choice (for benchmarks). Raises ValueError naming the argument for layouts it
    cannot read."""
    _check(q, k, cos, sin, q_weight, k_weight)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                   device=k.device)
    _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_out, pdl, None, tokens_per_program, num_warps)
    return q_out, k_out


def norm_rotate_and_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                                 eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor, *, pdl: bool = False,
                                 tokens_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`minirt.fast.ops.norm_rotate_and_store` in one kernel: `norm_and_rotate_triton` whose programs for k
    write each rotated key straight into its slot of the paged cache, with Hkv more programs copying v into
    v_cache, so the backend's K/V write (`store_kv_triton`) is not launched. vLLM and SGLang fuse the rotary
    embedding with the KV-cache write the same way on their fast decode paths.

    q, k, cos, sin, weights, eps: as `norm_and_rotate_triton`, with B = 1 (a packed batch); v `[1, T, Hkv, D]`
    laid out like k; k_cache/v_cache `[num_blocks, block_size, Hkv, D]` and slot_mapping `[T]`: as
    `minirt.kernels.paged_attention_triton.store_kv_triton`, which checks them. pdl, tokens_per_program,
    num_warps: as `norm_and_rotate_triton`. Returns the rotated q `[1, T, H, D]`. Raises ValueError naming the
    argument."""
    from minirt.kernels.paged_attention_triton import check_store_kv_args

    _check(q, k, cos, sin, q_weight, k_weight)
    if q.shape[0] != 1:
        raise ValueError(f"q: must be a packed batch [1, num_tokens, H, D], got {tuple(q.shape)}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: must be {k.dtype} of k's shape {tuple(k.shape)}, got {v.dtype} {tuple(v.shape)}")
    check_store_kv_args(k_cache, v_cache, k[0], v[0], slot_mapping)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, cos, sin, q_weight, k_weight, eps, q_out, k_cache, pdl, (v, v_cache, slot_mapping),
            tokens_per_program, num_warps)
    return q_out
