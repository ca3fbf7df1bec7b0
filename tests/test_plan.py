"""The plan (`minirt.fast.plan`): every switch resolved once, refused by name before anything loads.

Oracle: the switches' contract written out again here, independently of `RULES` (what each needs, where None
turns it on), checked on random settings and machines by hypothesis; and the messages users get on this CPU.
"""

import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minirt
from minirt.config import EngineConfig
from minirt.fast import Hardware, Plan, resolve_plan

ON_OFF = ("fused_ops", "merge_projections", "gemv", "norm_in_gemv", "rotary_kernel", "pdl", "kv_write_in_rotary",
          "combine_in_attention", "prefetch_kv", "l2_prefetch", "overlap_scheduling", "piecewise_graphs",
          "async_scheduling", "silu_and_mul_kernel", "rotary_cache", "argmax_in_gemv", "verify_graphs")
#: switch -> the switches it needs on (the contract in EngineConfig's docstring and chapter 07)
#: (cuda_graphs needs the Triton kernel or flash-attn's: `expected` below)
NEEDS = {"split_kv": ["triton"], "norm_in_gemv": ["gemv", "merge_projections"],
         "kv_write_in_rotary": ["rotary_kernel"], "combine_in_attention": ["triton", "split_kv"],
         "prefetch_kv": ["pdl", "split_kv", "triton"], "l2_prefetch": ["gemv", "merge_projections"],
         "piecewise_graphs": ["cuda_graphs"], "argmax_in_gemv": ["gemv"]}
NO_FLASH = ("flash-attn-4 or flash-attn installed (pip install flash-attn-4; got ...)",)
MACHINES = {
    "cpu": Hardware("cpu", ("a CUDA device (got cpu)",), (), ("a CUDA device (got cpu)",), ("a CUDA device (got cpu)",)),
    "cuda, no triton": Hardware("cuda", ("Triton installed (it is not)",), (), ("Triton installed (it is not)",),
                                NO_FLASH),
    "cuda, no triton, flash-attn": Hardware("cuda", ("Triton installed (it is not)",), (),
                                            ("Triton installed (it is not)",), ()),
    "ampere": Hardware("cuda", (), (), ("compute capability 9.0 or later (got 8.0)",), NO_FLASH),
    "ampere, flash-attn": Hardware("cuda", (), (), ("compute capability 9.0 or later (got 8.0)",), ()),
    "hopper, odd head_dim": Hardware("cuda", (), ("a power-of-two head_dim >= 16 (got 80)",), (), ()),
    "hopper, float32": Hardware("cuda", (), (), (), ("dtype float16 or bfloat16 (got float32)",)),
    "hopper": Hardware("cuda", (), (), (), ()),
}


def can_run(name: str, hw: Hardware) -> bool:
    """What the machine itself allows each switch (before the switches it needs)."""
    triton, head_dim, pdl = not hw.triton, not hw.head_dim, not hw.pdl
    return {"flash_attn": not hw.flash_attn, "triton": triton and head_dim, "rotary_kernel": triton and head_dim,
            "gemv": triton, "silu_and_mul_kernel": triton,
            "fused_ops": triton or hw.device_type != "cuda",     # Inductor needs Triton for CUDA tensors
            "cuda_graphs": hw.device_type == "cuda", "pdl": pdl, "l2_prefetch": pdl, "prefetch_kv": pdl}.get(name, True)


