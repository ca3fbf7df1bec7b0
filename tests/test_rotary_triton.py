"""`norm_and_rotate_triton` (Qwen3's q/k norm and the rotation of q and k in one Triton kernel) against an
oracle: `minirt.fast.ops.norm_and_rotate` in float64 on the same inputs. Kernel cases need CUDA or Triton's
interpreter (`TRITON_INTERPRET=1`); the argument checks need Triton importable."""

from __future__ import annotations

import os

import pytest
import torch

from minirt.fast.ops import norm_and_rotate

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cuda"] if CUDA else []) + (["cpu"] if INTERPRET else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def check(B, T, num_heads, num_kv_heads, head_dim, rot, norm, dtype, device, merged=True, pdl=False, seed=0, eps=1e-6,
          scale=1.0, tokens_per_program=None, num_warps=None):
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    gen = torch.Generator().manual_seed(seed)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if merged:     # q and k as the engine passes them: slices of one q/k/v projection, so tokens are strided
        qkv = (scale * torch.randn(B, T, sum(sizes), generator=gen)).to(dtype).to(device)
        q, k, _ = qkv.split(sizes, dim=-1)
    else:
        q, k = ((scale * torch.randn(B, T, n, generator=gen)).to(dtype).to(device) for n in sizes[:2])
    q, k = q.view(B, T, num_heads, head_dim), k.view(B, T, num_kv_heads, head_dim)
    angles = torch.rand(B, T, rot // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
    if merged:     # ... and cos/sin as the engine passes them: the halves of one gathered table, rows strided
        both = torch.cat([cos, sin], -1)
        cos, sin = both[..., :rot], both[..., rot:]
    qw, kw = ((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2))
    weights = (qw, kw, eps) if norm else (None, None, 0.0)
    got = norm_and_rotate_triton(q, k, cos, sin, *weights, pdl=pdl, tokens_per_program=tokens_per_program,
                                 num_warps=num_warps)
    want = norm_and_rotate(q.double(), k.double(), cos.double(), sin.double(),
                           *(w.double() if isinstance(w, torch.Tensor) else w for w in weights))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g.double(), w, atol=TOL[dtype] * w.abs().max().item(), rtol=TOL[dtype])


CASES = [(1, 1, 16, 8, 128, 128, True), (2, 5, 4, 2, 32, 32, True), (1, 7, 4, 4, 64, 32, True),
         (3, 2, 6, 2, 16, 16, False), (1, 3, 2, 1, 64, 48, False),
         # from MANY_TOKENS tokens on, programs take several heads (2, 8 and 4 here)
         (1, 80, 4, 2, 32, 32, True), (2, 40, 16, 8, 64, 48, True), (1, 64, 12, 4, 16, 16, False)]
# (B, T, H, Hkv, D, rotary dim, q/k norm)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "separate"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm_and_rotate_triton_matches_reference(case, merged, dtype, device):
    pytest.importorskip("triton")
    check(*case, dtype, device, merged=merged)


# Several tokens per program (B, T, H, Hkv, D, rotary dim, q/k norm, tokens per program, warps): token counts that
# the tokens per program do not divide, one and several heads a program, partial rotary.
MULTI_TOKEN_CASES = [(1, 7, 4, 2, 32, 32, True, 4, None), (1, 70, 4, 2, 32, 32, True, 4, 8),
                     (3, 25, 16, 8, 64, 48, True, 2, None), (1, 66, 12, 4, 16, 16, False, 8, 1)]


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MULTI_TOKEN_CASES, ids=str)
def test_norm_and_rotate_triton_several_tokens_per_program(case, dtype, device):
    pytest.importorskip("triton")
    *shape, tokens_per_program, num_warps = case
    check(*shape, dtype, device, tokens_per_program=tokens_per_program, num_warps=num_warps)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_and_rotate_triton_default_tokens_per_program(dtype, device, monkeypatch):
    """The default launch from 2 * MIN_TOKEN_GROUPS tokens on, with MIN_TOKEN_GROUPS made small so that the
    interpreter runs it quickly: 70 tokens take 16 tokens of 2 heads a program, the last program 6 tokens."""
    pytest.importorskip("triton")
    from minirt.kernels import rotary_triton

    monkeypatch.setattr(rotary_triton, "MIN_TOKEN_GROUPS", 4)
    assert rotary_triton.launch_config(70, 4, 2, 32) == (16, 2, 4)
    check(1, 70, 4, 2, 32, 32, True, dtype, device)


