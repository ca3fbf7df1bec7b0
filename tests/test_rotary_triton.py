"""`norm_and_rotate_triton` (Qwen3's q/k norm and the rotation of q and k in one Triton kernel) against an
oracle: `minirt.model.layers.norm_and_rotate` in float64 on the same inputs. Kernel cases need CUDA or Triton's
interpreter (`TRITON_INTERPRET=1`); the argument checks need Triton importable."""

from __future__ import annotations

import os

import pytest
import torch

from minirt.model.layers import norm_and_rotate

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cuda"] if CUDA else []) + (["cpu"] if INTERPRET else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def check(B, T, num_heads, num_kv_heads, head_dim, rot, norm, dtype, device, merged=True, pdl=False, seed=0):
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    gen = torch.Generator().manual_seed(seed)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    if merged:     # q and k as the engine passes them: slices of one q/k/v projection, so tokens are strided
        qkv = torch.randn(B, T, sum(sizes), generator=gen).to(dtype).to(device)
        q, k, _ = qkv.split(sizes, dim=-1)
    else:
        q, k = (torch.randn(B, T, n, generator=gen).to(dtype).to(device) for n in sizes[:2])
    q, k = q.view(B, T, num_heads, head_dim), k.view(B, T, num_kv_heads, head_dim)
    angles = torch.rand(B, T, rot // 2, generator=gen) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
    qw, kw = ((1 + 0.3 * torch.randn(head_dim, generator=gen)).to(dtype).to(device) for _ in range(2))
    weights = (qw, kw, 1e-6) if norm else (None, None, 0.0)
    got = norm_and_rotate_triton(q, k, cos, sin, *weights, pdl=pdl)
    want = norm_and_rotate(q.double(), k.double(), cos.double(), sin.double(),
                           *(w.double() if isinstance(w, torch.Tensor) else w for w in weights))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
        torch.testing.assert_close(g.double(), w, atol=TOL[dtype] * w.abs().max().item(), rtol=TOL[dtype])


CASES = [(1, 1, 16, 8, 128, 128, True), (2, 5, 4, 2, 32, 32, True), (1, 7, 4, 4, 64, 32, True),
         (3, 2, 6, 2, 16, 16, False), (1, 3, 2, 1, 64, 48, False)]    # (B, T, H, Hkv, D, rotary dim, q/k norm)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("merged", [True, False], ids=["merged", "separate"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm_and_rotate_triton_matches_reference(case, merged, dtype, device):
    pytest.importorskip("triton")
    check(*case, dtype, device, merged=merged)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
def test_norm_and_rotate_triton_rounds_as_eager_bf16(device):
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
    for got, want in zip(norm_and_rotate_triton(q, k, cos, sin, qw, kw, 1e-6),
                         norm_and_rotate(q, k, cos, sin, qw, kw, 1e-6)):
        assert (got == want).float().mean().item() > 0.99
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_norm_and_rotate_triton_with_pdl_equals_without():
    from minirt.kernels import pdl_missing

    if missing := pdl_missing(torch.device("cuda")):
        pytest.skip(f"PDL needs {missing}")
    check(1, 1, 16, 8, 128, 128, True, torch.bfloat16, "cuda", pdl=True)


def test_norm_and_rotate_triton_argument_errors():
    pytest.importorskip("triton")
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 2, 16)
    cos = sin = torch.randn(1, 2, 16)
    w = torch.ones(16)
    with pytest.raises(ValueError, match=r"^k: must be \[1, 2, Hkv, 16\] like q"):
        norm_and_rotate_triton(q, torch.randn(1, 2, 2, 8), cos, sin, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^cos: needs a power-of-two head_dim and an even rotary dim"):
        norm_and_rotate_triton(q, k, torch.randn(1, 2, 15), torch.randn(1, 2, 15), w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^cos/sin: must be contiguous \[1, 2, 16\]"):
        norm_and_rotate_triton(q, k, cos, torch.randn(1, 2, 8), w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^q: each token's heads must be contiguous"):
        norm_and_rotate_triton(torch.randn(1, 2, 16, 4).transpose(2, 3), k, cos, sin, w, w, 1e-6)
    with pytest.raises(ValueError, match=r"^q_weight/k_weight: give both or neither"):
        norm_and_rotate_triton(q, k, cos, sin, w, None, 1e-6)
