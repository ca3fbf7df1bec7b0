"""Is a graded function minirt's own? Handing in (or calling) the package's reference is not a solution.

What enforces it is the worker (`minirt.course.worker.block_references`): while the student's code answers a
task's cases, the reference of that task raises wherever it is held, and the grader scores the task 0. This
module reads the notebook's source in the grader's process (with `ast`, after IPython's own transformation of
magics, never running or importing anything it names) for notes and hints on top of that:

* `scan(sources, task, name)` zeroes the task for a route to its reference found in the source:
  - an import that binds the reference (`from minirt.kv.paged_cache import slot_mapping`, a re-export such as
    `from minirt.kv import BlockPool`, an alias), resolved by identity among the modules the grader has loaded;
  - a dotted name that reaches it from a minirt import (`minirt.kv.paged_cache.slot_mapping`,
    `Scheduler.schedule` after `from minirt.scheduler import Scheduler`);
  - inside the graded definition itself, a call of a method of the reference's name (`scheduler.schedule()`
    in `schedule`, `cache.match(...)` in `match`);
  - the reference's name in a string handed to import or attribute machinery (`getattr(m, "slot_mapping")`,
    `import_module`, `attrgetter`, ...); a string printed or compared is nobody's business.
* `screen(sources)` zeroes every task for a route into the grading machinery (the grader's modules, the checks'
  internals, patching anything imported from minirt) and returns the rest as warnings: reflection, code built
  at run time, magics, a cell too deep to read. Warnings cost no point.
* `judge_identity(info, task)` reads what the worker reported about the object it took; the worker runs the
  student's code, so its report is a warning only.

What none of this catches: the reference's source copied by hand under another name, and, with `--sandbox none`
only, a helper process forked before the task's cases start (elsewhere the worker kills its uid's other processes
first). A table of the public cases' answers fails the grader's seeded extra cases (`checks.extra_cases`).
"""

from __future__ import annotations

import ast
import pkgutil
import sys
from typing import Any

from minirt.course.checks import REFERENCE_NAMES

# What a graded notebook may not use at all: the means to reach into the worker's grading code or the
# interpreter (reflection, code built from text, the grader's own modules). A tampering submission scores 0
# on every task.
TAMPER_MODULES = {"builtins", "gc", "ctypes", "marshal", "inspect", "importlib", "pkgutil", "types", "code",
                  "codeop", "runpy", "zipimport", "dis", "imp", "cffi", "signal", "threading", "_thread"}
TAMPER_NAMES = {"exec", "eval", "compile", "__import__", "globals", "locals", "vars", "__builtins__",
                "breakpoint", "get_ipython"}
TAMPER_ATTRS = {"__code__", "__globals__", "__closure__", "__builtins__", "__subclasses__", "__dict__",
                "__getattribute__", "__setattr__", "f_locals", "f_globals", "f_back", "f_builtins", "gi_frame",
                "tb_frame", "_getframe", "settrace", "setprofile", "modules", "setitimer", "alarm", "__bases__",
                "__mro__", "__class__"}
GRADER_MODULES = ("minirt.course.worker", "minirt.course.wire", "minirt.course.provenance",
                  "minirt.course.grading", "minirt.course.sandbox")
CHECKS_PUBLIC = {"CheckFailed", "ToyTokenizer", "tiny_model", "device", "TINY_VOCAB"}


def reference_objects(task: str) -> list[Any]:
    """minirt's implementation(s) of this task (functions, classes, unbound methods)."""
    return [pkgutil.resolve_name(n) for n in REFERENCE_NAMES.get(task, ())]


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _lookup(root: Any, attrs: list[str]) -> list[Any]:
    """The objects along root.a.b.c (as far as they exist)."""
    out, obj = [], root
    for a in attrs:
        try:
            obj = getattr(obj, a)
        except Exception:  # noqa: BLE001 - a name that minirt does not have reaches nothing
            break
        out.append(obj)
    return out


def _checks_name_ok(name: str) -> bool:
    from minirt.course import checks

    return name in CHECKS_PUBLIC or name.replace("_", ".", 1) in checks.TASKS


