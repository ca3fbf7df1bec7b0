"""`gemv_chain_layers` (every layer's four GEMVs in one persistent CUDA kernel, weights streamed through shared
memory) against two oracles: the chain in float64 with torch, rounded to bf16 where the model rounds
(`reference_chain`), and the four
`linear_gemv` calls per layer it replaces. Its tile plan against a brute-force search, and its refusals, on any
machine; the kernel itself needs a Hopper GPU and nvcc (skipped elsewhere).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lab.kernels import gemv_chain_cuda as C

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
MISSING = C.cuda_chain_missing(DEVICE)
needs_kernel = pytest.mark.skipif(bool(MISSING), reason=f"needs {' and '.join(MISSING)}")
QWEN3 = (1024, 4096, 2048, 3072)       # (hidden, q/k/v rows, o_proj's input, intermediate)
ODD = (640, 1280, 1152, 1536)          # rows no grid divides evenly; warps' shares not whole 32-column chunks
WIDE = (1024, 2048, 2048, 3072)        # o_proj reads all of q/k/v
TINY = (128, 384, 256, 512)            # fewer hidden rows than SMs: blocks that own none of a product's rows


def make_layers(hidden, n_qkv, k_o, inter, num_layers, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16).to(DEVICE)

    layers = [(rnd(n_qkv, hidden, scale=hidden ** -0.5), rnd(hidden, k_o, scale=k_o ** -0.5),
               rnd(2 * inter, hidden, scale=hidden ** -0.5), rnd(hidden, inter, scale=inter ** -0.5),
               rnd(hidden, scale=0.3, offset=1.0), rnd(hidden, scale=0.3, offset=1.0)) for _ in range(num_layers)]
    return rnd(1, hidden), rnd(1, hidden), layers


def linear_gemv_chain(x, residual, layers):
    from minirt.kernels.gemv_triton import linear_gemv

    stream = residual
    for w_qkv, w_o, w_gu, w_down, g1, g2 in layers:
        qkv, s1 = linear_gemv(x, w_qkv, norm_weight=g1, residual=stream)
        o = linear_gemv(qkv[:, :w_o.shape[1]], w_o)
        act, stream = linear_gemv(o, w_gu, silu_and_mul=True, norm_weight=g2, residual=s1)
        x = linear_gemv(act, w_down)
    return C.ChainOutputs(qkv, s1, o, act, stream, x)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def poisoned(hidden, n_qkv, inter):
    nan = lambda n: torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # noqa: E731
    return C.ChainOutputs(nan(n_qkv), nan(hidden), nan(hidden), nan(inter), nan(hidden), nan(hidden))


@pytest.mark.parametrize("pair", [False, True], ids=["plain", "gate-up"])
@pytest.mark.parametrize("k", [64, 256, 512, 640, 644, 768, 1024, 1152, 1536, 2048, 3072, 3136, 4096, 12288])
def test_tile_rows_is_the_largest_power_of_two_that_fits(k, pair):
    """Brute force: of the powers of two up to 8 stage rows (the tensor cores' B operand), the largest whose rows
    fit a stage; refused when none fits, or when a warp's share of a row is not whole 8-column loads, or more than
    MAX_CHUNKS x 32."""
    stage_rows = lambda r: r * (2 if pair else 1)  # noqa: E731
    fits = [r for r in (1, 2, 4, 8) if stage_rows(r) <= 8 and stage_rows(r) * k * 2 <= C.STAGE_BYTES]
    share = k / C.CONSUMER_WARPS
    if not fits or share % 8 or share > 32 * C.MAX_CHUNKS:
        with pytest.raises(ValueError, match="^k: "):
            C.tile_rows(k, pair)
    else:
        assert C.tile_rows(k, pair) == max(fits)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="^k: .*8-column loads"):
        C.tile_rows(644, False)
    with pytest.raises(ValueError, match="^k: a row of 12288"):
        C.tile_rows(12288, False)
    with pytest.raises(ValueError, match="^n_qkv: 4096 rows over 7 blocks"):
        C.chain_plan(*QWEN3, grid=7)
    with pytest.raises(ValueError, match="^inter: 1536 rows over 12 blocks"):
        C.chain_plan(*ODD, grid=12)
    with pytest.raises(ValueError, match="^layers: give at least one"):
        C.layer_table([])
    cpu = torch.zeros(1, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^inter: every block must own rows of gate/up: 64 rows for a grid of 132"):
        C.chain_plan(128, 384, 256, 64, grid=132)
    with pytest.raises(ValueError, match="^x: the CUDA GEMV chain needs a CUDA device"):
        C.gemv_chain_layers(cpu, [])


def bf16_step(ref):
    """bf16's rounding step at each value of ref (float64): 2**-7 of its leading bit."""
    return torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2 ** -100))) - 7)


