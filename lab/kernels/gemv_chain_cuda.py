"""The layers' GEMV chain at batch 1 in one persistent CUDA kernel, weights streamed through shared memory: the
second batch-1 "megakernel" probe, not used by the engine (lab/pages/gemv-chain.md).

`lab.kernels.gemv_chain_triton` put a layer's four GEMVs in one Triton launch with grid barriers between them and
was slower than the four kernels with PDL (19.8 against 13.4 us per layer, lab/pages/gemv-chain.md): after each
barrier every program starts its loads from nothing. Here (`gemv_chain_cuda.cu`, CUDA C++, built on first use by
nvcc into a shared library that ctypes loads) one block per SM runs every layer of the chain; each block owns fixed
output rows of each product, and a producer warp streams all of its weights, layer after layer, through a ring of
shared-memory stages with the bulk-copy engine, waiting only for a free stage. Eight consumer warps load the
previous product's output as its words arrive (each row is written with the product's number beside it, NCCL's "LL"
protocol, so no grid barrier), then find their tiles already loaded and multiply them on the tensor cores, each warp
an eighth of the columns of every row (x split into three bf16 parts, so that every product is exact). The memory
can stream through the waits; what remains per product is the latency of the output's way through L2 and of the
epilogue (Hazy Research's Llama-1B megakernel, 2025, and the warp-specialized pipelines of CUTLASS's Hopper kernels
work so). lab/pages/gemv-chain.md has the figures against the four kernels with PDL (the kept version: 19.34
against 13.51 us a layer), a breakdown by part (`skip`) and per-block timelines (`timeline`).

Per layer (bf16; the stream s0 of layer 0 is `residual`, or x itself when None; later layers' is the layer before's
s2, kept in each block's shared memory):

    qkv, s1 = gemv(x, W_qkv, norm g1, residual s0)
    o       = gemv(qkv[:K_o], W_o)
    act, s2 = gemv(o, W_gate_up, norm g2, residual s1, silu_and_mul)
    x       = gemv(act, W_down)

with `linear_gemv`'s arithmetic (float32 sums, the stream rounded to bf16, rstd * dot(w, g * s), gate and up
rounded before silu(gate) * up); the sums differ in order and, inside each tensor-core product, in rounding (its
float32 additions truncate), so results agree with the four `linear_gemv` calls to bf16 rounding, not bit for
bit. Needs a Hopper GPU (compute capability 9.0: the bulk copy) and nvcc.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from minirt.kernels import num_sms
from lab.kernels.nvcc_build import build_library, hopper_nvcc_missing

SOURCE = Path(__file__).with_name("gemv_chain_cuda.cu")
STAGE_BYTES = 16384         # one stage of the ring by default (gemv_chain_cuda.cu's MINIRT_STAGE_BYTES)
CONSUMER_WARPS = 8
MAX_CHUNKS = 12             # a warp multiplies at most MAX_CHUNKS x 32 columns of each row (k / CONSUMER_WARPS)
MMA_N = 8                   # a tile's rows are the columns of the tensor cores' B operand (mma.sync m16n8k16)
MAX_TILES = 16              # stage tiles per block per product (the kernel's warp-sum buffer)
BARRIER_BYTES = 16          # a stage's two mbarriers
# gemv_chain_cuda.cu's Params::flags: leave out the waits for the previous product's words, the input loads, the dot
# products, the weight stream
SKIP_BARRIERS, SKIP_PROLOGUE, SKIP_DOTS, SKIP_STREAM = 1, 2, 4, 8
#: What `gemv_chain_layers(timeline=...)` records per block and product (the SM's clock, `clock64`; "waited": thread
#: 0 has its own input words)
TIMELINE_STAMPS = ("start", "waited", "input loaded", "first stage", "stages done", "epilogue done",
                   "first copy issued", "last copy issued")


class Product(NamedTuple):
    """One of a layer's four products as the kernel tiles it (`chain_plan`)."""

    n: int             # output rows
    k: int             # input columns
    rows_log2: int     # log2 of the output rows per stage tile (gate/up: pairs, gate rows then up rows)


class ChainOutputs(NamedTuple):
    """The last layer's products and streams, each `[1, n]`; `out` is the chain's result (the last x)."""

    qkv: torch.Tensor
    stream_attn: torch.Tensor        # s1
    o: torch.Tensor
    act: torch.Tensor
    stream_mlp: torch.Tensor         # s2
    out: torch.Tensor