def expected(cfg: EngineConfig, hw: Hardware) -> dict | str:
    """The plan as the contract says, or the name of the first switch that must be refused."""
    if cfg.weight_block_size is not None and cfg.quantization is None:     # on a float checkpoint
        return "weight_block_size"
    quantized = cfg.quantization is not None
    # block-scaled linears run quant_gemv: no norm prologue, no L2 chain (per-channel ones run the float GEMV)
    block_scaled = quantized and cfg.weight_block_size is not None
    asked = {name: getattr(cfg, name) for name in ON_OFF}
    asked["flash_attn"] = cfg.attention_backend == "flash_attn"            # "auto" never picks it (measured)
    asked["triton"] = {"auto": None, "triton": True, "torch": False, "flash_attn": False}[cfg.attention_backend]
    asked["split_kv"] = None if cfg.split_kv else False
    asked["cuda_graphs"] = False if cfg.enforce_eager else None
    on = {}
    order = ["flash_attn", "triton", "split_kv", "cuda_graphs", "fused_ops", "merge_projections", "gemv", "norm_in_gemv",
             "rotary_kernel", "pdl", "kv_write_in_rotary", "combine_in_attention", "prefetch_kv", "l2_prefetch"]
    auto = {"fused_ops": lambda: hw.device_type == "cuda", "merge_projections": lambda: hw.device_type == "cuda",
            "gemv": lambda: on["cuda_graphs"], "rotary_kernel": lambda: on["cuda_graphs"],
            "pdl": lambda: on["cuda_graphs"], "combine_in_attention": lambda: False, "l2_prefetch": lambda: on["pdl"]}
    for name in order:
        possible = can_run(name, hw) and all(on[n] for n in NEEDS.get(name, []))
        if name in ("norm_in_gemv", "l2_prefetch"):
            possible = possible and not block_scaled
        if name == "cuda_graphs":                       # a kernel that can be captured: Triton's or flash-attn's
            possible = can_run(name, hw) and (on["triton"] or on["flash_attn"])
        if asked[name] is True and not possible:
            return "attention_backend" if name in ("triton", "flash_attn") else name
        on[name] = asked[name] if asked[name] is not None else possible and auto.get(name, lambda: True)()
    flash, triton = on.pop("flash_attn"), on.pop("triton")
    on["attention_backend"] = "flash_attn" if flash else "triton" if triton else "torch"
    on["num_scheduler_steps"] = steps = cfg.num_scheduler_steps or (8 if on["cuda_graphs"] else 1)
    if asked["overlap_scheduling"] is True and steps < 2:        # it needs bursts to overlap
        return "overlap_scheduling"
    on["overlap_scheduling"] = asked["overlap_scheduling"] if asked["overlap_scheduling"] is not None else steps > 1
    if asked["piecewise_graphs"] is True and not on["cuda_graphs"]:
        return "piecewise_graphs"
    on["piecewise_graphs"] = on["cuda_graphs"] if asked["piecewise_graphs"] is None else asked["piecewise_graphs"]
    on["async_scheduling"] = on["piecewise_graphs"] if asked["async_scheduling"] is None else asked["async_scheduling"]
    if asked["silu_and_mul_kernel"] is True and not can_run("silu_and_mul_kernel", hw):
        return "silu_and_mul_kernel"
    on["silu_and_mul_kernel"] = (can_run("silu_and_mul_kernel", hw) and hw.device_type == "cuda"
                                 if asked["silu_and_mul_kernel"] is None else asked["silu_and_mul_kernel"])
    on["rotary_cache"] = hw.device_type == "cuda" if asked["rotary_cache"] is None else asked["rotary_cache"]
    if asked["argmax_in_gemv"] is True and not on["gemv"]:
        return "argmax_in_gemv"
    on["argmax_in_gemv"] = on["gemv"] if asked["argmax_in_gemv"] is None else asked["argmax_in_gemv"]
    # the quantized linears' kernels: off with gemv asked off, else on CUDA with Triton wherever weights are quantized
    on["quant_gemv"] = (asked["gemv"] is not False and quantized and hw.device_type == "cuda"
                        and can_run("gemv", hw))
    on["quantization"], on["weight_block_size"] = cfg.quantization, cfg.weight_block_size
    on.update(speculative=None, num_speculative_tokens=0, speculative_max_batch=0)   # (tests/test_spec_engine.py)
    if asked["verify_graphs"] is True:                  # it needs speculation, which these settings never ask for
        return "verify_graphs"
    on["verify_graphs"] = False                         # (with speculation: tests/test_verify_graphs.py)
    return on


settings_strategy = st.builds(
    lambda values, backend, split_kv, eager, steps, quant: EngineConfig(
        attention_backend=backend, split_kv=split_kv, enforce_eager=eager, num_scheduler_steps=steps,
        quantization=quant[0], weight_block_size=quant[1], **dict(zip(ON_OFF, values))),
    st.tuples(*[st.sampled_from([None, True, False])] * len(ON_OFF)), st.sampled_from(["auto", "torch", "triton", "flash_attn"]),
    st.booleans(), st.booleans(), st.sampled_from([None, 1, 4]),
    st.sampled_from([(None, None)] * 4 + [("int8", None), ("fp8", 16), (None, 16)]))


