"""A layer's chain of matrix-vector products in one persistent Triton kernel: a first batch-1 "megakernel" probe, not
used by the engine (measured 19.8 us per layer against 13.4 for four `linear_gemv` kernels with PDL;
lab/pages/gemv-chain.md).

At batch 1 a decode step is a chain of GEMVs, and every `linear_gemv` launch pays a ramp and a tail even with PDL:
a layer's four GEMVs took 13.4 us with PDL for 7.5 us of weight reads (lab/pages/gemv-chain.md). Here one launch runs
a layer's four products as *phases*. A grid no larger than what the GPU holds at once (so that no program waits for
one that cannot start) takes each phase's output tiles by turns, computing each with `_chain_rows`, the code of
`linear_gemv`'s programs (`_gemv_rows`, kept here with X_CACHE for the loads through L2), with the tiles `linear_gemv`
would choose: the results are bit for bit the same. Between phases every program waits at a grid-wide barrier (an
atomic count in global memory), since a phase reads what the others wrote; those reads go through L2 (`.cg`), never a
stale L1 line. CUDA's cooperative groups (`grid.sync()`) and Hazy Research's Llama-1B megakernel (2025; finer waits,
a whole forward per launch) work so.

The chain is `lab/probes/gemv.py --chain`'s layer, attention left out:

    qkv, s1 = gemv(x, W_qkv, norm g1, residual s0)      (s0 = None: s1 = x)
    o       = gemv(qkv[:K_o], W_o)
    act, s2 = gemv(o, W_gate_up, norm g2, residual s1, silu_and_mul)
    out     = gemv(act, W_down)

In Triton's interpreter (CPU tensors) the programs run one after another, so a barrier would wait forever: there
each phase is its own launch, the same code without the barriers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minirt.kernels import num_sms
from minirt.kernels.gemv_triton import _store_rows, choose_config

# What one SM holds at once on Hopper: warps, 32-bit registers, thread blocks, shared memory (bytes per block's use)
MAX_WARPS_PER_SM, REGISTERS_PER_SM, MAX_BLOCKS_PER_SM, SHARED_PER_SM = 64, 65536, 32, 227 * 1024


@triton.jit
def _chain_rows(tile, split, X, W, Bias, Out, Part, Res, NormW, Stream, N, K, stride_x, eps,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                X_CACHE: tl.constexpr):
    """`minirt.kernels.gemv_triton._gemv_rows` (one program's output rows of `linear_gemv`) with X_CACHE, the cache
    modifier of the loads of x and the residual: "" as there, or ".cg", which reads through L2 (data another program
    of the same launch wrote). The engine's kernel never reads what its own launch wrote, so it has no X_CACHE."""
    rows, row_ok, y, up = _chain_sums(tile, split, X, W, Res, NormW, Stream, N, K, stride_x, eps, BLOCK_N, BLOCK_K,
                                      SPLIT_K, SILU_AND_MUL, NORM, HAS_RESIDUAL, PDL, X_CACHE)
    if SPLIT_K == 1:
        _store_rows(y, up, rows, row_ok, Bias, Out, N, HAS_BIAS, SILU_AND_MUL)
    else:
        tl.store(Part + split * N + rows, y, mask=row_ok)


@triton.jit
def _chain_sums(tile, split, X, W, Res, NormW, Stream, N, K, stride_x, eps,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SILU_AND_MUL: tl.constexpr,
                NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr, X_CACHE: tl.constexpr):
    """`_chain_rows`' sums (`minirt.kernels.gemv_triton._gemv_sums` with X_CACHE): (rows, rows < N, the rows' float32
    dot products with the norm's scale applied, the up rows' (SILU_AND_MUL; else the first again)); split `split`'s
    share of them when SPLIT_K > 1."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows.to(tl.int64)[:, None] * K          # int64: N * K can pass 2**31 (a large vocabulary)
    up_rows = W + (rows + N).to(tl.int64)[:, None] * K    # SILU_AND_MUL: the up row of each gate row, N rows on
    cols = tl.arange(0, BLOCK_K)
    # Elementwise products accumulate per lane; the one cross-thread sum comes after the loop, so no
    # step waits on a reduction before issuing its next loads.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)     # SILU_AND_MUL only (unused, removed otherwise)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)              # NORM only: the norm's sum of squares, per lane
    for k in range(split * BLOCK_K, K, SPLIT_K * BLOCK_K):    # split-K: this program's share of the chunks
        k_ok = k + cols < K
        # All loads of the step are issued before any arithmetic waits on one of them; the weights first,
        # since no kernel writes them: with PDL they stream in while the kernel before finishes.
        w = tl.load(w_rows + (k + cols)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if SILU_AND_MUL:
            u = tl.load(up_rows + (k + cols)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            g = tl.load(NormW + k + cols, mask=k_ok, other=0.0)      # a weight too: no kernel writes it
        if PDL:
            tl.extra.cuda.gdc_wait()                      # x and the residual are the kernel before's output
        x = tl.load(X + (k + cols) * stride_x, mask=k_ok, other=0.0, cache_modifier=X_CACHE)
        if HAS_RESIDUAL:
            r = tl.load(Res + k + cols, mask=k_ok, other=0.0, cache_modifier=X_CACHE)
        if HAS_RESIDUAL:
            # The residual addition, rounded to the stream's dtype as in `add_rms_norm`; one program keeps it.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            if tile == 0:
                tl.store(Stream + k + cols, x, mask=k_ok)
        xf = x.to(tl.float32)
        if NORM:
            # rms_norm(x) * g = rstd * (g * x): the scalar rstd factors out of the dot products, so it is
            # applied after the loop, from the sum of squares gathered on the way.
            sum_sq += xf * xf
            xf = xf * g.to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        if SILU_AND_MUL:
            acc_up += u.to(tl.float32) * xf[None, :]
    if PDL:
        tl.extra.cuda.gdc_wait()      # every program waits (a no-op after the loop's): completion stays in order
    y = tl.sum(acc, axis=1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        y = y * rstd
    up = y
    if SILU_AND_MUL:
        up = tl.sum(acc_up, axis=1)
        if NORM:
            up = up * rstd
    return rows, row_ok, y, up



@triton.jit
def _grid_barrier(Sync, target):
    """Every program adds one to the count and waits until it reaches `target` (phase p of a launch: p x the grid).
    The block barrier first puts all of the program's stores before its release; the acquire makes the others'
    visible to it."""
    tl.debug_barrier()
    tl.atomic_add(Sync, 1, sem="release", scope="gpu")
    count = tl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
    while count < target:
        count = tl.atomic_add(Sync, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _gemv_chain_kernel(X, S0, W1, G1, Out1, S1, W2, Out2, W3, G2, Out3, S2, W4, Out4, Sync, eps,
                       N1, K1, N2, K2, N3, K3, N4, K4,
                       BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                       BN3: tl.constexpr, BK3: tl.constexpr, BN4: tl.constexpr, BK4: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr, PHASE: tl.constexpr, PDL: tl.constexpr):
    """PHASE -1: all four phases with grid barriers between them; 0-3: that phase alone (the interpreter)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PHASE < 0 or PHASE == 0:            # q/k/v with the input norm (and the residual before it)
        for t in range(pid, tl.cdiv(N1, BN1), grid):
            _chain_rows(t, 0, X, W1, Out1, Out1, Out1, S0, G1, S1, N1, K1, 1, eps,
                        False, BN1, BK1, 1, False, True, HAS_RESIDUAL, False, "")
    if PHASE < 0:
        _grid_barrier(Sync, grid)
    if PHASE < 0 or PHASE == 1:            # o_proj on the first K2 outputs of phase 0
        for t in range(pid, tl.cdiv(N2, BN2), grid):
            _chain_rows(t, 0, Out1, W2, Out2, Out2, Out2, Out2, Out2, Out2, N2, K2, 1, eps,
                        False, BN2, BK2, 1, False, False, False, False, ".cg")
    if PHASE < 0:
        _grid_barrier(Sync, 2 * grid)
    if PHASE < 0 or PHASE == 2:            # gate/up with the post-attention norm, residual s1, SiLU-and-multiply
        for t in range(pid, tl.cdiv(N3, BN3), grid):
            _chain_rows(t, 0, Out2, W3, Out3, Out3, Out3, S1, G2, S2, N3, K3, 1, eps,
                        False, BN3, BK3, 1, True, True, True, False, ".cg")
    if PHASE < 0:
        _grid_barrier(Sync, 3 * grid)
    if PHASE < 0 or PHASE == 3:            # down_proj
        for t in range(pid, tl.cdiv(N4, BN4), grid):
            _chain_rows(t, 0, Out3, W4, Out4, Out4, Out4, Out4, Out4, Out4, N4, K4, 1, eps,
                        False, BN4, BK4, 1, False, False, False, False, ".cg")


_GRIDS: dict[tuple, int] = {}        # (device, dtype, tiles and flags, pdl, programs_per_sm) -> the launch's grid


class ChainOutputs(NamedTuple):
    """The four products and the two residual streams of `gemv_chain`, each `[1, n]`."""

    qkv: torch.Tensor
    stream_attn: torch.Tensor        # s1: what the q/k/v norm normalized
    o: torch.Tensor
    act: torch.Tensor
    stream_mlp: torch.Tensor         # s2: what the gate/up norm normalized
    out: torch.Tensor


def chain_configs(weights, num_sms_: int) -> list:
    """The (block_n, block_k) tiles of each phase: what `linear_gemv` chooses for the same product
    (`choose_config`; the fused products never split K, the others must not need to). Raises ValueError naming
    weights if a plain product would split K (the chain has no split-K phase)."""
    (n1, k1), (n2, k2), (n3, k3), (n4, k4) = (w.shape for w in weights)
    configs = [choose_config(n1, k1, num_sms_, split_k=False), choose_config(n2, k2, num_sms_),
               choose_config(n3 // 2, k3, num_sms_, split_k=False), choose_config(n4, k4, num_sms_)]
    for i in (1, 3):
        if configs[i].split_k > 1:
            raise ValueError(f"weights: product {i} ({tuple(weights[i].shape)}) would split K in linear_gemv "
                             f"(split_k={configs[i].split_k}); the chain has no split-K phase")
    return configs


def resident_programs(compiled, device: torch.device, want: int) -> int:
    """How many programs of a compiled kernel each SM holds at once, at most `want`: by its warps, registers and
    shared memory (Triton's reduction scratch). 1 where the compiled kernel does not say (the interpreter)."""
    n_regs = getattr(compiled, "n_regs", None)
    metadata = getattr(compiled, "metadata", None)
    warps = getattr(metadata, "num_warps", None)
    if not n_regs or not warps:
        return 1
    shared = getattr(metadata, "shared", 0) or 0
    limits = [want, MAX_BLOCKS_PER_SM, MAX_WARPS_PER_SM // warps, REGISTERS_PER_SM // (n_regs * 32 * warps)]
    if shared:
        limits.append(SHARED_PER_SM // shared)
    return max(1, min(limits))


def gemv_chain(x: torch.Tensor, weights, norm_weights, residual: torch.Tensor | None = None,
               sync: torch.Tensor | None = None, programs_per_sm: int = 4, pdl: bool = False,
               eps: float = 1e-6) -> ChainOutputs:
    """The chain of the module docstring for one row: x `[1, K1]`; weights `(W_qkv [N1, K1], W_o [N2, K2],
    W_gate_up [2 I, K3], W_down [N4, I])` contiguous, K2 <= N1, K3 = K1, K4 = I; norm_weights `(g1 [K1], g2 [K3])`;
    residual `[1, K1]` or None. sync: an int32 `[1]` count that is 0 when the launch starts (allocated here when
    None; a CUDA graph keeps its own zeroed slot per call and zeroes them together). programs_per_sm: the grid is
    the SM count times this, fewer if the compiled kernel cannot keep that many on an SM at once (a program of a
    barrier kernel must never wait for one that has no SM to run on). Returns `ChainOutputs`, equal bit for bit to
    the four `linear_gemv` calls with the same arguments. Raises ValueError naming an argument that does not fit."""
    w1, w2, w3, w4 = weights
    g1, g2 = norm_weights
    k1 = x.shape[-1]
    if x.numel() != k1 or w1.shape[1] != k1 or w3.shape[1] != k1 or w2.shape[1] > w1.shape[0]:
        raise ValueError(f"weights: need x [1, K1], W_qkv [N1, K1], W_o [N2, K2 <= N1], W_gate_up [2I, K1]; got x "
                         f"{tuple(x.shape)}, {[tuple(w.shape) for w in weights]}")
    if w3.shape[0] % 2 or w4.shape[1] != w3.shape[0] // 2:
        raise ValueError(f"weights: W_gate_up must be [2I, K1] and W_down [N4, I], got {tuple(w3.shape)} and "
                         f"{tuple(w4.shape)}")
    for name, t in (("weights", w1), ("weights", w2), ("weights", w3), ("weights", w4), ("norm_weights", g1),
                    ("norm_weights", g2), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device or not t.is_contiguous()):
            raise ValueError(f"{name}: must be contiguous {x.dtype} on {x.device} like x, got {t.dtype} on {t.device}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual: must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    dev, dtype = x.device, x.dtype
    configs = chain_configs(weights, num_sms(dev))
    n1, n2, n3, n4 = w1.shape[0], w2.shape[0], w3.shape[0] // 2, w4.shape[0]
    out1, out2 = torch.empty(1, n1, dtype=dtype, device=dev), torch.empty(1, n2, dtype=dtype, device=dev)
    out3, out4 = torch.empty(1, n3, dtype=dtype, device=dev), torch.empty(1, n4, dtype=dtype, device=dev)
    s1 = x if residual is None else torch.empty_like(x)
    s2 = torch.empty_like(x)
    sync = torch.zeros(1, dtype=torch.int32, device=dev) if sync is None else sync
    args = (x, residual if residual is not None else x, w1, g1, out1, s1, w2, out2, w3, g2, out3, s2, w4, out4,
            sync, eps, n1, k1, n2, w2.shape[1], n3, k1, n4, n3)
    tiles = {f"{b}{i + 1}": v for i, c in enumerate(configs) for b, v in (("BN", c.block_n), ("BK", c.block_k))}
    common = dict(**tiles, HAS_RESIDUAL=residual is not None, num_warps=configs[0].num_warps)
    if dev.type != "cuda":                 # the interpreter: one launch per phase, no barrier
        for phase in range(4):
            _gemv_chain_kernel[(1,)](*args, PHASE=phase, PDL=False, **common)
    else:
        key = (dev, dtype, tuple(sorted(common.items())), pdl, programs_per_sm)
        if key not in _GRIDS:              # compile once per variant and ask its resources; the grid then stays
            compiled = _gemv_chain_kernel.warmup(*args, PHASE=-1, PDL=pdl, grid=(1,), **common)
            if hasattr(compiled, "_init_handles"):
                compiled._init_handles()   # loads the binary: its register count is known from here
            _GRIDS[key] = num_sms(dev) * resident_programs(compiled, dev, programs_per_sm)
        grid = _GRIDS[key]
        launch = {"launch_pdl": True} if pdl else {}
        _gemv_chain_kernel[(grid,)](*args, PHASE=-1, PDL=pdl, **common, **launch)
    return ChainOutputs(out1, s1, out2, out3, s2, out4)