def screen(sources: list[str]) -> tuple[str | None, list[str]]:
    """(a note that zeroes every task, or None; warnings) for the submission's code cells.

    Zeroes: a real route into the grading machinery - importing the grader's own modules or the checks'
    internals, and patching minirt (assigning to, or `setattr`/`delattr` on, anything imported from minirt).
    Warnings only (shown in the grade sheet's warnings column, never a lost point): reflection and code built at
    run time (`__class__`, `getattr(self, op)`, `import types`, `exec`, magics, ...) and cells too deep to read.
    Both are hints for the instructor; what keeps minirt's reference out of reach is the worker, which replaces
    the graded task's reference while the student's code runs (`minirt.course.worker`)."""
    warnings: list[str] = []
    for source in sources:
        tree, unreadable = parse_cell(source)
        if unreadable:
            warnings.append(unreadable)
        if tree is None:
            continue
        bound = _import_bindings(tree)
        for node in ast.walk(tree):
            where, hard = None, False
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(GRADER_MODULES):
                        where, hard = f"import {a.name}", True
                    elif a.name.split(".")[0] in TAMPER_MODULES:
                        where = f"import {a.name}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(GRADER_MODULES):
                    where, hard = f"from {node.module} import ...", True
                elif node.module.split(".")[0] in TAMPER_MODULES:
                    where = f"from {node.module} import ..."
                elif node.module == "minirt.course":
                    bad = [a.name for a in node.names if a.name != "checks"]
                    where, hard = (f"from minirt.course import {bad[0]}", True) if bad else (None, False)
                elif node.module == "minirt.course.checks":
                    bad = [a.name for a in node.names if not _checks_name_ok(a.name)]
                    where, hard = (f"from minirt.course.checks import {bad[0]}", True) if bad else (None, False)
            elif isinstance(node, ast.Name) and node.id in TAMPER_NAMES:
                where = node.id
            elif isinstance(node, ast.Attribute):
                chain = _dotted(node)
                objs = _lookup(bound[chain[0]], chain[1:]) if chain and chain[0] in bound else []
                from minirt.course import checks
                path = [bound[chain[0]], *objs] if objs else []
                for k, o in enumerate(path[:-1]):
                    if o is checks and not _checks_name_ok(chain[k + 1]):
                        where, hard = ".".join(chain[:k + 2]), True
                if chain and chain[0] in bound and isinstance(node.ctx, (ast.Store, ast.Del)):
                    where, hard = f"{'.'.join(chain)} = ... (patching minirt)", True
                elif where is None and node.attr in TAMPER_ATTRS:
                    where = f".{node.attr}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("setattr", "delattr", "getattr") and node.args:
                first = _dotted(node.args[0])
                if first and first[0] in bound and node.func.id != "getattr":
                    where, hard = f"{node.func.id}({_unparse(node.args[0])}, ...) (patching minirt)", True
                elif node.func.id != "getattr" or (len(node.args) > 1 and not isinstance(node.args[1], ast.Constant)):
                    where = f"{node.func.id}({_unparse(node.args[0])}, ...)"
            if where and hard:
                return (f"tampers with the grader ({where[:80]}): not allowed in a graded notebook",
                        warnings)
            if where:
                text = f"reflection or code built at run time ({where[:60]})"
                if text not in warnings:
                    warnings.append(text)
    return None, warnings[:20]


def tampering(sources: list[str]) -> str | None:
    """The note of `screen` that zeroes every task, or None."""
    return screen(sources)[0]


def _module(name: str) -> Any:
    """The module of that name if the grader has it loaded already: a name a submission writes is never imported
    here (importing runs code, and `minirt.__main__` would start a grading run inside this one)."""
    return sys.modules.get(name)


def _import_bindings(tree: ast.AST) -> dict[str, Any]:
    """Names bound by imports from minirt, to the grader's own objects (the modules it has loaded: every
    reference's module is, `reference_objects` imports them by their trusted names)."""
    bound: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "minirt":
                    module = _module(a.name)
                    if a.asname and module is not None:
                        bound[a.asname] = module
                    elif not a.asname:
                        bound["minirt"] = _module("minirt")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "minirt":
            module = _module(node.module)
            for a in node.names:
                value = getattr(module, a.name, None) if module is not None else None
                if value is None:
                    value = _module(f"{node.module}.{a.name}")
                if value is not None:
                    bound[a.asname or a.name] = value
    return bound


