"""pyproject.toml and environment.yml list the same packages; package data ships; the wheel holds the package only
(no lab, no CUDA sources); minirt/kernels/ holds only kernels the plan machinery imports."""

import ast
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL_ONLY = {"flash-attn", "flash-attn-4"}  # GPU-only extras: in environment.yml as comments, not installed


def _norm(req: str) -> str:
    name = re.split(r"[\s<>=!~;\[@]", req.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _env_yml_pip_packages(text: str) -> tuple[set[str], set[str], set[str]]:
    """Line-based read of the simple environment.yml: (conda deps, pip deps, commented-out pip deps)."""
    conda, pip, commented = set(), set(), set()
    section = None
    pip_indent = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        stripped = raw.strip()
        if not raw.startswith(" ") and stripped.endswith(":"):
            section = stripped[:-1]
            pip_indent = None
            continue
        if section != "dependencies":
            continue
        if stripped.startswith("# - ") and pip_indent is not None:
            commented.add(_norm(stripped[4:].split("#")[0]))
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        item = line.strip()
        if item == "- pip:":
            pip_indent = indent
            continue
        if not item.startswith("- "):
            continue
        name = item[2:].strip()
        if pip_indent is not None and indent > pip_indent:
            pip.add(_norm(name))
        else:
            pip_indent = None
            conda.add(name)
    return conda, pip, commented


def test_pyproject_metadata():
    proj = _pyproject()["project"]
    assert proj["name"] == "minirt"
    assert ">=3.10" in proj["requires-python"]
    deps = {_norm(d) for d in proj["dependencies"]}
    assert deps == {"torch", "numpy", "transformers", "safetensors", "tokenizers", "huggingface-hub", "tqdm"}
    extras = proj["optional-dependencies"]
    assert {_norm(d) for d in extras["dev"]} >= {"pytest", "hypothesis"}
    assert {_norm(d) for d in extras["notebooks"]} >= {"jupyterlab", "ipywidgets", "matplotlib", "nbval",
                                                      "nbclient", "nbformat"}
    assert {_norm(d) for d in extras["flash"]} == {"flash-attn"}
    assert {_norm(d) for d in extras["flash4"]} == {"flash-attn-4"}
    torch_req = next(d for d in proj["dependencies"] if _norm(d) == "torch")
    assert ">=2.4" in torch_req.replace(" ", "")


def test_environment_yml_matches_pyproject():
    proj = _pyproject()["project"]
    want = {_norm(d) for d in proj["dependencies"]}
    for extra, reqs in proj["optional-dependencies"].items():
        want |= {_norm(d) for d in reqs}
    conda, pip, commented = _env_yml_pip_packages((ROOT / "environment.yml").read_text())
    assert any(c.replace(" ", "").startswith("python=3.11") for c in conda), conda
    assert "pip" in conda
    assert pip | commented == want, f"only in pyproject: {want - pip - commented}; only in env: {pip - want}"
    assert commented <= OPTIONAL_ONLY
    assert pip == want - OPTIONAL_ONLY


def test_package_data_declared():
    data = _pyproject()["tool"]["setuptools"]["package-data"]["minirt"]
    assert "*.json" in data
    assert any(p.startswith("default_model/") for p in data)


def test_ci_script_runs_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "set -euo pipefail" in ci
    assert "pip install torch==2.13.0" in ci
    assert 'pip install -e ".[dev,notebooks]"' in ci
    cmd = "python -m pytest -q tests"
    assert cmd in readme and cmd in ci
    assert ci.index("torch==2.13.0") < ci.index('pip install -e ".[dev,notebooks]"')


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names in a wheel built from a copy of the tree: the package, and lab/ beside it (so that the wheel
    shows what `packages.find` leaves out)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    try:  # setuptools >= 70.1 builds wheels without the `wheel` package: no network needed
        import setuptools
        offline = tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)
    except ImportError:
        offline = False
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("minirt", "lab"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)]
    if offline:
        cmd.insert(5, "--no-build-isolation")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and not offline and any(
            s in proc.stderr for s in ("NewConnectionError", "Could not find a version", "No matching distribution")):
        pytest.skip("no network for an isolated wheel build, and setuptools here is too old to build offline")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("minirt-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_wheel_ships_package_data(wheel_names):
    """Every file of minirt/default_model/, minirt/draft_model/, minirt/*.json and the package's modules ships."""
    pkg = ROOT / "minirt"
    want = {f"minirt/{p.relative_to(pkg).as_posix()}" for p in pkg.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
            and (p.suffix in (".py", ".json") or {"default_model", "draft_model"} & set(p.parts))}
    missing = sorted(want - wheel_names)
    assert not missing, f"not in the wheel: {missing[:10]}"
    assert any(n.endswith("entry_points.txt") for n in wheel_names)


def test_wheel_holds_no_lab_and_no_cuda_sources(wheel_names):
    """The wheel is the package: no `lab` package (its probe kernels, probes, tests) and no `.cu` file, anywhere;
    the lab is there in the tree it was built from, so leaving it out is the build's doing."""
    assert (ROOT / "lab" / "kernels" / "__init__.py").is_file()
    top = {name.split("/", 1)[0] for name in wheel_names}
    assert top == {"minirt"} | {t for t in top if t.endswith(".dist-info")}, sorted(top)
    assert not [n for n in wheel_names if n.endswith(".cu")]
    data = _pyproject()["tool"]["setuptools"]["package-data"]["minirt"]
    assert not [pattern for pattern in data if pattern.endswith(".cu") or "kernels" in pattern]


def _imported_modules(path: Path) -> set[str]:
    """The modules a file imports, by name: `import a.b` and `from a.b import c` give a.b, and a.b.c as well (c may be a
    module of the package a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def live_kernel_modules(kernels: Path, fast: Path) -> tuple[set[str], set[str]]:
    """(every module of `kernels`, those imported from the plan machinery): a kernel module is live when a module of
    `fast` (minirt/fast/, where the plan picks the kernels) or a live kernel module imports it."""
    modules = {f"minirt.kernels.{p.stem}" for p in kernels.glob("*.py") if p.stem != "__init__"}
    imported = set().union(*(_imported_modules(p) for p in fast.rglob("*.py")))
    live = modules & imported
    while True:
        more = modules & set().union(set(), *(_imported_modules(kernels / f"{m.rsplit('.', 1)[1]}.py") for m in live))
        if more <= live:
            return modules, live
        live |= more


def test_every_kernel_module_is_one_a_plan_can_select():
    """minirt/kernels/ holds only what the plan machinery runs: every module there is imported from minirt/fast/ or
    by a kernel module that is, and nothing but Python modules (the probe kernels and their CUDA sources live in
    lab/kernels/). The oracle is the source's own imports (ast), not a list kept by hand."""
    kernels, fast = ROOT / "minirt" / "kernels", ROOT / "minirt" / "fast"
    modules, live = live_kernel_modules(kernels, fast)
    assert {"minirt.kernels.gemv_triton", "minirt.kernels.paged_attention_triton"} <= live    # the check sees imports
    assert sorted(modules - live) == [], "kernel modules no plan can select (move them to lab/kernels/)"
    others = sorted(p.name for p in kernels.iterdir() if p.is_file() and p.suffix != ".py")
    assert others == [], "files in minirt/kernels/ that are not kernel modules"


def test_the_kernel_check_finds_a_module_nothing_imports(tmp_path):
    """`live_kernel_modules` on a copy of the tree with one more kernel module that nothing imports, and one imported
    only by it: both are reported, so the check above can fail."""
    import shutil

    kernels, fast = tmp_path / "kernels", tmp_path / "fast"
    shutil.copytree(ROOT / "minirt" / "kernels", kernels, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "minirt" / "fast", fast, ignore=shutil.ignore_patterns("__pycache__"))
    (kernels / "probe_triton.py").write_text("from minirt.kernels.probe_helper import x\n")
    (kernels / "probe_helper.py").write_text("x = 1\n")
    modules, live = live_kernel_modules(kernels, fast)
    assert modules - live == {"minirt.kernels.probe_triton", "minirt.kernels.probe_helper"}