def reference_chain(x: torch.Tensor, layers, residual: torch.Tensor | None = None, eps: float = 1e-6) -> ChainOutputs:
    """The chain of the module docstring in float64 torch (`rms_norm`, `F.linear`, `silu`), rounded to bf16 where
    the kernel rounds (the streams, each product, gate and up, act): the oracle its tests and benchmark compare
    with. Any device; the results are float64."""
    b = lambda t: t.to(torch.bfloat16).double()  # noqa: E731

    def norm(s, g):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * g.double()

    x, stream = x.double(), None if residual is None else residual.double()
    for w_qkv, w_o, w_gu, w_down, g1, g2 in layers:
        s1 = x if stream is None else b(x + stream)
        qkv = b(F.linear(norm(s1, g1), w_qkv.double()))
        o = b(F.linear(qkv[:, :w_o.shape[1]], w_o.double()))
        s2 = b(o + s1)
        gate, up = F.linear(norm(s2, g2), w_gu.double()).chunk(2, dim=-1)
        act = b(F.silu(b(gate)) * b(up))
        x, stream = b(F.linear(act, w_down.double())), s2
    return ChainOutputs(qkv, s1, o, act, s2, x)


def cuda_chain_missing(device: torch.device) -> list[str]:
    """What the kernel needs and does not have here (empty: it can run): a CUDA device of compute capability 9.0 or
    later, and nvcc to build it (CUDA_HOME or on the PATH)."""
    return hopper_nvcc_missing(device)


