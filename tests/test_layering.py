"""The dependency runs one way: the reference modules of chapters 00-06 import nothing of chapters 07-09 (or the
course and bench tooling), `minirt.fast` imports nothing of `minirt.parallel`, `Engine.step` (chapter 05's) is never
replaced on a built engine, and only a scheduler allocates KV blocks, bursts of multi-step decode included.

Oracles: the interpreter's own `sys.modules` in a fresh process, the source's `ast` (every import statement,
module-level or inside a function), the class's function object, and the caller frames of `BlockPool.allocate`.
"""

import ast
import asyncio
import pathlib
import subprocess
import sys

import pytest
import torch

import minirt
from minirt.engine import Engine
from minirt.kv.block_pool import BlockPool
from minirt.scheduler import Scheduler

PACKAGE = pathlib.Path(minirt.__file__).parent
ROOT = PACKAGE.parent
#: The modules chapters 00-06 teach (DESIGN.md's progression). The front doors (`minirt/__init__.py`, `llm.py`)
#: are not among them: they build the full engine, importing it when the first one is built.
REFERENCE = ["model", "generate", "kv", "attention.py", "request.py", "engine.py", "scheduler.py",
             "model_runner.py", "sampling.py", "config.py", "detokenize.py", "metrics.py"]
LATER = ("minirt.fast", "minirt.kernels", "minirt.serve", "minirt.parallel", "minirt.bench", "minirt.course",
         "minirt.quant")


def python_files(*names: str, under: pathlib.Path = PACKAGE) -> list[pathlib.Path]:
    files = []
    for name in names:
        path = under / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> set[str]:
    """Every module an import statement in `path` names (`from a import b` also names `a.b`, which may be a
    module), with relative imports resolved against the file's package (its path under `root`)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def named(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_importing_the_reference_engine_loads_no_fast_module():
    """In a fresh interpreter, `import minirt.engine` (chapter 05) and `import minirt` load no module of
    `minirt.fast`: the full engine's package is imported when the first engine is built."""
    code = ("import sys, {0}; print(sorted(m for m in sys.modules if m.startswith(('minirt.fast', 'minirt.parallel', "
            "'minirt.kernels', 'minirt.quant'))))")
    for module in ("minirt.engine", "minirt"):
        out = subprocess.run([sys.executable, "-c", code.format(module)], capture_output=True, text=True,
                             cwd=ROOT, check=True).stdout
        assert out.strip() == "[]", f"import {module} loaded {out.strip()}"


def test_no_reference_module_imports_a_later_chapter():
    files = python_files(*REFERENCE)
    assert len(files) > 15 and all(f.exists() for f in files)
    hits = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if named(m, LATER)) for f in files}
    assert not {f: m for f, m in hits.items() if m}


def test_the_fast_package_imports_nothing_of_the_parallel_one():
    """Chapter 09's package builds on chapter 07's, never the other way (no import circle)."""
    files = python_files("fast")
    hits = {str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if named(m, ["minirt.parallel"]))
            for f in files}
    assert not {f: m for f, m in hits.items() if m}
    assert any("minirt.fast.runner" in imported_modules(f) for f in python_files("parallel"))   # the scan sees it


def test_the_scan_sees_imports_inside_functions(tmp_path):
    """The AST scan's own check: an import inside a function, absolute or relative, is found."""
    pkg = tmp_path / "minirt"
    pkg.mkdir()
    (pkg / "mod.py").write_text("def f():\n    from minirt.fast import plan\n    from .parallel import x\n"
                                "    import minirt.serve.app\n")
    found = imported_modules(pkg / "mod.py", root=tmp_path)
    assert {"minirt.fast.plan", "minirt.parallel.x", "minirt.serve.app"} <= found
    assert all(named(m, LATER) for m in ("minirt.fast.plan", "minirt.parallel.x", "minirt.serve.app"))
    assert not named("minirt.fastest", LATER)


@pytest.mark.parametrize("settings", [{}, dict(num_scheduler_steps=4), dict(num_scheduler_steps=4,
                                                                              overlap_scheduling=False)])