@settings(max_examples=600, deadline=None)
@given(cfg=settings_strategy, machine=st.sampled_from(sorted(MACHINES)))
def test_the_plan_keeps_the_contract_of_every_switch(cfg, machine):
    """Each switch asked for runs or is refused by its own name; each asked off stays off; each left None is on
    exactly where it can run, what it needs is on, and it pays (its `auto` rule)."""
    hw = MACHINES[machine]
    want = expected(cfg, hw)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=rf"^{want}: "):
            resolve_plan(cfg, torch.device(hw.device_type), hardware=hw)
        return
    plan = resolve_plan(cfg, torch.device(hw.device_type), hardware=hw)
    assert plan.as_dict() == want


@settings(max_examples=300, deadline=None)
@given(cfg=settings_strategy, machine=st.sampled_from(sorted(MACHINES)), k=st.sampled_from([None, 1, 4, 7]))
def test_speculation_leaves_every_other_switch_as_the_plain_plan_has_it(cfg, machine, k):
    """With `speculative` set, every switch resolves (or is refused) exactly as without it, overlap and async
    scheduling included: the steps that draft nothing run them (`minirt.spec.engine`); only the speculative fields
    differ, and `verify_graphs` (asked for by name), which needs speculation, CUDA graphs and the Triton attention
    kernel. Oracle: the
    plain plan of the same settings (verify_graphs left None there, where nothing can run it), and k+1 rows x
    `speculative_max_batch` <= 128."""
    hw, device = MACHINES[machine], torch.device(MACHINES[machine].device_type)
    spec_cfg = dataclasses.replace(cfg, speculative="ngram", num_speculative_tokens=k)
    try:
        plain = resolve_plan(dataclasses.replace(cfg, verify_graphs=cfg.verify_graphs and None), device, hardware=hw)
    except ValueError as e:
        with pytest.raises(ValueError, match="^" + re.escape(str(e).split(":")[0]) + ": "):
            resolve_plan(spec_cfg, device, hardware=hw)
        return
    can_verify_in_graphs = plain.cuda_graphs and plain.attention_backend == "triton"
    if cfg.verify_graphs is True and not can_verify_in_graphs:
        with pytest.raises(ValueError, match="^verify_graphs: "):
            resolve_plan(spec_cfg, device, hardware=hw)
        return
    spec = resolve_plan(spec_cfg, device, hardware=hw)
    k = k or 4
    assert spec == dataclasses.replace(plain, speculative="ngram", num_speculative_tokens=k,
                                       speculative_max_batch=128 // (k + 1),
                                       verify_graphs=can_verify_in_graphs and cfg.verify_graphs is True)