@functools.lru_cache(maxsize=None)
def library(arch: str = "sm_90", stage_bytes: int = STAGE_BYTES, weights_evict_first: bool = False) -> ctypes.CDLL:
    """The kernel built with nvcc for `arch` and stages of `stage_bytes` (and, with `weights_evict_first`, the weights'
    copies asking L2 to evict them first) by `build_library`, with line info (for Nsight Compute's source view). A
    few seconds the first time. Raises RuntimeError with nvcc's output if the build fails."""
    flags = ["-O3", f"-arch={arch}", "-std=c++17", "-lineinfo", f"-DMINIRT_STAGE_BYTES={stage_bytes}",
             f"-DMINIRT_WEIGHTS_EVICT_FIRST={int(weights_evict_first)}"]
    lib = build_library(SOURCE, flags, f"gemv_chain_cuda-{arch}")
    lib.minirt_gemv_chain_launch.restype = ctypes.c_int
    lib.minirt_gemv_chain_launch.argtypes = (
        [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 10
        + [ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p])
    lib.minirt_gemv_chain_error.restype = ctypes.c_char_p
    lib.minirt_gemv_chain_error.argtypes = [ctypes.c_int]
    return lib


def tile_rows(k: int, pair: bool, stage_bytes: int = STAGE_BYTES) -> int:
    """Output rows per stage tile of a product with k input columns: the largest power of two whose rows (gate
    and up rows for a SiLU-and-multiply product) fill at most one stage and at most the 8 columns of the tensor
    cores' B operand. Raises ValueError naming k when one row does not fit a stage, or when a warp's share of a
    row (k / CONSUMER_WARPS) is not whole 8-column loads or more than MAX_CHUNKS x 32 columns."""
    per_row = k * 2 * (2 if pair else 1)
    rows = MMA_N // (2 if pair else 1)
    while rows > 1 and rows * per_row > stage_bytes:
        rows //= 2
    if rows * per_row > stage_bytes:
        raise ValueError(f"k: a row of {k} bf16 columns{' (gate and up)' if pair else ''} does not fit a "
                         f"{stage_bytes}-byte stage")
    if k % (8 * CONSUMER_WARPS) or k > CONSUMER_WARPS * MAX_CHUNKS * 32:
        raise ValueError(f"k: {k} columns over {CONSUMER_WARPS} warps must be whole 8-column loads, at most "
                         f"{MAX_CHUNKS * 32} per warp")
    return rows


class LayerTable(NamedTuple):
    """`layer_table`'s result: the addresses on the device, and the same addresses on the host (checked against the
    layers of each launch without a copy from the device)."""

    addresses: torch.Tensor       # int64 [num_layers, 6] on the layers' device
    pointers: tuple


def check_layers(layers) -> tuple[int, int, int, int]:
    """The chain's shapes `(hidden, n_qkv, k_o, inter)` from `layers`, each layer (W_qkv `[N1, H]`, W_o `[H, K_o]`
    with K_o <= N1, W_gate_up `[2 I, H]`, W_down `[H, I]`, g1 `[H]`, g2 `[H]`): bf16, contiguous, 16-byte aligned,
    on one CUDA device, every layer the same shapes. Host-side only (safe inside a CUDA graph capture). Raises
    ValueError naming layers."""
    layers = [tuple(layer) for layer in layers]
    if not layers or any(len(layer) != 6 for layer in layers):
        raise ValueError("layers: give at least one layer of (W_qkv, W_o, W_gate_up, W_down, g1, g2)")
    w1, w2, w3 = layers[0][:3]
    if w1.dim() != 2 or w2.dim() != 2 or w3.dim() != 2:
        raise ValueError(f"layers: W_qkv, W_o and W_gate_up must be matrices, got shapes {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}, {tuple(w3.shape)}")
    h, n1, k_o, inter = w1.shape[1], w1.shape[0], w2.shape[1], w3.shape[0] // 2
    if k_o > n1 or w3.shape[0] % 2:
        raise ValueError(f"layers: W_o's input ({k_o}) must come from W_qkv's outputs ({n1}), W_gate_up's rows must "
                         f"be gate then up (an even count, got {w3.shape[0]})")
    want = [(n1, h), (h, k_o), (2 * inter, h), (h, inter), (h,), (h,)]
    device = w1.device
    for i, layer in enumerate(layers):
        for t, shape in zip(layer, want):
            if (tuple(t.shape) != shape or t.dtype != torch.bfloat16 or t.device != device or device.type != "cuda"
                    or not t.is_contiguous() or t.data_ptr() % 16):
                raise ValueError(f"layers: layer {i} needs contiguous 16-byte-aligned bf16 CUDA tensors of shapes "
                                 f"{want} on one device, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return h, n1, k_o, inter


def layer_table(layers) -> LayerTable:
    """The table of addresses the kernel reads its weights from (`check_layers`' layers). Build it once, before
    any CUDA graph capture (it copies from the host). Raises ValueError naming layers."""
    layers = [tuple(layer) for layer in layers]
    check_layers(layers)
    return _table(layers)


def _pointers(layers) -> tuple:
    return tuple(tuple(t.data_ptr() for t in layer) for layer in layers)


def _table(layers) -> LayerTable:
    """`layer_table` of layers already checked."""
    pointers = _pointers(layers)
    return LayerTable(torch.tensor(pointers, dtype=torch.int64).to(layers[0][0].device), pointers)


def check_disjoint(writes: dict, reads: dict) -> None:
    """Raises ValueError naming a tensor the kernel writes (`writes`, None ones skipped) whose bytes overlap another
    written one or one it reads (`reads`: those may overlap each other, as tied weights do)."""
    span = lambda t: (t.data_ptr(), t.data_ptr() + t.nbytes)  # noqa: E731
    written = [(name, *span(t)) for name, t in writes.items() if t is not None]
    read = [(name, *span(t)) for name, t in reads.items() if t is not None]
    for i, (name, lo, hi) in enumerate(written):
        for other, lo2, hi2 in written[i + 1:] + read:
            if lo < hi2 and lo2 < hi:
                raise ValueError(f"{name}: overlaps {other} in memory; the kernel needs them apart")


def chain_plan(hidden: int, n_qkv: int, k_o: int, inter: int, grid: int,
               stage_bytes: int = STAGE_BYTES) -> list[Product]:
    """How the kernel tiles each product (qkv, o, gate/up, down): its rows per stage tile (`tile_rows`; gate/up:
    pairs). Raises ValueError naming the field when a block would own no row of gate/up (the kernel's flagged
    outputs are rewritten two layers later on the strength of every block writing gate/up rows), or when it would
    own more rows than the kernel sums in its epilogue (256) or take more than MAX_TILES tiles."""
    if stage_bytes < 256 or stage_bytes % 16:
        raise ValueError(f"stage_bytes: a multiple of 16 (the bulk copy's unit), at least 256, got {stage_bytes}")
    if inter < grid:
        raise ValueError(f"inter: every block must own rows of gate/up: {inter} rows for a grid of {grid}")
    plan = []
    for name, n, k, pair in (("hidden", n_qkv, hidden, False), ("k_o", hidden, k_o, False),
                             ("hidden", inter, hidden, True), ("inter", hidden, inter, False)):
        try:
            rows = tile_rows(k, pair, stage_bytes)
        except ValueError as err:                       # tile_rows names its k: say which of the chain's it is
            raise ValueError(f"{name}: {str(err).removeprefix('k: ')}") from None
        plan.append(Product(n, k, rows.bit_length() - 1))
    for name, p in zip(("n_qkv", "hidden", "inter", "hidden"), plan):
        per_block, r = math.ceil(p.n / grid), 1 << p.rows_log2
        if per_block > CONSUMER_WARPS * 32 or math.ceil(per_block / r) > MAX_TILES or p.n * grid >= 2 ** 32:
            raise ValueError(f"{name}: {p.n} rows over {grid} blocks is {per_block} per block; at most "
                             f"{CONSUMER_WARPS * 32} and {MAX_TILES} tiles of {r}")
    return plan


def shared_bytes(num_stages: int, hidden: int, k_o: int, inter: int, stage_bytes: int = STAGE_BYTES) -> int:
    """Dynamic shared memory of a launch: the ring and its barriers, the warp sums and sums of squares, the stream
    (float32) and the input (three bf16 parts)."""
    return (num_stages * (stage_bytes + BARRIER_BYTES) + 4 * (MAX_TILES * CONSUMER_WARPS * 8 + CONSUMER_WARPS + hidden)
            + 2 * 3 * max(hidden, k_o, inter))


def max_stages(device: torch.device, hidden: int, k_o: int, inter: int, stage_bytes: int = STAGE_BYTES) -> int:
    """The most stages a block's shared memory holds next to the rest."""
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    return (limit - shared_bytes(0, hidden, k_o, inter)) // (stage_bytes + BARRIER_BYTES)


def sync_words(hidden: int, n_qkv: int, inter: int) -> int:
    """The 32-bit words of `sync_buffer`: each product's output rows as flagged words (q/k/v, o, act, out), each
    rounded up to 4 words (16 bytes), for even layers and again for odd ones."""
    return 2 * sum(-(-n // 4) * 4 for n in (n_qkv, hidden, inter, hidden))


def sync_buffer(device: torch.device, hidden: int, n_qkv: int, inter: int) -> torch.Tensor:
    """The int32 buffer `gemv_chain_layers` signals through (zeroed by each launch): `sync_words` words."""
    return torch.zeros(sync_words(hidden, n_qkv, inter), dtype=torch.int32, device=device)


def gemv_chain_layers(x: torch.Tensor, layers, residual: torch.Tensor | None = None, *,
                      table: LayerTable | None = None, sync: torch.Tensor | None = None,
                      num_stages: int | None = None, grid: int | None = None, eps: float = 1e-6,
                      outputs: ChainOutputs | None = None, stage_bytes: int = STAGE_BYTES,
                      weights_evict_first: bool = False, skip: int = 0,
                      timeline: torch.Tensor | None = None) -> ChainOutputs:
    """Every layer of `layers` (see `check_layers`) in one launch, for one row: x `[1, H]` bf16, residual `[1, H]`
    or None. table: `layer_table(layers)` of these layers, built here when None (not inside a CUDA graph capture).
    sync: `sync_buffer(device, hidden, n_qkv, inter)` (None: a new one), zeroed here on the stream before the launch
    (inside a graph too); one launch's alone while it runs (two launches in flight on one buffer would read each
    other's words). stage_bytes: the ring's stage size (one library per size). weights_evict_first: the weights'
    copies ask L2 to evict them first (a library of its own; the results are the same bits). num_stages: ring stages
    (None: as many as shared memory holds). grid: blocks (None: one per SM). Every block waits for the others, so
    all must be resident at once: at most one per SM is checked, not that the SMs are free (other kernels spinning
    on the GPU at the same time, or an MPS share smaller than the GPU, would make it wait forever).
    outputs: where to write (each contiguous bf16 of its field's shape, apart from each other, from sync and
    timeline, and from what the kernel reads: x, residual, the layers, the table; None: new tensors). skip: 0, or
    SKIP_* bits that leave a part of the work out, for timing breakdowns only (the results are then wrong).
    timeline: None, or an int64 `[grid, num_layers * 4, len(TIMELINE_STAMPS)]` CUDA tensor for the SM clock at
    TIMELINE_STAMPS (a producer stamp stays unset where a block streams no rows of a product, or with SKIP_STREAM).
    Returns the last layer's `ChainOutputs`. Raises ValueError naming an argument that does not fit."""
    if missing := cuda_chain_missing(x.device):
        raise ValueError(f"x: the CUDA GEMV chain needs {' and '.join(missing)}")
    if skip & ~(SKIP_BARRIERS | SKIP_PROLOGUE | SKIP_DOTS | SKIP_STREAM):
        raise ValueError(f"skip: 0 or SKIP_* bits, got {skip}")
    layers = [tuple(layer) for layer in layers]
    hidden, n_qkv, k_o, inter = check_layers(layers)           # every launch: the table holds only addresses
    if layers[0][0].device != x.device:
        raise ValueError(f"layers: must be on x's device {x.device}, got {layers[0][0].device}")
    table = _table(layers) if table is None else table
    if not isinstance(table, LayerTable) or table.pointers != _pointers(layers):
        raise ValueError("table: must be layer_table(layers) of these very layers (their addresses differ)")
    if x.numel() != hidden or x.dtype != torch.bfloat16 or not x.is_contiguous() or x.data_ptr() % 16:
        raise ValueError(f"x: must be a contiguous 16-byte-aligned bf16 [1, {hidden}], got {x.dtype} "
                         f"{tuple(x.shape)} at {x.data_ptr():#x}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device
                                 or not residual.is_contiguous() or residual.data_ptr() % 16):
        raise ValueError(f"residual: must be contiguous 16-byte-aligned bf16 with x's shape {tuple(x.shape)}, got "
                         f"{residual.dtype} {tuple(residual.shape)} at {residual.data_ptr():#x}")
    sms = num_sms(x.device)
    grid = sms if grid is None else grid
    if not 1 <= grid <= sms:
        raise ValueError(f"grid: 1 to {sms} blocks (one per SM at most), got {grid}")
    if len(layers) * 4 >= 1 << 16:
        raise ValueError(f"layers: at most {(1 << 16) // 4 - 1} (a flag counts products in 16 bits), got "
                         f"{len(layers)}")
    plan = chain_plan(hidden, n_qkv, k_o, inter, grid, stage_bytes)
    most = max_stages(x.device, hidden, k_o, inter, stage_bytes)
    num_stages = most if num_stages is None else num_stages
    if not 2 <= num_stages <= most:
        raise ValueError(f"num_stages: 2 to {most} stages fit a block's shared memory, got {num_stages}")
    if timeline is not None and (timeline.dtype != torch.int64 or timeline.device != x.device
                                 or not timeline.is_contiguous()
                                 or tuple(timeline.shape) != (grid, 4 * len(layers), len(TIMELINE_STAMPS))):
        raise ValueError(f"timeline: must be a contiguous int64 [{grid}, {4 * len(layers)}, {len(TIMELINE_STAMPS)}] "
                         f"on {x.device}, got {timeline.dtype} {tuple(timeline.shape)} on {timeline.device}")
    words = sync_words(hidden, n_qkv, inter)
    if sync is None:
        sync = sync_buffer(x.device, hidden, n_qkv, inter)
    elif (sync.dtype != torch.int32 or sync.numel() < words or sync.device != x.device or not sync.is_contiguous()
          or sync.data_ptr() % 16):
        raise ValueError(f"sync: must be sync_buffer({x.device}, {hidden}, {n_qkv}, {inter}), int32 [{words}] "
                         f"16-byte aligned, got {sync.dtype} {tuple(sync.shape)} on {sync.device}")
    new = functools.partial(torch.empty, dtype=x.dtype, device=x.device)
    sizes = ChainOutputs(n_qkv, hidden, hidden, inter, hidden, hidden)
    if outputs is None:
        outs = ChainOutputs(*(new(1, n) for n in sizes))
    else:
        outs = ChainOutputs(*outputs)
        for name, t, n in zip(ChainOutputs._fields, outs, sizes):
            if (t.numel() != n or t.dtype != x.dtype or t.device != x.device or not t.is_contiguous()
                    or t.data_ptr() % 16):
                raise ValueError(f"outputs: {name} must be a contiguous 16-byte-aligned bf16 [1, {n}] on {x.device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device} at {t.data_ptr():#x}")
    weights = {f"layer {i}'s {part}": t for i, layer in enumerate(layers)
               for part, t in zip(("W_qkv", "W_o", "W_gate_up", "W_down", "g1", "g2"), layer)}
    check_disjoint({**outs._asdict(), "sync": sync, "timeline": timeline},
                   {"x": x, "residual": residual, "table": table.addresses, **weights})
    lib = library(stage_bytes=stage_bytes, weights_evict_first=weights_evict_first)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    sync.zero_()
    with torch.cuda.device(x.device):                      # the attribute and the launch act on the current device
        err = lib.minirt_gemv_chain_launch(
            ptr(table.addresses), len(layers), ptr(x), ptr(residual), ptr(outs.qkv), ptr(outs.o), ptr(outs.act),
            ptr(outs.out), ptr(outs.stream_attn), ptr(outs.stream_mlp), ptr(sync),
            (ctypes.c_int * 12)(*(v for product in plan for v in product)), num_stages, eps, grid, skip,
            ptr(timeline), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"gemv_chain_layers: the launch failed: {lib.minirt_gemv_chain_error(err).decode()}")
    return outs