def rounding_steps(a, ref):
    """|a - ref| in bf16 rounding steps at ref's magnitude."""
    return (a.double() - ref).abs() / bf16_step(ref)


def assert_rounded_from(name, a, ref, steps=1.0):
    """a is ref (float64) rounded to bf16, but for rare elements that a float32 sum in another order put one step
    away; near zero, where the terms cancel, a step is tiny: there 2**-12 of the vector's RMS is allowed too."""
    assert not a.isnan().any(), f"{name}: not every element written"
    bad = (a.double() - ref).abs() > steps * bf16_step(ref) + 2 ** -12 * ref.pow(2).mean().sqrt()
    off = (a != ref.to(torch.bfloat16)).double().mean().item()
    assert not bad.any() and off < 0.02, (f"{name}: {off:.1%} of elements not ref rounded, {int(bad.sum())} off by "
                                          f"more than {steps} steps, worst {rounding_steps(a, ref).max():.2f}")


@pytest.mark.parametrize("shape", [QWEN3, ODD, WIDE, TINY], ids=["qwen3", "odd", "wide", "tiny"])
def test_chain_plan_tiles_every_product(shape):
    """Each product's tile (tile_rows' rows; gate/up: gate and up rows) fits a stage and the tensor cores' 8 B
    columns; each warp's share of k is whole 8-column loads, at most MAX_CHUNKS x 32."""
    hidden, n_qkv, k_o, inter = shape
    plan = C.chain_plan(*shape, grid=132)
    for p, (n, k, pair) in zip(plan, [(n_qkv, hidden, False), (hidden, k_o, False), (inter, hidden, True),
                                      (hidden, inter, False)]):
        stage_rows = (1 << p.rows_log2) * (2 if pair else 1)
        assert (p.n, p.k, 1 << p.rows_log2) == (n, k, C.tile_rows(k, pair))
        assert stage_rows <= 8 and stage_rows * k * 2 <= C.STAGE_BYTES
        assert k % (8 * C.CONSUMER_WARPS) == 0 and k // C.CONSUMER_WARPS <= 32 * C.MAX_CHUNKS


@needs_kernel
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("shape,grid", [(QWEN3, None), (ODD, None), (ODD, 33), (WIDE, None), (TINY, None)],
                         ids=["qwen3", "odd", "odd-33-blocks", "wide", "tiny"])
def test_chain_matches_float64_and_linear_gemv(shape, grid, with_residual, num_layers):
    """Each product of the last layer is float64's product of the chain's own inputs to it, rounded to bf16 (one
    step off at most, for rare elements: float32 sums in another order); the whole chain stays within a few steps
    of float64's (`reference_chain`) and of the four linear_gemv calls (the steps carry from layer to layer)."""
    x, residual, layers = make_layers(*shape, num_layers)
    residual = residual if with_residual else None
    got = C.gemv_chain_layers(x, layers, residual, grid=grid, outputs=poisoned(shape[0], shape[1], shape[3]))
    assert_products_rounded_from_their_inputs(got, layers[-1])
    if num_layers == 1:
        s0 = x if residual is None else (x.float() + residual.float()).to(torch.bfloat16)
        assert torch.equal(got.stream_attn, s0), "s1"
    want = C.reference_chain(x, layers, residual)
    ref = linear_gemv_chain(x, residual, layers)
    for name, a, w, r in zip(C.ChainOutputs._fields, got, want, ref):
        assert rel_err(a, w) < 2 ** -5, f"{name}: {rel_err(a, w):.2e} from float64"
        assert rel_err(a, r) < 2 ** -5, f"{name}: {rel_err(a, r):.2e} from the four linear_gemv calls"


