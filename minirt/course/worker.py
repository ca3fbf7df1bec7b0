"""The untrusted side of grading: `python -m minirt.course.worker PLAN.json`, started by the grader in a sandbox.

It runs the submission's code cells top to bottom in one IPython shell (each cell interrupted after the
plan's `cell_timeout` seconds). At each check cell it does not run the cell: it evaluates the check's
argument (the task's function or class, e.g. `slot_mapping`), tells the grader, and answers the grader's
calls until told to go on:

    grader -> worker   {"op": "case", "inputs": <wire value>, "time_left": s}  |  {"op": "next"}
    worker -> grader   {"event": "ready"}   (once, before the first cell: the sandbox started)
                       {"event": "cell", "index": i, "error": str | None}
                       {"event": "task", "task": "ex03.slot_mapping", "error": str | None, "identity": {...}}
                       {"kind": "ok", "value": <wire value>, "printed": str}   (one per "case")
                       {"kind": "raised", "type": "builtins.ValueError", "mro": [...], "message": str, "printed": str}
                       {"kind": "not_implemented" | "timeout"}
                       {"kind": "blocked", "printed": ""}   (the student's code reached minirt's reference)
                       {"event": "done"}

A case applies the task's driver (`checks.SPECS[task]().run`, default `f(*inputs)`) to the inputs the grader
sent: a stateful task's inputs are the whole sequence of operations (method calls on the student's pool,
admissions and steps of a scheduler), and its answer is the trace of every call. The protocol travels on
the worker's original stdin/stdout; the cells' own prints go to stderr, which the grader caps and drops.
Nothing here is trusted: the grader compares every answer with the reference in its own process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import types

MAX_PRINTED = 2000          # characters of what the student's function printed during one case, sent back
MAX_OUTPUT = 4 * 2**20      # characters the cells may print through sys.stdout / sys.stderr; the rest is dropped


BLOCKED_MESSAGE = "minirt's reference is not available while grading"


class ReferenceBlocked(BaseException):
    """Raised by minirt's reference of the graded task while the student's code runs (a BaseException: the drives'
    `except Exception` records do not swallow it, the worker reports it and the grader scores the task 0)."""


def _blocked_code(num_free: int) -> types.CodeType:
    """The code of a function that raises ReferenceBlocked, with `num_free` free variables (a function's code can
    be replaced only by one with as many as its closure has cells)."""
    names = [f"_cell{i}" for i in range(num_free)]
    src = ("def _outer():\n" + "".join(f"    {n} = None\n" for n in names) +
           "    def blocked(*args, **kwargs):\n" + (f"        ({', '.join(names)},)\n" if names else "") +
           f"        raise __minirt_reference_blocked__({BLOCKED_MESSAGE!r})\n    return blocked\n")
    ns: dict = {}
    exec(compile(src, "<minirt: reference blocked>", "exec"), ns)  # noqa: S102 - the worker's own text
    return ns["_outer"]().__code__


def _functions_of(obj) -> list[types.FunctionType]:
    """The Python functions behind a reference: itself (and what it wraps), or every method of a class."""
    out, todo = [], [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, type):
            for v in vars(o).values():
                for part in (v, getattr(v, "__func__", None), getattr(v, "fget", None), getattr(v, "fset", None)):
                    if isinstance(part, types.FunctionType):
                        todo.append(part)
        elif isinstance(o, types.FunctionType) and all(o is not f for f in out):
            out.append(o)
            if isinstance(getattr(o, "__wrapped__", None), (types.FunctionType, type)):
                todo.append(o.__wrapped__)
    return out


def block_references(task: str) -> list[tuple[types.FunctionType, types.CodeType]]:
    """Make minirt's reference of `task` raise ReferenceBlocked wherever it is held: its functions' code is
    replaced in place (so `[ref]`, `functools.partial(ref)`, an alias, a subclass or an object whose method it is
    all reach the raising code), and so is the code of every other function whose code equals it (a copy of its
    code object, or of its module's source, run by the notebook). Returns what `unblock` puts back."""
    import builtins
    import gc

    from minirt.course import provenance

    builtins.__minirt_reference_blocked__ = ReferenceBlocked
    _kill_helpers()
    funcs = [f for ref in provenance.reference_objects(task) for f in _functions_of(ref)]
    originals = [f.__code__ for f in funcs]
    for o in gc.get_objects():
        if type(o) is types.FunctionType and all(o is not f for f in funcs):
            try:
                if any(o.__code__ == c for c in originals):
                    funcs.append(o)
            except Exception:  # noqa: BLE001 - a function whose code cannot be compared is not a copy
                pass
    saved = []
    for f in funcs:
        code = f.__code__
        f.__code__ = _blocked_code(len(code.co_freevars))
        saved.append((f, code))
    return saved


def _kill_helpers() -> None:
    """Kill every other process of this worker's unprivileged uid (a helper the notebook forked earlier would
    keep an unblocked copy of the reference). Only in a sandbox's own uid: as any other user this does nothing."""
    from minirt.course.sandbox import BASE_UID

    if os.getuid() >= BASE_UID and os.geteuid() >= BASE_UID:
        try:
            os.kill(-1, signal.SIGKILL)         # every process this uid may signal, never this one or init
        except OSError:
            pass


def unblock(saved: list[tuple[types.FunctionType, types.CodeType]]) -> None:
    for f, code in saved:
        f.__code__ = code


class CellTimeout(BaseException):
    """The cell or the task ran past its time (a BaseException: `except Exception` in the code does not stop it)."""


def _alarm(seconds: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, max(0.0, seconds))


def _on_alarm(signum, frame):
    raise CellTimeout()


class Channel:
    def __init__(self):
        self.inp = os.fdopen(os.dup(0), "rb", buffering=0)
        self.out = os.fdopen(os.dup(1), "wb", buffering=0)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(2, 1)                           # the cells' prints go where stderr goes (capped by the grader)
        self._buf = b""

    def send(self, msg: dict) -> None:
        self.out.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    def recv(self) -> dict | None:
        while b"\n" not in self._buf:
            chunk = self.inp.read(1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def _code_objects(obj) -> list[types.CodeType]:
    out = []
    funcs = [obj] if isinstance(obj, types.FunctionType) else []
    if isinstance(obj, type):
        for v in vars(obj).values():
            v = getattr(v, "fget", None) or getattr(v, "__func__", None) or v
            if isinstance(v, types.FunctionType):
                funcs.append(v)
    stack = [f.__code__ for f in funcs]
    while stack:
        code = stack.pop()
        out.append(code)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


def identity(obj, task: str) -> dict:
    """What the graded object is (module, qualname, bases) and which of minirt's references of this task
    its code reaches through its globals or closure. Reported to the grader, which decides."""
    from minirt.course import checks, provenance

    refs = provenance.reference_objects(task)
    info = {"module": str(getattr(obj, "__module__", None)), "qualname": str(getattr(obj, "__qualname__", None)),
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in getattr(obj, "__mro__", ())][:50],
            "is_reference": any(obj is r for r in refs), "uses": []}
    funcs = [obj] if isinstance(obj, types.FunctionType) else \
        [v for v in vars(obj).values() if isinstance(v, types.FunctionType)] if isinstance(obj, type) else []
    for f in funcs:
        reachable = list(getattr(f, "__globals__", {}).items())
        reachable += [(f"<closure {n}>", c.cell_contents) for n, c in
                      zip(f.__code__.co_freevars, f.__closure__ or ()) if _filled(c)]
        names = {n for code in _code_objects(f) for n in code.co_names}
        for name, value in reachable:
            if (name in names or name.startswith("<closure")) and any(value is r for r in refs):
                info["uses"].append(name)
    del checks
    return info


def _filled(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _shell():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    return InteractiveShell.instance(config=config)


class Tools:
    """The grading functions, taken before any of the submission's code runs (a later `checks._outcome = ...`
    does not reach them; the grader's AST screen refuses such code anyway, and verdicts are the grader's)."""

    def __init__(self):
        import torch

        from minirt.course import checks, wire

        self.specs = dict(checks.SPECS)
        self.apply, self.outcome, self.quiet = checks.apply, checks._outcome, checks._quiet
        self.not_implemented, self.max_repr = checks._NotImplemented, checks.MAX_REPR
        self.device = checks.device()
        self.encode, self.decode = wire.encode, wire.decode
        self.seed = torch.manual_seed


class CappedText(io.TextIOBase):
    """sys.stdout / sys.stderr of the cells: the first `cap` characters reach the grader, the rest is dropped."""

    def __init__(self, fd: int, cap: int):
        self.raw = os.fdopen(os.dup(fd), "w", buffering=1, errors="replace")
        self.cap, self.used = cap, 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.used < self.cap:
            self.raw.write(text[:self.cap - self.used])
        self.used += len(text)
        return len(text)

    def flush(self) -> None:
        try:
            self.raw.flush()
        except OSError:
            pass


def serve_task(chan: Channel, tools: Tools, task: str, fn) -> None:
    """Answer the grader's cases for one task until it says "next"."""
    spec = tools.specs[task]()
    run = tools.apply(spec)
    saved = block_references(task)
    try:
        _serve_cases(chan, tools, run, fn)
    finally:
        unblock(saved)


def _serve_cases(chan: Channel, tools: Tools, run, fn) -> None:
    while True:
        req = chan.recv()
        if req is None:
            os._exit(0)
        if req.get("op") != "case":
            return
        reply: dict
        try:
            inputs = tools.decode(req["inputs"], device=tools.device, rebuild=True)
            tools.seed(0)
            _alarm(float(req.get("time_left", 60)))
            try:
                with tools.quiet():
                    kind, value, printed = tools.outcome(run, fn, inputs, student=True)
            finally:
                _alarm(0)
            printed = printed[:MAX_PRINTED]
            if kind == "ok":
                reply = {"kind": "ok", "value": tools.encode(value), "printed": printed}
            else:
                reply = {"kind": "raised", "type": f"{type(value).__module__}.{type(value).__qualname__}",
                         "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(value).__mro__],
                         "message": str(value)[:tools.max_repr], "printed": printed}
        except tools.not_implemented:
            reply = {"kind": "not_implemented"}
        except CellTimeout:
            reply = {"kind": "timeout"}
        except ReferenceBlocked:
            reply = {"kind": "blocked", "printed": ""}
        chan.send(reply)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        plan = json.load(f)
    chan = Channel()
    sys.stdout = sys.stderr = CappedText(2, MAX_OUTPUT)
    signal.signal(signal.SIGALRM, _on_alarm)
    tools = Tools()
    shell = _shell()
    chan.send({"event": "ready"})                 # before any of the submission's code: the sandbox started
    timeout = float(plan["cell_timeout"])
    for i, cell in enumerate(plan["cells"]):
        task = cell.get("task")
        if task is None:
            _alarm(timeout)
            try:
                result = shell.run_cell(cell["source"], store_history=False)
                error = result.error_before_exec or result.error_in_exec
            except CellTimeout as e:
                error = e
            finally:
                _alarm(0)
            chan.send({"event": "cell", "index": i,
                       "error": None if error is None else ("timeout" if isinstance(error, CellTimeout)
                                                            else f"{type(error).__name__}: {error}"[:300])})
            continue
        error, info, fn = None, None, None
        _alarm(timeout)
        try:
            fn = eval(cell["arg"], shell.user_ns)          # noqa: S307 - the submission's own namespace
            info = identity(fn, task)
        except CellTimeout:
            error = "timeout"
        except BaseException as e:  # noqa: BLE001 - a missing function is that task's failure only
            error = f"{type(e).__name__}: {e}"[:300]
        finally:
            _alarm(0)
        chan.send({"event": "task", "task": task, "error": error, "identity": info})
        serve_task(chan, tools, task, fn)
    chan.send({"event": "done"})
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
