"""benchmarks/optimizations.py (chapter 07's cumulative table): each step turns on exactly one more switch of the
*resolved* plan. Oracle: `minirt.fast.resolve_plan` itself, on faked hardware (a Hopper GPU; an Ampere one without
programmatic dependent launch), compared field by field between consecutive steps, not the settings the steps pass."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minirt.config import EngineConfig
from minirt.fast import Hardware, Plan, resolve_plan

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
HOPPER = Hardware("cuda")
AMPERE = Hardware("cuda", pdl=("compute capability 9.0 or later (got 8.0)",))
CUDA = torch.device("cuda")


def _optimizations():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))           # as `python benchmarks/optimizations.py` has it: harness, ab
    spec = importlib.util.spec_from_file_location("optimizations", BENCHMARKS / "optimizations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _changed(before: Plan, after: Plan) -> list[str]:
    return [f.name for f in dataclasses.fields(Plan) if getattr(before, f.name) != getattr(after, f.name)]


def _plans(steps, hardware):
    return [resolve_plan(EngineConfig(**kwargs), CUDA, hardware=hardware) for _, kwargs in steps]   # none refused


@pytest.mark.parametrize("hardware,leave_out", [(HOPPER, ()), (AMPERE, "NEEDS_PDL")], ids=["hopper", "ampere"])
def test_each_step_turns_on_exactly_one_more_switch_of_the_resolved_plan(hardware, leave_out):
    module = _optimizations()
    steps = module.STEPS if not leave_out else module.build_steps(leave_out=module.NEEDS_PDL)
    plans = _plans(steps, hardware)
    assert plans[0] == Plan() and plans[0].is_reference             # the first step is the reference engine
    for (label, _), before, after in zip(steps[1:], plans, plans[1:]):
        changed = _changed(before, after)
        assert len(changed) == 1, f"{label!r} changes {changed} of the resolved plan"
        assert module.LABELS[changed[0]] == label                   # and it is the switch its label names
        assert getattr(after, changed[0]) != getattr(Plan(), changed[0])  # turned on, never off
    assert plans[-1] == resolve_plan(EngineConfig(), CUDA, hardware=hardware)   # the last: the engine's defaults


def test_every_switch_on_by_default_is_a_step_in_the_order_of_rules():
    from minirt.fast.plan import RULES

    module = _optimizations()
    plans = _plans(module.STEPS, HOPPER)
    turned_on = [_changed(before, after)[0] for before, after in zip(plans, plans[1:])]
    default = resolve_plan(EngineConfig(), CUDA, hardware=HOPPER)
    assert sorted(turned_on) == sorted(_changed(Plan(), default))
    order = [rule.name for rule in RULES]
    assert turned_on == sorted(turned_on, key=order.index)
    assert {"overlap_scheduling", "piecewise_graphs", "async_scheduling"} <= set(turned_on)
    assert "combine_in_attention" not in turned_on                   # off by default: no step


def test_optimizations_script_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("the script runs for real on CUDA: exercised by the GPU runs, not here")
    assert _optimizations().main(["--quick"]) == 2


@pytest.mark.parametrize("steps", ["99", "-1", "1,x"])
def test_optimizations_script_names_a_bad_step(steps, capsys):
    """Checked before anything else (CUDA included), with the valid range in the message."""
    module = _optimizations()
    assert module.main(["--steps", steps]) == 2
    assert f"error: --steps: comma-separated step numbers 0-{len(module.STEPS) - 1}, got {steps!r}" in \
        capsys.readouterr().err