@needs_kernel
def test_after_28_layers_each_product_is_still_rounded_from_its_inputs():
    """Qwen3-0.6B's depth: whatever the rounding steps carried from layer to layer, the last layer's products are
    float64's products of the kernel's own inputs rounded to bf16 (a stale or missing input word would not be)."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    hidden, n_qkv, k_o, inter = QWEN3
    rnd = lambda *shape, scale=1.0, offset=0.0: (offset + scale * torch.randn(  # noqa: E731
        *shape, generator=gen, device=DEVICE)).to(torch.bfloat16)
    layers = [(rnd(n_qkv, hidden, scale=hidden ** -0.5), rnd(hidden, k_o, scale=k_o ** -0.5),
               rnd(2 * inter, hidden, scale=hidden ** -0.5), rnd(hidden, inter, scale=inter ** -0.5),
               rnd(hidden, scale=0.3, offset=1.0), rnd(hidden, scale=0.3, offset=1.0)) for _ in range(28)]
    x, residual = rnd(1, hidden), rnd(1, hidden)
    runs = [C.gemv_chain_layers(x, layers, residual, outputs=poisoned(hidden, n_qkv, inter)) for _ in range(3)]
    assert_products_rounded_from_their_inputs(runs[0], layers[-1])
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again)), "28 layers: differs between runs"


def assert_products_rounded_from_their_inputs(got, layer):
    """Each product of `layer` in `got` (a ChainOutputs) is float64's product of the inputs the kernel gave it,
    rounded to bf16 (one step off at most, for rare elements: float32 sums in another order); s2 is o + s1
    rounded."""
    w_qkv, w_o, w_gu, w_down, g1, g2 = (t.double() for t in layer)
    d = lambda t: t.double()  # noqa: E731
    norm = lambda s, g: s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # noqa: E731
    assert_rounded_from("qkv", got.qkv, d(got.stream_attn) @ torch.diag(g1) @ w_qkv.T
                        * torch.rsqrt(d(got.stream_attn).pow(2).mean() + 1e-6))
    assert_rounded_from("o", got.o, d(got.qkv)[:, :w_o.shape[1]] @ w_o.T)
    assert torch.equal(got.stream_mlp, (got.o.float() + got.stream_attn.float()).to(torch.bfloat16)), "s2"
    gate, up = (norm(d(got.stream_mlp), g2) @ w_gu.T).chunk(2, dim=-1)
    act = F.silu(gate.to(torch.bfloat16).double()) * up.to(torch.bfloat16).double()
    assert_rounded_from("act", got.act, act, steps=2.0)      # a gate or up one step off moves act by about one
    assert_rounded_from("out", got.out, d(got.act) @ w_down.T)


@needs_kernel
@pytest.mark.parametrize("shape,num_stages,stage_bytes", [(QWEN3, 2, 16384), (QWEN3, 5, 16384),
                                                          (QWEN3, None, 16384), (QWEN3, None, 8192),
                                                          (TINY, 2, 8192)],
                         ids=["qwen3-2", "qwen3-5", "qwen3-deepest", "qwen3-deepest-8192", "tiny-2-of-8192"])
def test_chain_is_deterministic_at_any_ring_depth(shape, num_stages, stage_bytes):
    """Same inputs, same bits from run to run, whatever the ring and its stages (a race would move the error
    between runs); the stage size moves the sums' order (rows per tile), so each is its own baseline, near
    float64."""
    x, residual, layers = make_layers(*shape, 4, seed=1)
    run = lambda: C.gemv_chain_layers(x, layers, residual, num_stages=num_stages, stage_bytes=stage_bytes)  # noqa
    first = run()
    want = C.reference_chain(x, layers, residual).out
    assert rel_err(first.out, want) < 2 ** -6, f"{rel_err(first.out, want):.2e} from float64"
    for _ in range(3):
        again = run()
        for name, a, b in zip(C.ChainOutputs._fields, first, again):
            assert torch.equal(a, b), f"{name}: differs between runs ({num_stages} x {stage_bytes} bytes)"


@needs_kernel
def test_weights_evict_first_changes_no_bit():
    """The weights' L2 policy is a cache hint: the same bits as the default build, layer after layer."""
    x, residual, layers = make_layers(*QWEN3, 3, seed=6)
    want = C.gemv_chain_layers(x, layers, residual)
    got = C.gemv_chain_layers(x, layers, residual, weights_evict_first=True)
    for name, a, b in zip(C.ChainOutputs._fields, got, want):
        assert torch.equal(a, b), f"{name}: differs with the weights evicted first"