def test_defaults_are_the_reference_on_a_cpu_and_everything_on_a_hopper():
    assert resolve_plan(EngineConfig(), torch.device("cpu"), hardware=MACHINES["cpu"]).is_reference
    plan = resolve_plan(EngineConfig(), torch.device("cuda"), hardware=MACHINES["hopper"])
    assert plan == Plan(attention_backend="triton", split_kv=True, cuda_graphs=True, fused_ops=True,
                        merge_projections=True, gemv=True, num_scheduler_steps=8, norm_in_gemv=True,
                        rotary_kernel=True, pdl=True, kv_write_in_rotary=True, combine_in_attention=False,
                        prefetch_kv=True, l2_prefetch=True, overlap_scheduling=True, piecewise_graphs=True,
                        async_scheduling=True, silu_and_mul_kernel=True, rotary_cache=True, argmax_in_gemv=True)
    with pytest.raises(Exception):
        plan.gemv = False                                       # frozen: what runs is what the plan says


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals on a machine without CUDA")
@pytest.mark.parametrize("field,value,words", [
    ("attention_backend", "triton", r"attention_backend: 'triton' needs a CUDA device \(got cpu\)"),
    ("gemv", True, r"gemv: the Triton matrix-vector kernel needs a CUDA device \(got cpu\)"),
    ("pdl", True, r"pdl: programmatic dependent launch needs a CUDA device \(got cpu\)"),
    ("rotary_kernel", True, r"rotary_kernel: the Triton kernel needs a CUDA device \(got cpu\)"),
    ("silu_and_mul_kernel", True, r"silu_and_mul_kernel: the Triton SiLU-and-multiply kernel needs a CUDA device "
                                  r"\(got cpu\)"),
    ("kv_write_in_rotary", True, r"kv_write_in_rotary: the K/V write in the rotary kernel needs rotary_kernel "
                                 r"\(off: needs a CUDA device \(got cpu\)\)"),
    ("combine_in_attention", True, r"combine_in_attention: .* needs attention_backend='triton' \(off: needs a CUDA"),
    ("prefetch_kv", True, r"prefetch_kv: .* needs pdl \(off: needs a CUDA device \(got cpu\)\) and split_kv"),
    ("l2_prefetch", True, r"l2_prefetch: the bulk prefetch into L2 needs a CUDA device \(got cpu\) and gemv"),
    ("overlap_scheduling", True, r"overlap_scheduling: launching the next burst before taking this one's tokens needs "
                                 r"num_scheduler_steps > 1 \(off: num_scheduler_steps=None is on only 8 with CUDA"),
    ("piecewise_graphs", True, r"piecewise_graphs: piecewise CUDA graphs for steps with prefill chunks needs CUDA "
                               r"graphs \(off: needs a CUDA device \(got cpu\)"),
    ("argmax_in_gemv", True, r"argmax_in_gemv: the greedy argmax in the LM head GEMV's epilogue needs gemv \(off: "
                             r"needs a CUDA device \(got cpu\)"),
    ("norm_in_gemv", True, r"norm_in_gemv: the GEMV's norm prologue needs gemv \(off: needs a CUDA device "
                           r"\(got cpu\)\) and merge_projections \(off: merge_projections=None is on only on CUDA\)"),
    ("verify_graphs", True, r"verify_graphs: CUDA graphs for verification steps needs speculative \(off: "
                            r"speculative=None\) and CUDA graphs \(off: needs a CUDA device \(got cpu\)"),
])
def test_refused_on_this_cpu_by_name_before_the_model_loads(tiny_models, monkeypatch, field, value, words):
    monkeypatch.setattr(minirt.engine, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    with pytest.raises(ValueError, match="^" + words):
        minirt.Engine(tiny_models["llama"], device="cpu", **{field: value})


def test_a_switch_asked_for_names_the_switch_asked_off_that_it_needs():
    cfg = EngineConfig(merge_projections=False, norm_in_gemv=True)
    with pytest.raises(ValueError, match=r"^norm_in_gemv: .* needs merge_projections \(off: merge_projections=False\)"):
        resolve_plan(cfg, torch.device("cuda"), hardware=MACHINES["hopper"])
    cfg = EngineConfig(enforce_eager=True, kv_write_in_rotary=True)
    with pytest.raises(ValueError, match=r"^kv_write_in_rotary: .* needs rotary_kernel \(off: rotary_kernel=None is "
                                         r"on only with CUDA graphs\)"):
        resolve_plan(cfg, torch.device("cuda"), hardware=MACHINES["hopper"])


def test_an_unknown_setting_is_refused_by_name(tiny_models):
    with pytest.raises(ValueError, match=r"^blok_size: not an engine setting \(did you mean 'block_size'\?\)"):
        minirt.LLM(tiny_models["llama"], blok_size=4)
    with pytest.raises(ValueError, match=r"^turbo: not an engine setting \(the settings are device, dtype, "):
        minirt.Engine(tiny_models["llama"], turbo=True)


def test_llm_and_engine_show_every_setting_in_their_signature():
    """`help(minirt.LLM)` and Jupyter's tooltips list the settings with their defaults (EngineConfig's fields)."""
    import dataclasses
    import inspect

    want = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for cls in (minirt.LLM, minirt.Engine):
        params = inspect.signature(cls).parameters
        assert {name: p.default for name, p in params.items() if p.kind is p.KEYWORD_ONLY} == want
        assert list(params)[0] == "model" and params["model"].default == minirt.DEFAULT_MODEL


def test_the_engine_reports_its_plan(tiny_models):
    llm = minirt.LLM(tiny_models["llama"], device="cpu", merge_projections=True, num_scheduler_steps=3)
    assert llm.engine.plan == Plan(merge_projections=True, num_scheduler_steps=3, overlap_scheduling=True)
    assert type(llm.engine.model_runner).__name__ == "FastModelRunner"
    assert type(minirt.LLM(tiny_models["llama"], device="cpu").engine.model_runner).__name__ == "ModelRunner"