def test_engine_step_is_chapter_05s_on_every_engine(settings):
    """`Engine.step` stays the class's own function, on the reference engine and on the full one (whose chosen
    step, `step_fn`, runs bursts here); the reference engine ignores the speed settings (its docstring)."""
    from minirt.fast import FastEngine

    reference = Engine(minirt.DEFAULT_MODEL, device="cpu", **settings)
    fast = minirt.Engine(minirt.DEFAULT_MODEL, device="cpu", **settings)
    assert type(fast) is FastEngine and isinstance(fast, Engine) and "step" not in vars(FastEngine)
    for engine in (reference, fast):
        assert "step" not in vars(engine) and engine.step.__func__ is Engine.step
    assert reference.step_fn == reference.step and type(reference.scheduler) is Scheduler
    assert type(reference.model_runner).__name__ == "ModelRunner" and not hasattr(reference, "plan")
    bursts = settings.get("num_scheduler_steps", 1) > 1
    assert fast.plan.num_scheduler_steps == (4 if bursts else 1)
    assert (fast.step_fn == fast.step) is not bursts

    async def run(engine):
        params = minirt.SamplingParams(max_new_tokens=12, ignore_eos=True)
        async with engine:
            return [(await engine.generate(p, params)).token_ids for p in ("ROMEO:", "JULIET: O")]

    assert asyncio.run(run(reference)) == asyncio.run(run(fast))


def test_the_reference_engine_ignores_what_it_does_not_run():
    """Chapter 07's switches and chapter 09's tensor_parallel_size are accepted and not read: one process, chapter
    05's runner and step, the same tokens as the full engine's single steps."""
    import multiprocessing

    before = multiprocessing.active_children()
    engine = Engine(minirt.DEFAULT_MODEL, device="cpu", tensor_parallel_size=2, num_scheduler_steps=8,
                    attention_backend="triton", merge_projections=True, async_scheduling=True)
    assert multiprocessing.active_children() == before
    assert type(engine.model_runner).__name__ == "ModelRunner" and engine.step_fn == engine.step
    assert type(engine.scheduler) is Scheduler


def test_only_a_scheduler_allocates_blocks_in_a_burst(monkeypatch):
    """With multi-step decode (and overlap scheduling, and without), every `BlockPool.allocate` is called from a
    method of a `Scheduler` (the burst scheduler's included), and bursts did run."""
    from minirt.fast.multi_step import BurstScheduler

    callers = []
    allocate = BlockPool.allocate

    def recording_allocate(pool):
        frame = sys._getframe(1)
        while frame.f_code.co_name.startswith("<"):       # a comprehension's frame (Python < 3.12): its function's
            frame = frame.f_back
        callers.append((frame.f_code.co_name, frame.f_locals.get("self")))
        return allocate(pool)

    monkeypatch.setattr(BlockPool, "allocate", recording_allocate)
    for overlap in (True, False):
        llm = minirt.LLM(minirt.DEFAULT_MODEL, device="cpu", dtype=torch.float32, block_size=4,
                         num_scheduler_steps=4, overlap_scheduling=overlap)
        assert isinstance(llm.engine.scheduler, BurstScheduler)
        bursts = []
        execute = llm.engine.model_runner.start_decode_steps
        llm.engine.model_runner.start_decode_steps = lambda items, n: bursts.append(n) or execute(items, n)
        callers.clear()
        outs = llm.generate(["ROMEO:", "JULIET: O Romeo", "KING"],
                            minirt.SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert all(len(o.token_ids) == 30 for o in outs) and bursts and max(bursts) == 4
        assert callers and "_allocate_steps" in {name for name, _ in callers}
        outside = [(name, type(owner).__name__) for name, owner in callers if not isinstance(owner, Scheduler)]
        assert not outside, f"blocks allocated outside a scheduler: {outside}"
        assert all(name in dir(Scheduler) or name in vars(BurstScheduler) for name, _ in callers)