@needs_kernel
def test_chain_in_a_cuda_graph():
    """Captured once (the launch zeroes its sync buffer, in the graph too), replayed on new x: the eager launch's
    results."""
    x, residual, layers = make_layers(*QWEN3, 2, seed=2)
    table = C.layer_table(layers)
    sync = C.sync_buffer(DEVICE, QWEN3[0], QWEN3[1], QWEN3[3])
    C.gemv_chain_layers(x, layers, residual, table=table, sync=sync)       # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = C.gemv_chain_layers(x, layers, residual, table=table, sync=sync)
    for seed in (3, 4):
        x.copy_(make_layers(*QWEN3, 0, seed=seed)[0])
        graph.replay()
        want = C.gemv_chain_layers(x, layers, residual, table=table)
        for name, a, b in zip(C.ChainOutputs._fields, outs, want):
            assert torch.equal(a, b), f"{name}: the replay differs from an eager launch"


@needs_kernel
def test_timeline_stamps_follow_each_block_through_its_products():
    """Every block stamps every product, its consumer stamps in order and each product after the one before;
    the producer issues a product's first copy before its last. The results are the untimed launch's."""
    x, residual, layers = make_layers(*ODD, 3, seed=5)
    grid = C.num_sms(DEVICE)
    timeline = torch.zeros(grid, 12, len(C.TIMELINE_STAMPS), dtype=torch.int64, device=DEVICE)
    got = C.gemv_chain_layers(x, layers, residual, timeline=timeline)
    want = C.gemv_chain_layers(x, layers, residual)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    t = timeline.cpu()
    consumer = t[..., :6]
    assert (consumer > 0).all() and (consumer.diff(dim=-1) >= 0).all()
    assert (t[:, 1:, 0] >= t[:, :-1, 5]).all()
    assert (t[..., 6:] > 0).all() and (t[..., 7] >= t[..., 6]).all()     # every block streams rows of each


class FakeTensor:
    """What the launch path reads of a tensor (shape, dtype, device, address, size), on a machine without CUDA."""

    def __init__(self, *shape, ptr, dtype=torch.bfloat16, device="cuda:0"):
        self.shape, self.dtype, self.device, self.ptr = torch.Size(shape), dtype, torch.device(device), ptr
        self.zeroed = 0

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.shape.numel()

    def dim(self):
        return len(self.shape)

    def is_contiguous(self):
        return True

    def zero_(self):
        self.zeroed += 1
        return self

    @property
    def nbytes(self):
        return self.numel() * self.dtype.itemsize


@pytest.fixture
def fake_launch(monkeypatch):
    """`gemv_chain_layers` with the library, the device queries and the stream faked: what it would launch with."""
    calls = []

    class Lib:
        def minirt_gemv_chain_launch(self, *args):
            calls.append(args)
            return 0

    monkeypatch.setattr(C, "cuda_chain_missing", lambda device: [])
    monkeypatch.setattr(C, "num_sms", lambda device: 132)
    monkeypatch.setattr(C, "max_stages", lambda *args: 12)
    monkeypatch.setattr(C, "library", lambda **kwargs: calls.append(kwargs) or Lib())
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 1234})())
    hidden, n_qkv, k_o, inter = QWEN3
    address = iter(range(1 << 20, 1 << 40, 1 << 24))           # 16 MiB apart, 16-byte aligned
    new = lambda *shape, **kw: FakeTensor(*shape, ptr=next(address), **kw)  # noqa: E731
    layers = [(new(n_qkv, hidden), new(hidden, k_o), new(2 * inter, hidden), new(hidden, inter), new(hidden),
               new(hidden)) for _ in range(3)]
    table = C.LayerTable(new(3, 6, dtype=torch.int64), tuple(tuple(t.data_ptr() for t in layer) for layer in layers))
    args = dict(x=new(1, hidden), layers=layers, residual=new(1, hidden), table=table,
                sync=new(C.sync_words(hidden, n_qkv, inter), dtype=torch.int32),
                outputs=C.ChainOutputs(new(1, n_qkv), new(1, hidden), new(1, hidden), new(1, inter), new(1, hidden),
                                       new(1, hidden)))
    return calls, args, new