def test_launch_config_takes_tokens_per_program_for_large_prefills():
    """`launch_config`: one head and one token a program for a decode step, several heads from MANY_TOKENS tokens
    on, several tokens too from 2 * MIN_TOKEN_GROUPS (Qwen3-0.6B's 8,192-token prefill: 4 tokens of 8 heads, 8
    warps); overrides must be powers of two."""
    pytest.importorskip("triton")
    from minirt.kernels.rotary_triton import MANY_TOKENS, MIN_TOKEN_GROUPS, launch_config

    assert launch_config(1, 16, 8, 128) == (1, 1, 4)
    assert launch_config(MANY_TOKENS, 16, 8, 128) == (1, 8, 4)
    assert launch_config(2 * MIN_TOKEN_GROUPS - 1, 16, 8, 128) == (1, 8, 4)
    assert launch_config(2 * MIN_TOKEN_GROUPS, 16, 8, 128) == (2, 8, 4)
    assert launch_config(8192, 16, 8, 128) == (4, 8, 4)
    assert launch_config(8192, 16, 8, 128, tokens_per_program=16, num_warps=2) == (16, 8, 2)
    assert launch_config(5, 16, 8, 128, tokens_per_program=4) == (4, 1, 4)
    for kw, message in (({"tokens_per_program": 3}, r"^tokens_per_program: must be a power of two, got 3"),
                        ({"tokens_per_program": 0}, r"^tokens_per_program: must be a power of two, got 0"),
                        ({"num_warps": 64}, r"^num_warps: must be a power of two up to 32, got 64"),
                        ({"num_warps": 4.0}, r"^num_warps: must be a power of two up to 32, got 4.0")):
        with pytest.raises(ValueError, match=message):
            launch_config(8192, 16, 8, 128, **kw)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_program", [None, 4], ids=["default", "4-tokens-per-program"])