def parse_cell(source: str) -> tuple[ast.AST | None, str | None]:
    """(tree, None) of a cell as IPython runs it (magics and `!` commands transformed into the calls they make, so
    they are read too), or (None, why) when it cannot be read: a syntax error (the cell fails when it runs) or
    nesting deeper than the parser goes (a finding, never a crash of the grader)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 - IPython could not transform it: read it as written
        pass
    try:
        return ast.parse(source), None
    except SyntaxError:
        return None, None
    except (RecursionError, MemoryError, ValueError, OverflowError):
        return None, "a cell nests too deeply to be read"


def scan(sources: list[str], task: str, name: str | None) -> str | None:
    """A note when the submission's code (its non-check code cells) hands in or calls this task's reference."""
    refs = reference_objects(task)
    ref_names = {n.split(":")[1].split(".")[-1] for n in REFERENCE_NAMES.get(task, ())}
    methods = {n.split(":")[1].split(".")[-1] for n in REFERENCE_NAMES.get(task, ()) if "." in n.split(":")[1]}
    is_ref = lambda obj: any(obj is r for r in refs)  # noqa: E731
    shown = ", ".join(n.replace(":", ".") for n in REFERENCE_NAMES.get(task, ()))
    for source in sources:
        tree, _ = parse_cell(source)
        if tree is None:
            continue                      # a broken cell (it fails when it runs), or one too deep to read
        bound = _import_bindings(tree)
        for alias, value in bound.items():
            if is_ref(value):
                return f"hands in minirt's own implementation ({shown}, imported as {alias!r}): not a solution"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain = _dotted(node)
                if chain and chain[0] in bound and any(is_ref(o) for o in _lookup(bound[chain[0]], chain[1:])):
                    return f"reaches minirt's own implementation ({'.'.join(chain)}): not a solution"
            if isinstance(node, ast.Call) and _machinery(node.func) and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and
                    any(r in a.value for r in ref_names) for a in [*node.args, *(k.value for k in node.keywords)]):
                return (f"looks up minirt's implementation of this task by name ({_unparse(node)[:80]}): "
                        "not a solution")
            if name and isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Attribute) and inner.attr in methods and not (
                            isinstance(inner.value, ast.Name) and inner.value.id == "self"):
                        return (f"calls minirt's own implementation ({_unparse(inner)} is {shown}): "
                                "not a solution")
    return None


MACHINERY = {"getattr", "setattr", "hasattr", "delattr", "__import__", "import_module", "attrgetter", "methodcaller",
             "resolve_name", "find_spec", "find_module", "load_module", "locate", "__getattribute__"}


def _machinery(func: ast.AST) -> bool:
    """Whether a call hands its strings to import or attribute machinery (`getattr(m, "slot_mapping")`,
    `importlib.import_module(...)`, `operator.attrgetter(...)`, `vars(m).get(...)`, ...)."""
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name in MACHINERY


def _unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001
        return "?"


def judge_identity(info: dict | None, task: str) -> str | None:
    """A note when the worker's report says the object is, subclasses, or holds the reference."""
    if not isinstance(info, dict):
        return None
    shown = ", ".join(n.replace(":", ".") for n in REFERENCE_NAMES.get(task, ()))
    qualified = {n.replace(":", ".") for n in REFERENCE_NAMES.get(task, ())}
    own = f"{info.get('module')}.{info.get('qualname')}"
    if info.get("is_reference") or own in qualified:
        return f"hands in minirt's own implementation ({shown}): not a solution"
    mro = info.get("mro") or []
    if isinstance(mro, list) and any(m in qualified for m in mro[1:]):
        return f"subclasses minirt's own implementation ({shown}): not a solution"
    uses = info.get("uses") or []
    if uses:
        return f"calls minirt's own implementation ({shown}, through {str(uses[0])[:60]!r}): not a solution"
    return None