def test_the_launch_gets_each_argument_and_a_zeroed_counter(fake_launch):
    calls, args, _ = fake_launch
    outs = C.gemv_chain_layers(**args, skip=C.SKIP_DOTS, weights_evict_first=True)
    built, launch = calls
    assert built == {"stage_bytes": C.STAGE_BYTES, "weights_evict_first": True}
    o = args["outputs"]
    want = (args["table"].addresses.ptr, 3, args["x"].ptr, args["residual"].ptr, o.qkv.ptr, o.o.ptr, o.act.ptr,
            o.out.ptr, o.stream_attn.ptr, o.stream_mlp.ptr, args["sync"].ptr)
    assert launch[:11] == want
    assert list(launch[11]) == [v for product in C.chain_plan(*QWEN3, grid=132) for v in product]
    assert launch[12:] == (12, 1e-6, 132, C.SKIP_DOTS, None, 1234)
    assert args["sync"].zeroed == 1 and outs == o


@pytest.mark.parametrize("change,message", [
    (lambda a, new: a.update(table=C.LayerTable(a["table"].addresses, a["table"].pointers[:2])), "^table: "),
    (lambda a, new: a["layers"].append(a["layers"][0][:5] + (new(1024, dtype=torch.float32),)), "^layers: layer 3"),
    (lambda a, new: a.update(layers=[(new(1024, 1024),) + a["layers"][0][1:]]), "^layers: W_o's input"),
    (lambda a, new: a.update(x=new(1, 1024, device="cuda:1")), "^layers: must be on x's device"),
    (lambda a, new: a.update(x=FakeTensor(1, 1024, ptr=a["x"].ptr + 8)), "^x: .*16-byte"),
    (lambda a, new: a.update(residual=new(1, 2048)), "^residual: "),
    (lambda a, new: a.update(grid=133), "^grid: 1 to 132"),
    (lambda a, new: a.update(num_stages=13), "^num_stages: 2 to 12"),
    (lambda a, new: a.update(skip=64), "^skip: "),
    (lambda a, new: a.update(sync=new(C.sync_words(1024, 4096, 3072) - 1, dtype=torch.int32)), "^sync: "),
    (lambda a, new: a.update(timeline=new(132, 12, 7, dtype=torch.int64)), "^timeline: "),
    (lambda a, new: a.update(outputs=a["outputs"]._replace(act=new(1, 4096))), "^outputs: act "),
    (lambda a, new: a.update(outputs=a["outputs"]._replace(act=FakeTensor(1, 3072, ptr=a["outputs"].qkv.ptr))),
     "^qkv: overlaps act"),
    (lambda a, new: a.update(outputs=a["outputs"]._replace(out=FakeTensor(1, 1024, ptr=a["x"].ptr))),
     "^out: overlaps x"),
    (lambda a, new: a.update(outputs=a["outputs"]._replace(o=FakeTensor(1, 1024, ptr=a["layers"][2][5].ptr))),
     "^o: overlaps layer 2's g2"),
    (lambda a, new: a.update(sync=FakeTensor(C.sync_words(1024, 4096, 3072), dtype=torch.int32,
                                             ptr=a["layers"][1][0].ptr + 64)), "^sync: overlaps layer 1's W_qkv"),
], ids=["table-of-other-layers", "layer-dtype", "k_o-past-qkv", "device", "x-unaligned", "residual-shape", "grid",
        "num_stages", "skip", "sync-size", "timeline-shape", "output-shape", "outputs-overlap", "output-on-x",
        "output-on-a-weight", "sync-on-a-weight"])
def test_the_launch_refuses_by_name(fake_launch, change, message):
    calls, args, new = fake_launch
    change(args, new)
    with pytest.raises(ValueError, match=message):
        C.gemv_chain_layers(**args)
    assert not calls and args["sync"].zeroed == 0


def test_tile_rows_refusals_name_the_chain_field():
    with pytest.raises(ValueError, match="^k_o: 644 columns"):
        C.chain_plan(1024, 4096, 644, 3072, grid=132)
    with pytest.raises(ValueError, match="^inter: a row of 12288"):
        C.chain_plan(1024, 4096, 2048, 12288, grid=132)