def test_norm_and_rotate_triton_rounds_as_eager_bf16(device, tokens_per_program):
    """In bf16 the kernel rounds after each op as eager torch (and transformers) do: its output equals the eager
    `norm_and_rotate` in bf16 except where rsqrt or the mean's summation order differ in the last bit."""
    pytest.importorskip("triton")
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    gen = torch.Generator().manual_seed(3)
    tokens = 64 if device == "cuda" else 8
    q, k = (torch.randn(1, tokens, h, 128, generator=gen).to(torch.bfloat16).to(device) for h in (16, 8))
    angles = torch.rand(1, tokens, 64, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16).to(device) for f in (torch.cos, torch.sin))
    qw, kw = ((1 + 0.3 * torch.randn(128, generator=gen)).to(torch.bfloat16).to(device) for _ in range(2))
    for got, want in zip(norm_and_rotate_triton(q, k, cos, sin, qw, kw, 1e-6, tokens_per_program=tokens_per_program),
                         norm_and_rotate(q, k, cos, sin, qw, kw, 1e-6)):
        assert (got == want).float().mean().item() > 0.99
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("eps,scale", [(0.5, 1.0), (1e-2, 0.05)], ids=["eps0.5", "small-inputs"])
def test_norm_and_rotate_triton_uses_eps(eps, scale):
    pytest.importorskip("triton")
    check(1, 2, 4, 2, 32, 32, True, torch.float32, DEVICES[0], eps=eps, scale=scale)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_norm_and_rotate_triton_with_pdl_equals_without():
    """As in a decode step: a PDL GEMV writes q/k/v, the PDL rotary kernel reads them at once, all in one CUDA
    graph replayed on new inputs; the results equal the same chain launched without PDL, bit for bit."""
    from minirt.kernels import pdl_missing
    from minirt.kernels.gemv_triton import linear_gemv
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, 1024, generator=gen) / 32).to(torch.bfloat16).cuda()
    x = torch.randn(1, 1, 1024, dtype=torch.bfloat16, device="cuda")
    angles = torch.rand(1, 1, 64, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16).cuda() for f in (torch.cos, torch.sin))
    qw, kw = ((1 + 0.3 * torch.randn(128, generator=gen)).to(torch.bfloat16).cuda() for _ in range(2))

    def step(pdl):
        q, k, _ = linear_gemv(x, w, pdl=pdl).split([2048, 1024, 1024], dim=-1)
        return norm_and_rotate_triton(q.view(1, 1, 16, 128), k.view(1, 1, 8, 128), cos, sin, qw, kw, 1e-6, pdl=pdl)

    step(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        refs = step(False)
        torch.cuda.synchronize()
        assert all(torch.equal(o, r) for o, r in zip(outs, refs))


def test_norm_and_rotate_triton_argument_errors():
    pytest.importorskip("triton")
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 2, 16)
    cos = sin = torch.randn(1, 2, 16)
    w = torch.ones(16)
    with pytest.raises(ValueError, match=r"^k: must be \[1, 2, Hkv, 16\] like q"):
        norm_and_rotate_triton(q, torch.randn(1, 2, 2, 8), cos, sin, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^cos: the rotary dim must be even and at most head_dim = 16, got 15"):
        norm_and_rotate_triton(q, k, torch.randn(1, 2, 15), torch.randn(1, 2, 15), w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^q: head_dim must be a power of two, got 24"):
        norm_and_rotate_triton(torch.randn(1, 2, 4, 24), torch.randn(1, 2, 2, 24), torch.randn(1, 2, 24),
                               torch.randn(1, 2, 24), None, None, 0.0)
    with pytest.raises(ValueError, match=r"^k: must be torch.float32 on cpu like q, got torch.float64"):
        norm_and_rotate_triton(q, k.double(), cos, sin, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^cos/sin: must be \[1, 2, 16\] with contiguous rows"):
        norm_and_rotate_triton(q, k, cos, torch.randn(1, 2, 8), w, w, 1e-6)
    both = torch.randn(1, 2, 32)
    with pytest.raises(ValueError, match=r"^cos/sin: .* alike, got \(1, 2, 16\) strides \(128, 64, 1\), \(1, 2, 16\) "
                                         r"strides \(32, 16, 1\)"):      # rows strided unlike each other
        norm_and_rotate_triton(q, k, torch.randn(1, 2, 64)[..., :16], both[..., 16:].contiguous(), w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^cos/sin: must be \[1, 2, 16\] with contiguous rows"):
        norm_and_rotate_triton(q, k, both[..., ::2], both[..., 1::2], w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^q: each token's heads must be contiguous"):
        norm_and_rotate_triton(torch.randn(1, 2, 16, 4).transpose(2, 3), k, cos, sin, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^q_weight/k_weight: give both or neither"):
        norm_and_rotate_triton(q, k, cos, sin, w, None, 1e-6)
    with pytest.raises(ValueError, match=r"^tokens_per_program: must be a power of two, got 3"):
        norm_and_rotate_triton(q, k, cos, sin, w, w, 1e-6, tokens_per_program=3)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("T,tokens_per_program", [(6, None), (80, None), (75, 4)],
                         ids=["one-head-per-program", "heads-per-program", "tokens-per-program"])
def test_norm_rotate_and_store_equals_rotation_then_kv_write(device, dtype, norm, T, tokens_per_program):
    """`norm_rotate_and_store_triton` (chapter 07's `kv_write_in_rotary`) gives the bits of its two-kernel
    equivalent, `norm_and_rotate_triton` then `store_kv_triton`: the same rotated q, the same keys and values in
    the given slots of the paged cache, every other slot untouched."""
    pytest.importorskip("triton")
    if INTERPRET and device == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter's bf16 casts truncate; bf16 runs on CUDA")
    from minirt.kernels.paged_attention_triton import store_kv_triton
    from minirt.kernels.rotary_triton import norm_and_rotate_triton, norm_rotate_and_store_triton

    gen = torch.Generator().manual_seed(5)
    H, Hkv, D = 4, 2, 32
    qkv = torch.randn(1, T, (H + 2 * Hkv) * D, generator=gen).to(dtype).to(device)     # merged: strided tokens
    q, k, _ = (x.view(1, T, -1, D) for x in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
    v = torch.randn(1, T, Hkv, D, generator=gen).to(dtype).to(device)              # its own tensor: v's strides
    angles = torch.rand(1, T, D // 2, generator=gen) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype).to(device) for f in (torch.cos, torch.sin))
    weights = tuple((1 + 0.3 * torch.randn(D, generator=gen)).to(dtype).to(device) for _ in range(2)) + (1e-6,)
    weights = weights if norm else (None, None, 0.0)
    num_slots = 32 if T < 32 else 128
    slots = torch.randperm(num_slots, generator=gen)[:T].to(device)
    fill = torch.randn(num_slots // 4, 4, Hkv, D, generator=gen).to(dtype).to(device)   # blocks of 4 slots
    k_cache, v_cache = fill.clone(), -fill
    q_want, k_rot = norm_and_rotate_triton(q, k, cos, sin, *weights, tokens_per_program=tokens_per_program)
    store_kv_triton(k_cache, v_cache, k_rot[0], v[0], slots)
    k_got, v_got = fill.clone(), -fill
    q_got = norm_rotate_and_store_triton(q, k, v, cos, sin, *weights, k_got, v_got, slots,
                                         tokens_per_program=tokens_per_program)
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_cache) and torch.equal(v_got, v_cache)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(k_got.view(num_slots, Hkv, D)[untouched.to(device)],
                       fill.view(num_slots, Hkv, D)[untouched.to(device)])


def test_norm_rotate_and_store_argument_errors():
    pytest.importorskip("triton")
    from minirt.kernels.rotary_triton import norm_rotate_and_store_triton

    q, k, v = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)
    cos = sin = torch.randn(1, 2, 16)
    cache = torch.zeros(3, 4, 2, 16)
    slots = torch.tensor([0, 5])
    with pytest.raises(ValueError, match=r"^q: must be a packed batch \[1, num_tokens, H, D\], got \(2, 1, 4, 16\)"):
        norm_rotate_and_store_triton(q.view(2, 1, 4, 16), k.view(2, 1, 2, 16), v.view(2, 1, 2, 16),
                                     cos.view(2, 1, 16), sin.view(2, 1, 16), None, None, 0.0, cache, cache.clone(),
                                     slots)
    with pytest.raises(ValueError, match=r"^v: must be torch.float32 of k's shape \(1, 2, 2, 16\), got torch.float32 "
                                         r"\(1, 2, 1, 16\)"):
        norm_rotate_and_store_triton(q, k, v[:, :, :1], cos, sin, None, None, 0.0, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match=r"^k_cache: must be \[num_blocks, block_size, 2, 16\] like k"):
        norm_rotate_and_store_triton(q, k, v, cos, sin, None, None, 0.0, torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8),
                                     slots)
    with pytest.raises(ValueError, match=r"^slot_mapping: must be a contiguous \[2\] tensor"):
        norm_rotate_and_store_triton(q, k, v, cos, sin, None, None, 0.0, cache, cache.clone(), slots[:1])
    with pytest.raises(ValueError, match=r"^cos/sin: must be \[1, 2, 16\] with contiguous rows"):
        norm_rotate_and_store_triton(q, k, v, cos, torch.randn(1, 2, 8), None, None, 0.0, cache, cache.clone(), slots)
