"""`silu_and_mul_triton` (SwiGLU's `silu(gate) * up` in one Triton kernel) against oracles: the same op in float64
on the same inputs, and eager torch's bfloat16 rounding. Kernel cases need CUDA or Triton's interpreter
(`TRITON_INTERPRET=1`); the argument checks need Triton importable."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import minirt
from conftest import TRITON_DEVICE, hf_logits, random_prompts
from test_fast_layers import close
from test_model import _minirt_logits

pytestmark = pytest.mark.skipif(TRITON_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")


def gate_and_up(rows: int, intermediate: int, dtype: torch.dtype, seed: int = 0, scale: float = 4.0):
    """gate and up as the engine passes them: the two halves of one merged gate/up projection `[1, rows, 2 * I]`."""
    gen = torch.Generator().manual_seed(seed)
    merged = (scale * torch.randn(1, rows, 2 * intermediate, generator=gen)).to(dtype).to(TRITON_DEVICE)
    return merged.chunk(2, dim=-1)


# (rows, intermediate, block_rows, block_cols): tiles that do and do not divide the shape, one row, a wide row
CASES = [(1, 48, 8, 512), (13, 96, 8, 32), (64, 256, 4, 64), (5, 3000, 2, 1024), (33, 17, 16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_silu_and_mul_triton_matches_float64(case, dtype):
    from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton

    rows, intermediate, block_rows, block_cols = case
    gate, up = gate_and_up(rows, intermediate, dtype)
    got = silu_and_mul_triton(gate, up, block_rows=block_rows, block_cols=block_cols)
    want = F.silu(gate.double()) * up.double()
    assert got.shape == gate.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 8e-3                    # float32 ops; one bfloat16 rounding each
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=2 * tol)


def test_silu_and_mul_triton_rounds_as_eager_bf16():
    """In bfloat16 the SiLU is rounded before the product, as eager torch rounds it: with one rounding at the end the
    results differ from eager's in many places, with it in almost none (exp may differ by an ulp in float32)."""
    from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton

    gate, up = gate_and_up(256, 512, torch.bfloat16, seed=1)
    got = silu_and_mul_triton(gate, up)
    eager = F.silu(gate) * up
    once = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)            # rounded once: not what eager does
    assert (once != eager).float().mean() > 0.05
    assert (got != eager).float().mean() < 0.005


def test_silu_and_mul_triton_refuses_what_it_cannot_read():
    from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton

    gate, up = gate_and_up(4, 32, torch.float32)
    with pytest.raises(ValueError, match=r"^up: must be torch.float32 \(1, 4, 32\)"):
        silu_and_mul_triton(gate, up[..., :16])
    with pytest.raises(ValueError, match=r"^gate: each row's 32 values must be contiguous"):
        silu_and_mul_triton(gate.transpose(1, 2).contiguous().transpose(1, 2), up)
    with pytest.raises(ValueError, match=r"^block_rows: must be a power of two, got 3"):
        silu_and_mul_triton(gate, up, block_rows=3)
    empty = torch.empty(0, 32, device=TRITON_DEVICE)
    assert silu_and_mul_triton(empty, empty).shape == (0, 32)


def test_the_plans_silu_and_mul_kernel_runs_in_the_model(tiny_model_path):
    """The plan's switch reaches the MLP: with silu_and_mul_kernel every layer's SwiGLU calls the Triton kernel
    (counted), and the logits stay those of transformers (float32)."""
    from minirt.fast import Plan
    from minirt.fast.layers import speed_up_model
    from minirt.fast.ops import model_kernels
    from minirt.kernels.silu_and_mul_triton import silu_and_mul_triton

    plan = Plan(merge_projections=True, silu_and_mul_kernel=True)
    assert model_kernels(plan).silu_and_mul is silu_and_mul_triton
    calls = []

    def counting(gate, up):
        calls.append(gate.shape)
        return silu_and_mul_triton(gate, up)

    model, _ = minirt.load_model(tiny_model_path, device=TRITON_DEVICE, dtype=torch.float32)
    speed_up_model(model, plan, dataclasses.replace(model_kernels(plan), silu_and_mul=counting))
    ids = torch.tensor(random_prompts(3, [9]))
    close(_minirt_logits(model, ids), hf_logits(tiny_model_path, ids))
    assert len(calls) == model.config.num_hidden_layers
