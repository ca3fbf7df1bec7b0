"""Checkers of the graded exercise tasks: the student's function against the package's reference.

Each `exNN_<task>(fn)` runs `fn` and the reference function of `minirt` on the same device (CUDA when
available, else the CPU) over a fixed list of seeded cases - edge cases first (empty input, exactly one
block, the block boundary B-1 / B / B+1, ...), then random ones - and compares the results: exactly for
integers, lists and strings, with a dtype-aware tolerance for floating tensors. It prints exactly one line,

    PASS ex03.slot_mapping (14/14 cases)

and nothing else, whatever the device, so that nbval can compare the cell's output with the stored one.
On the first mismatch it raises `CheckFailed` (an AssertionError) whose message names the case, its
inputs, the expected value and what came back. A function that still raises NotImplementedError fails
with "task not implemented yet". What the student's function prints is captured (and shown only in a
failure message), warnings are ignored and library logging is silenced while a check runs.

Idea as in tiny-llm's per-lesson tests (skyzh/tiny-llm): one reference, one check per task, run locally.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import numbers
import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

MAX_REPR = 300          # characters of a value shown in a failure message
# (atol, rtol) per floating dtype: float32 allows for a different summation order, half precision for
# a different rounding of intermediate results (a naive softmax in bf16 against SDPA's fp32 accumulation).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-7, 1e-7),
              torch.float16: (2e-2, 2e-2), torch.bfloat16: (4e-2, 4e-2)}


class CheckFailed(AssertionError):
    """A graded task's function disagrees with the reference (or is not implemented yet).

    In IPython (Jupyter, nbval, nbclient) it shows as its message alone, without the traceback through this
    module (`_render_traceback_`, IPython's hook for exceptions that render themselves); the cell still fails.
    When the student's function raised where the reference returned, the frames of the student's own code
    (and of whatever it called) follow, the checker's frames left out.
    """

    def _render_traceback_(self) -> list[str]:
        lines = [f"\x1b[0;31mCheckFailed\x1b[0m: {self}"]
        cause = self.__cause__
        if cause is not None and cause.__traceback__ is not None:
            import traceback

            frames = [f for f in traceback.extract_tb(cause.__traceback__)
                      if f.filename not in _CHECKER_FILES]
            if frames:
                lines += ["", "Your function raised it here:",
                          *"".join(traceback.format_list(frames)).rstrip("\n").split("\n"),
                          *traceback.format_exception_only(type(cause), cause)[-1:]]
        return [line.rstrip("\n") for line in lines]


_CHECKER_FILES = {__file__, contextlib.__file__}


def device() -> torch.device:
    """Where checks run: CUDA when available, else the CPU (student and reference on the same one)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ============================================================================== running and comparing


@dataclass
class Case:
    """One check case. `make()` builds fresh inputs (each function gets its own copy); `show` describes them."""

    name: str
    make: Callable[[], Any]
    show: str


class _NotImplemented(Exception):
    pass


@contextlib.contextmanager
def _quiet():
    """No warnings, no library logging while a check runs (the PASS line must be the only output)."""
    previous = logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(previous)


def _short(x: Any, limit: int = MAX_REPR) -> str:
    if isinstance(x, torch.Tensor):
        with torch.no_grad():
            vals = x.detach().cpu()
            text = repr(vals.tolist() if vals.numel() <= 64 else vals.flatten()[:16].tolist())
        s = f"tensor(shape={list(x.shape)}, dtype={x.dtype}, device={x.device.type}, values={text})"
    else:
        s = repr(x)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def _diff(expected: Any, got: Any, path: str = "result") -> str | None:
    """None when equal (floating tensors within TOLERANCES), else the first difference in words."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a torch.Tensor, got {type(got).__name__}: {_short(got)}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{path}: expected shape {list(expected.shape)}, got shape {list(got.shape)}"
        if got.dtype != expected.dtype:
            return f"{path}: expected dtype {expected.dtype}, got {got.dtype}"
        if got.device != expected.device:
            return f"{path}: expected a tensor on {expected.device}, got one on {got.device}"
        e, g = expected.detach(), got.detach()
        if e.dtype.is_floating_point:
            atol, rtol = TOLERANCES.get(e.dtype, (1e-5, 1e-5))
            ok = torch.isclose(g, e, atol=atol, rtol=rtol, equal_nan=True)
        else:
            ok = g == e
        if bool(ok.all()):
            return None
        bad = (~ok).nonzero()[0].tolist()
        where = tuple(bad)
        msg = (f"{path}: {int((~ok).sum())} of {e.numel()} elements differ; first at index {list(where)}: "
               f"expected {e[where].item()!r}, got {g[where].item()!r}")
        if e.dtype.is_floating_point:
            err = (g.float() - e.float()).abs().nan_to_num(float("inf")).max().item()
            msg += f" (max abs error {err:.3g}; tolerance atol={atol:g}, rtol={rtol:g} for {e.dtype})"
        return msg
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            if isinstance(got, dict) and set(got) - set(expected):
                extra = {k: got[k] for k in got if k not in expected}
                return f"{path}: expected {_short(expected)}\n  got {_short(extra)}"
            return f"{path}: expected {_short(expected)}, got {_short(got)}"
        for k in expected:
            d = _diff(expected[k], got[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return (f"{path}: expected a {type(expected).__name__} {_short(expected)}, "
                    f"got {type(got).__name__}: {_short(got)}")
        for i, (e, g) in enumerate(zip(expected, got)):
            d = _diff(e, g, f"{path}[{i}]")
            if d:
                return d if (isinstance(e, (list, tuple, dict, torch.Tensor))) else (
                    f"{path}[{i}]: expected {_short(e)}, got {_short(g)}\n  whole value expected: {_short(expected)}"
                    f"\n  whole value got:      {_short(got)}")
        if len(got) != len(expected):
            i = min(len(got), len(expected))
            extra = (f"; first missing item: {_short(expected[i])}" if len(expected) > i
                     else f"; first extra item: {_short(got[i])}")
            return (f"{path}: expected length {len(expected)}, got length {len(got)} (the first {i} items agree"
                    f"{extra})\n  whole value expected: {_short(expected)}\n  whole value got:      {_short(got)}")
        return None
    if isinstance(got, torch.Tensor):
        return f"{path}: expected {type(expected).__name__} {_short(expected)}, got a tensor {_short(got)}"
    if isinstance(expected, bool) or expected is None or isinstance(got, bool):
        return None if (got is expected or (type(got) is type(expected) and got == expected)) else \
            f"{path}: expected {_short(expected)}, got {_short(got)}"
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return None if got == expected else f"{path}: expected {expected!r}, got {got!r}"
    if type(got) is not type(expected) and not (isinstance(expected, int) and isinstance(got, int)):
        return f"{path}: expected {type(expected).__name__} {_short(expected)}, got {type(got).__name__} {_short(got)}"
    return None if got == expected else f"{path}: expected {_short(expected)}, got {_short(got)}"


def _outcome(run: Callable[[Callable, Any], Any], fn: Callable, inputs: Any, student: bool):
    """('ok', value, printed) or ('raised', exception, printed); NotImplementedError from the student escapes."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return "ok", run(fn, inputs), out.getvalue()
    except NotImplementedError as e:
        if student:
            raise _NotImplemented(str(e)) from None
        return "raised", e, out.getvalue()
    except Exception as e:  # noqa: BLE001 - any exception is an outcome to compare
        return "raised", e, out.getvalue()


class RemoteError(Exception):
    """An exception raised in the grading worker, as the grader receives it: its type's qualified name and
    those of its bases (`builtins.ValueError`, ...), and its message. Never the exception object itself."""

    def __init__(self, type_name: str, mro: list[str], message: str):
        super().__init__(message)
        self.type_name, self.mro, self.message = type_name, list(mro), message


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe_exc(e: BaseException) -> str:
    name = e.type_name.rsplit(".", 1)[-1] if isinstance(e, RemoteError) else type(e).__name__
    text = f"{name}: {e}"
    return text if len(text) <= MAX_REPR else text[:MAX_REPR] + "..."


def _raised_like(got: BaseException, expected: BaseException) -> bool:
    """The student's exception is of the reference's exception type (or a subclass of it)."""
    if isinstance(got, RemoteError):
        return _qualified(type(expected)) in got.mro
    return isinstance(got, type(expected))


@dataclass
class Spec:
    """What a task's check runs: the reference, the cases, and `run(f, inputs)` (default `f(*inputs)`),
    which may drive a whole scenario (a pool, a scheduler) and return a trace of plain data."""

    reference: Callable
    cases: list[Case]
    run: Callable[[Callable, Any], Any] | None = None
    extra: Callable[[random.Random], list[Case]] | None = None   # the grader's seeded cases (`extra_cases`)


def apply(spec: Spec) -> Callable[[Callable, Any], Any]:
    """The function that applies a task's function (or class) to one case's inputs."""
    return spec.run or (lambda f, inputs: f(*inputs))


def reference_outcome(spec: Spec, case: Case) -> tuple[str, Any]:
    """('ok', value) or ('raised', exception) of the reference on one case, seeded as the student's run is."""
    torch.manual_seed(0)
    kind, value, _ = _outcome(apply(spec), spec.reference, case.make(), student=False)
    return kind, value


def task_number(task_id: str) -> int | None:
    """k of the exercise's "## Task k" heading: the task's place among its exercise's tasks in `TASKS`."""
    same = [t for t in TASKS if t.split(".")[0] == task_id.split(".")[0]]
    return same.index(task_id) + 1 if task_id in same else None


def _where(task_id: str) -> str:
    """Where the student finds the check (nbval's "Cell N" counts code cells only, from 0)."""
    k = task_number(task_id) if "TASKS" in globals() else None
    return f" (the check cell of Task {k})" if k else ""


def not_implemented_message(task_id: str) -> str:
    return (f"{task_id}{_where(task_id)}: task not implemented yet - your function raised NotImplementedError. "
            "Replace the `raise NotImplementedError(...)` line with your solution and run this cell again.")


def compare(task_id: str, i: int, case: Case, n: int, expected: tuple[str, Any], got: tuple[str, Any],
            printed: str = "") -> str | None:
    """None when the student's outcome on case `i` (1-based) of `n` agrees with the reference's, else the
    failure message: the case, its inputs, what was expected and what came back. Used by `run_check` in the
    notebook and by the grader, which receives the student's outcome from its worker as data."""
    kind_e, value_e = expected
    kind_g, value_g = got
    head = f"{task_id} failed on case {i}/{n} '{case.name}'{_where(task_id)}\n  inputs:   {case.show}\n"
    tail = f"\n  your function printed: {_short(printed)}" if printed else ""
    if kind_e == "raised":
        if kind_g == "raised" and _raised_like(value_g, value_e):
            return None
        what = f"raised {_describe_exc(value_g)}" if kind_g == "raised" else f"returned {_short(value_g)}"
        return (f"{head}  expected: {type(value_e).__name__} to be raised ({_describe_exc(value_e)})\n"
                f"  got:      your function {what}{tail}")
    if kind_g == "raised":
        return f"{head}  expected: {_short(value_e)}\n  got:      your function raised {_describe_exc(value_g)}{tail}"
    d = _diff(value_e, value_g)
    return None if d is None else f"{head}  {d}{tail}"


def run_check(task_id: str, fn: Callable, reference: Callable, cases: list[Case],
              run: Callable[[Callable, Any], Any] | None = None) -> None:
    """Compare `fn` with `reference` on every case; print one PASS line or raise CheckFailed.

    run(f, inputs) applies a function to one case's inputs (default `f(*inputs)`); it may drive a whole
    scenario and return a trace. A case where the reference raises passes if `fn` raises the same type.
    """
    if not callable(fn):
        raise CheckFailed(f"{task_id}: expected your function (or class), got {type(fn).__name__}")
    spec = Spec(reference, cases, run)
    n = len(cases)
    with _quiet(), torch.random.fork_rng(devices=[]):
        for i, case in enumerate(cases, 1):
            expected = reference_outcome(spec, case)
            torch.manual_seed(0)
            try:
                kind_g, got, printed = _outcome(apply(spec), fn, case.make(), student=True)
            except _NotImplemented:
                raise CheckFailed(not_implemented_message(task_id)) from None
            message = compare(task_id, i, case, n, expected, (kind_g, got), printed)
            if message is not None:
                raise CheckFailed(message) from (got if kind_g == "raised" and expected[0] == "ok" else None)
    print(f"PASS {task_id} ({n}/{n} cases)")


SPECS: dict[str, Callable[[], Spec]] = {}     # task -> the function that builds its Spec


def _task(build: Callable[[], Spec]) -> Callable[[Callable], None]:
    """Register a task's Spec builder (`ex03_slot_mapping` -> "ex03.slot_mapping") and return the check the
    notebook calls: `checks.ex03_slot_mapping(fn)` runs `run_check` on that Spec."""
    task_id = build.__name__.replace("_", ".", 1)
    SPECS[task_id] = build

    def check(fn: Callable) -> None:
        spec = build()
        run_check(task_id, fn, spec.reference, spec.cases, spec.run)

    check.__name__ = check.__qualname__ = build.__name__
    check.__doc__ = build.__doc__
    check.task_id = task_id
    return check


def _rng(seed: int) -> random.Random:
    return random.Random(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, dev: torch.device | None = None,
           scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=dev or device())


# ============================================================================== a tiny model

_MODELS: dict[str, Any] = {}
TINY_VOCAB = 96


def tiny_model(dev: torch.device | str | None = None):
    """A tiny random Qwen3-architecture `DecoderModel` (float32, vocab 96, 2 layers, GQA), built in code.

    Seeded and with a scaled-up init (sharp attention, well separated logits), so greedy decoding is
    deterministic and far from ties. Cached per device. Used by the checks of ex01 and ex02.
    """
    from transformers import Qwen3Config

    from minirt.model.decoder import DecoderModel
    from minirt.model.layers import RotaryEmbedding

    dev = torch.device(dev) if dev is not None else device()
    key = str(dev)
    if key in _MODELS:
        return _MODELS[key]
    with _quiet():
        config = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
                             pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
        with torch.device("meta"):
            model = DecoderModel(config)
        model = model.to_empty(device="cpu")
        model.model.rotary_emb = RotaryEmbedding(config)
        model.lm_head.weight = model.model.embed_tokens.weight
        g = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                elif "embed_tokens" in name:
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p.shape[1] ** 0.5))
        model = model.to(dev).eval().requires_grad_(False)
    _MODELS[key] = model
    return model


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = _rng(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(n)] for n in lengths]


# ============================================================================== ex01: the naive loop


@_task
def ex01_greedy_next_token() -> Spec:
    """Check `greedy_next_token(logits [B, V] float32) -> [B] int64` (the argmax; first index on ties)."""
    from minirt.sampling import sample

    def reference(logits):
        B = logits.shape[0]
        dev = logits.device
        return sample(logits, torch.zeros(B, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                      torch.ones(B, device=dev), [None] * B)

    def case(name, make_logits, show):
        return Case(name, lambda: (make_logits(),), show)

    dev = device()
    cases = [
        case("one row", lambda: _randn(1, 10, seed=1), "logits [1, 10] random"),
        case("one row, one token", lambda: _randn(1, 1, seed=2), "logits [1, 1]"),
        case("batch of 4", lambda: _randn(4, 50, seed=3), "logits [4, 50] random"),
        case("tie: all equal", lambda: torch.zeros(3, 7, device=dev), "logits [3, 7] all zeros (answer: index 0)"),
        case("tie: two maxima", lambda: torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]], device=dev),
             "logits [[0, 2, 1, 2], [5, 5, -1, 0]] (first maximum wins)"),
        case("-inf entries", lambda: torch.tensor([[float("-inf"), -3.0, float("-inf")]], device=dev),
             "logits [[-inf, -3, -inf]]"),
        case("max at the last index", lambda: torch.arange(12, dtype=torch.float32, device=dev)[None].repeat(2, 1),
             "logits [2, 12] = arange(12)"),
        case("large batch", lambda: _randn(64, 96, seed=4, scale=3.0), "logits [64, 96] random"),
        case("vocab-sized row", lambda: _randn(2, 4096, seed=5), "logits [2, 4096] random"),
    ]
    return Spec(reference, cases)


@_task
def ex01_naive_generate() -> Spec:
    """Check `naive_generate(model, prompt_ids, max_new_tokens, eos_token_id=None) -> list[int]`."""
    from minirt.generate import naive_generate as reference

    model = tiny_model()

    def first_new(prompt, n, late):
        """(step, token) of a token the reference produces for the first time at that step: the first step
        (`late=False`) or the last such step among its first `n` tokens. As EOS it stops the reference exactly there
        (the tiny model repeats tokens, so "the token at step k" may have come up already at an earlier step)."""
        with _quiet():
            tokens = reference(model, list(prompt), n)
        fresh = [(k, t) for k, t in enumerate(tokens) if t not in tokens[:k]]
        return fresh[-1 if late else 0]

    def case(name, prompt, n, eos=None):
        show = f"prompt_ids={_short(prompt, 80)}, max_new_tokens={n}, eos_token_id={eos!r}"
        return Case(name, lambda: (list(prompt), n, eos), show)

    p = _prompts(11, [1, 2, 7, 20, 33])
    late_step, late_eos = first_new(p[4], 9, late=True)          # well before the length limit of 12
    mid_step, mid_eos = first_new(p[2], 4, late=True)
    _, first_eos = first_new(p[2], 8, late=False)
    cases = [
        case("one-token prompt", p[0], 5),
        case("max_new_tokens=1", p[2], 1),
        case("two-token prompt", p[1], 6),
        case("longer prompt", p[3], 10),
        case("33-token prompt", p[4], 12),
        case(f"EOS first produced at step {mid_step} (EOS is kept, then stop)", p[2], 8, eos=mid_eos),
        case(f"late EOS: first produced at step {late_step} of up to 12", p[4], 12, eos=late_eos),
        case("EOS produced at the first step", p[2], 8, eos=first_eos),
        case("EOS never produced", p[1], 6, eos=TINY_VOCAB + 5),
        case("empty prompt -> ValueError", [], 4),
        case("max_new_tokens=0 -> ValueError", p[2], 0),
    ]
    extra = lambda rng: [case(f"seeded case {k}", _prompts(rng.randrange(10**6), [rng.randint(1, 30)])[0],  # noqa: E731
                              rng.randint(1, 10)) for k in (1, 2)]
    return Spec(reference, cases, run=lambda f, inputs: f(model, *inputs), extra=extra)


# ============================================================================== ex02: the KV cache


@_task
def ex02_left_pad() -> Spec:
    """Check `left_pad(prompts, pad_id=0) -> (input_ids [B, T] int64, padding_mask [B, T] int64)`."""
    from minirt.generate import left_pad as reference

    def case(name, prompts, pad_id=None):
        args = (prompts,) if pad_id is None else (prompts, pad_id)
        show = f"prompts={_short(prompts, 120)}" + ("" if pad_id is None else f", pad_id={pad_id}")
        return Case(name, lambda: copy.deepcopy(args), show)

    rng = _rng(21)
    cases = [
        case("one prompt", [[5, 6, 7]]),
        case("one-token prompt", [[9]]),
        case("equal lengths (no padding)", [[1, 2], [3, 4], [5, 6]]),
        case("two lengths", [[1, 2, 3, 4], [7]]),
        case("shortest first", [[8], [1, 2, 3], [4, 5]]),
        case("pad_id=2", [[1, 2, 3], [4]], 2),
        case("prompt containing the pad id", [[0, 0, 3], [0]]),
        case("random batch", [[rng.randrange(1000) for _ in range(rng.randint(1, 12))] for _ in range(6)]),
        case("random batch, pad_id=99", [[rng.randrange(50) for _ in range(rng.randint(1, 30))] for _ in range(9)], 99),
    ]
    return Spec(reference, cases)


@_task
def ex02_kv_cache_generate() -> Spec:
    """Check `kv_cache_generate(model, prompts, max_new_tokens, eos_token_id=None) -> list[list[int]]`."""
    from minirt.generate import kv_cache_generate as reference

    model = tiny_model()

    def eos_at(prompts, row, step):
        with _quiet():
            return reference(model, copy.deepcopy(prompts), 8)[row][step]

    def case(name, prompts, n, eos=None, eos_at_row_step=None):
        if eos_at_row_step:
            eos = eos_at(prompts, *eos_at_row_step)
        show = f"prompts of lengths {[len(q) for q in prompts]}, max_new_tokens={n}, eos_token_id={eos!r}" + (
            f" (the token row {eos_at_row_step[0]} produces at step {eos_at_row_step[1]})" if eos_at_row_step
            else "")
        return Case(name, lambda: (copy.deepcopy(prompts), n, eos), show)

    def positions_case(name, prompts, n):
        show = (f"prompts of lengths {[len(q) for q in prompts]}, max_new_tokens={n}, eos_token_id=None; compared: "
                "the positions the model is given for each row's real tokens (prompt, then each generated token)")
        return Case(name, lambda: (copy.deepcopy(prompts), n, None, "record positions"), show)

    cases = [
        case("one prompt", _prompts(31, [6]), 6),
        case("one one-token prompt", _prompts(32, [1]), 4),
        case("max_new_tokens=1", _prompts(33, [3, 5]), 1),
        case("equal lengths", _prompts(34, [5, 5, 5]), 6),
        case("different lengths (left padding)", _prompts(35, [2, 9, 5]), 7),
        positions_case("per-row positions: rows with different pad counts each start at position 0",
                       _prompts(40, [3, 11, 7, 1]), 4),
        case("one-token and long prompt", _prompts(36, [1, 17]), 6),
        case("EOS ends one row early, others go on", _prompts(37, [4, 8]), 8, eos_at_row_step=(0, 2)),
        case("EOS at the first step of every row stops all", [[3, 4, 5]] * 2, 8, eos_at_row_step=(0, 0)),
        case("EOS never produced", _prompts(38, [3, 6]), 5, eos=TINY_VOCAB + 3),
        case("empty batch -> ValueError", [], 3),
        case("an empty prompt -> ValueError", [[1, 2], []], 3),
        case("max_new_tokens=0 -> ValueError", _prompts(39, [3]), 0),
    ]
    extra = lambda rng: [positions_case(f"seeded case {k}", _prompts(rng.randrange(10**6),  # noqa: E731
                                                                    [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]),
                                        rng.randint(1, 8)) for k in (1, 2)]
    return Spec(reference, cases, run=lambda f, inputs: _run_recording_positions(f, model, inputs), extra=extra)


def _run_recording_positions(f: Callable, model, inputs: tuple) -> Any:
    """`f(model, prompts, max_new_tokens, eos_token_id)`; with a 4th input, also the positions the model was given.

    RoPE makes attention depend on distances only, so a row's tokens all shifted by its pad count (column
    indices instead of per-row positions) generate the same tokens: the outcome alone cannot tell. Here a hook
    on the model's rotary embedding records the positions of every forward call, and each row's list holds
    the positions of its real tokens in the order fed: its prompt's (the last `len(prompt)` columns of the
    first call, the prefill), then one per later call (decode step). Returns {"positions": ..., "tokens": ...}.
    """
    prompts, n, eos, *record = inputs
    if not record:
        return f(model, prompts, n, eos)
    fed: list = []
    hook = model.model.rotary_emb.register_forward_pre_hook(lambda module, args: fed.append(args[0].tolist()))
    try:
        tokens = f(model, prompts, n, eos)
    finally:
        hook.remove()
    rows: list = [[] for _ in prompts]
    for call, given in enumerate(fed):
        if not (isinstance(given, list) and len(given) == len(prompts) and all(isinstance(r, list) for r in given)):
            return {"positions": f"forward call {call} was given positions of shape other than [B, T]: "
                                 f"{_short(given, 80)}", "tokens": tokens}
        for i, row in enumerate(given):
            rows[i] += row[len(row) - len(prompts[i]):] if call == 0 else row
    return {"positions": rows, "tokens": tokens}


# ============================================================================== ex03: paged blocks


@_task
def ex03_slot_mapping() -> Spec:
    """Check `slot_mapping(block_table, start, end, block_size) -> list[int]`."""
    from minirt.kv.paged_cache import slot_mapping as reference

    def case(name, table, start, end, B):
        return Case(name, lambda: (list(table), start, end, B),
                    f"block_table={_short(table, 80)}, start={start}, end={end}, block_size={B}")

    rng = _rng(41)
    perm = rng.sample(range(64), 16)
    cases = [
        case("empty range (start == end)", [3, 7], 2, 2, 4),
        case("one token", [5], 0, 1, 4),
        case("exactly one block", [6], 0, 4, 4),
        case("block boundary B-1", [6, 2], 0, 3, 4),
        case("block boundary B", [6, 2], 0, 4, 4),
        case("block boundary B+1", [6, 2], 0, 5, 4),
        case("decode step at the first slot of a block", [6, 2, 9], 8, 9, 4),
        case("decode step at the last slot of a block", [6, 2, 9], 7, 8, 4),
        case("start in the middle of a block", [1, 8, 3], 3, 10, 4),
        case("non-contiguous block ids", [11, 0, 7, 3], 0, 13, 4),
        case("block_size 1", [4, 2, 9, 1], 1, 4, 1),
        case("block_size 16, chunk across blocks", perm[:5], 10, 70, 16),
        case("random table, block_size 8", perm, 37, 121, 8),
        case("random table, block_size 3", perm, 0, 48, 3),
    ]
    return Spec(reference, cases)


@_task
def ex03_block_pool() -> Spec:
    """Check a `BlockPool(num_blocks)` class: `allocate() -> int`, `acquire(id)`, `release(id)`,
    `num_free_blocks`, and `blocks[i].ref_count`, against `minirt.kv.BlockPool` over op sequences."""
    from minirt.kv.block_pool import BlockPool as reference

    def drive(make_pool, inputs):
        num_blocks, ops = inputs
        pool = make_pool(num_blocks)
        trace = []
        for op in ops:
            name, arg = op[0], op[1] if len(op) > 1 else None
            try:
                if name == "allocate":
                    result = pool.allocate()
                elif name == "acquire":
                    result = pool.acquire(arg)
                else:
                    result = pool.release(arg)
            except NotImplementedError:
                raise
            except RuntimeError as e:
                result = f"raised {type(e).__name__}"
            step = f"{name}()" if arg is None else f"{name}({arg})"
            trace.append({"op": step, "returned": result, "num_free_blocks": pool.num_free_blocks,
                          "ref_counts": [b.ref_count for b in pool.blocks]})
        return trace

    def random_ops(seed, num_blocks, n):
        rng = _rng(seed)
        held: list[int] = []           # one entry per reference held, as the reference pool would have them
        freed: list[int] = []
        ref = reference(num_blocks)
        ops = []
        for _ in range(n):
            r = rng.random()
            if r < 0.45 or not (held or freed):
                ops.append(("allocate",))
                if ref.num_free_blocks:
                    b = ref.allocate()
                    held.append(b)
                    freed = [x for x in freed if x != b]
            elif r < 0.60 and held:
                b = rng.choice(held)
                ops.append(("acquire", b))
                ref.acquire(b)
                held.append(b)
            elif r < 0.70 and freed:
                b = rng.choice(freed)          # revive a freed block
                ops.append(("acquire", b))
                ref.acquire(b)
                held.append(b)
                freed.remove(b)
            elif held:
                b = held.pop(rng.randrange(len(held)))
                ops.append(("release", b))
                ref.release(b)
                if ref.blocks[b].ref_count == 0:
                    freed.append(b)
            else:
                ops.append(("allocate",))
        return ops

    def case(name, num_blocks, ops):
        show = f"BlockPool({num_blocks}), then " + _short(["".join(f"{o[0]}({o[1] if len(o) > 1 else ''})")
                                                           for o in ops], 200)
        return Case(name, lambda: (num_blocks, list(ops)), show)

    A, Q, R = ("allocate",), "acquire", "release"
    cases = [
        case("one-block pool", 1, [A, (R, 0), A]),
        case("allocate hands out blocks in order", 4, [A, A, A]),
        case("allocate on an empty pool raises RuntimeError", 2, [A, A, A]),
        case("freed blocks go to the end of the free list", 3, [A, A, (R, 0), A, A]),
        case("least recently freed is reused first", 4, [A, A, A, A, (R, 2), (R, 0), (R, 3), A, A, A]),
        case("shared block: freed only at ref_count 0", 3, [A, (Q, 0), (R, 0), A, (R, 0), A]),
        case("acquire revives a freed block", 3, [A, A, (R, 1), (Q, 1), A, A]),
        case("release of a free block raises RuntimeError", 2, [A, (R, 0), (R, 0)]),
        case("release of a never-allocated block raises RuntimeError", 3, [(R, 2)]),
        case("num_blocks=0 raises ValueError", 0, []),
    ] + [case(f"random ops #{k}", nb, random_ops(500 + k, nb, 40)) for k, nb in enumerate([2, 5, 8, 16])]
    extra = lambda rng: [case(f"seeded case {k}", nb, random_ops(rng.randrange(10**6), nb, 40))  # noqa: E731
                         for k, nb in enumerate(rng.sample(range(1, 17), 3), 1)]
    return Spec(reference, cases, run=drive, extra=extra)


def _paged_inputs(seed: int, seqs: list[tuple[int, int]], B: int, H: int, Hkv: int, D: int,
                  dtype: torch.dtype, extra_blocks: int = 3):
    """Random paged K/V and packed queries for sequences `(context_len, query_len)` (query = the last tokens)."""
    from minirt.attention import PagedAttentionMetadata

    dev = device()
    rng = _rng(seed)
    need = [-(c // -B) for c, _ in seqs]
    num_blocks = sum(need) + extra_blocks
    ids = rng.sample(range(num_blocks), sum(need))          # scattered, non-contiguous physical blocks
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    width = max(need)
    slots, qsl = [], [0]
    for (c, q), t in zip(seqs, tables):
        slots += [t[p // B] * B + p % B for p in range(c - q, c)]
        qsl.append(qsl[-1] + q)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    meta = PagedAttentionMetadata(
        slot_mapping=as_long(slots), query_start_loc=as_long(qsl), context_lens=as_long([c for c, _ in seqs]),
        block_tables=as_long([t + [0] * (width - len(t)) for t in tables]),
        max_query_len=max(q for _, q in seqs), max_context_len=max(c for c, _ in seqs))
    q = _randn(qsl[-1], H, D, seed=seed + 1, dtype=dtype)
    k_cache = _randn(num_blocks, B, Hkv, D, seed=seed + 2, dtype=dtype)
    v_cache = _randn(num_blocks, B, Hkv, D, seed=seed + 3, dtype=dtype)
    return q, k_cache, v_cache, meta


@_task
def ex03_paged_attention() -> Spec:
    """Check `paged_attention_reference(q, k_cache, v_cache, meta) -> [num_tokens, H, D]`."""
    from minirt.attention import paged_attention_reference as reference

    def case(name, seqs, B=4, H=4, Hkv=2, D=16, dtype=torch.float32, seed=0):
        show = (f"(context_len, query_len) per sequence = {seqs}, block_size={B}, heads={H}, kv_heads={Hkv}, "
                f"head_dim={D}, dtype={dtype}")
        return Case(name, lambda: _paged_inputs(seed, seqs, B, H, Hkv, D, dtype), show)

    cases = [
        case("one prefill in one block", [(3, 3)], seed=1),
        case("one token", [(1, 1)], seed=2),
        case("prefill of exactly one block", [(4, 4)], seed=3),
        case("prefill of B-1 tokens", [(3, 3)], B=4, seed=4),
        case("prefill of B+1 tokens", [(5, 5)], seed=5),
        case("decode at block boundary B+1", [(5, 1)], seed=6),
        case("decode with a long context", [(37, 1)], seed=7),
        case("prefill chunk after a cached prefix", [(13, 6)], seed=8),
        case("mixed batch: decodes and prefill chunks", [(9, 1), (4, 4), (17, 5), (8, 1)], seed=9),
        case("multi-head attention (kv_heads = heads)", [(6, 2), (11, 11)], H=2, Hkv=2, seed=10),
        case("one kv head for 8 query heads", [(10, 3), (2, 2)], H=8, Hkv=1, D=8, seed=11),
        case("block_size 16", [(40, 40), (33, 1), (16, 16)], B=16, seed=12),
        case("block_size 1", [(5, 2), (3, 3)], B=1, seed=13),
        case("bfloat16", [(9, 1), (12, 12), (7, 3)], dtype=torch.bfloat16, seed=14),
        case("float16", [(20, 4), (5, 1)], dtype=torch.float16, seed=15),
    ]
    def extra(rng):
        out = []
        for k in (1, 2, 3):
            seqs = [(c, rng.randint(1, c)) for c in (rng.randint(1, 40) for _ in range(rng.randint(1, 4)))]
            Hkv = rng.choice([1, 2, 4])
            out.append(case(f"seeded case {k}", seqs, B=rng.choice([1, 4, 16]), H=Hkv * rng.choice([1, 2]), Hkv=Hkv,
                            D=rng.choice([8, 16]), seed=rng.randrange(10**6)))
        return out
    return Spec(reference, cases, extra=extra)


# ============================================================================== ex04: the prefix cache


@_task
def ex04_block_hashes() -> Spec:
    """Check `block_hashes(token_ids, block_size, num_blocks=None) -> list[int]`."""
    from minirt.kv.prefix_cache import block_hashes as reference

    def case(name, tokens, B, n="default"):
        args = (tokens, B) if n == "default" else (tokens, B, n)
        show = f"token_ids={_short(tokens, 100)}, block_size={B}" + ("" if n == "default" else f", num_blocks={n}")
        return Case(name, lambda: copy.deepcopy(args), show)

    rng = _rng(51)
    t = [rng.randrange(1000) for _ in range(40)]
    cases = [
        case("no tokens", [], 4),
        case("fewer tokens than a block (B-1)", t[:3], 4),
        case("exactly one block (B)", t[:4], 4),
        case("one block and one token (B+1)", t[:5], 4),
        case("2B-1 tokens", t[:7], 4),
        case("two blocks", t[:8], 4),
        case("equal blocks at different positions hash differently (chain)", [1, 2, 1, 2, 1, 2], 2),
        case("num_blocks=1 of three full blocks", t[:12], 4, 1),
        case("num_blocks=0", t[:12], 4, 0),
        case("num_blocks=None means all full blocks", t[:12], 4, None),
        case("block_size 1", t[:6], 1),
        case("block_size 16, 40 tokens", t, 16),
        case("tokens as a tuple", tuple(t[:10]), 3),
    ]
    return Spec(reference, cases)


def _cache_state(cache) -> dict:
    pool = cache.pool
    return {"ref_counts": [b.ref_count for b in pool.blocks], "free_list": list(pool.free),
            "cached": sorted(pool.cached.values())}


@_task
def ex04_match() -> Spec:
    """Check `match(cache, prompt_ids) -> list[int]` (the longest cached prefix; `PrefixCache.match`)."""
    from minirt.kv.block_pool import BlockPool
    from minirt.kv.prefix_cache import PrefixCache

    B = 4

    def build(num_blocks, sequences, release=(), forge=None, evict=0, enabled=True):
        """A pool in which `sequences` were computed and registered; `release` lists sequences whose
        blocks were freed since (cached but free); `evict` allocates that many blocks afterwards
        (evicting the least recently freed); `forge=(seq, block)` fakes a hash collision there."""
        pool = BlockPool(num_blocks)
        cache = PrefixCache(pool, B, enabled)
        tables = []
        for tokens in sequences:
            table = [pool.allocate() for _ in range(-(len(tokens) // -B))]
            cache.register(tokens, table, len(tokens), 0)
            tables.append(table)
        for s in release:
            pool.release_all(tables[s])
        for _ in range(evict):
            pool.allocate()
        if forge is not None:
            s, i = forge
            blk = pool.blocks[tables[s][i]]
            blk.token_ids = tuple(x + 1 for x in blk.token_ids)   # same hash, different tokens
        return cache

    def drive(f, inputs):
        kw, prompt = inputs
        cache = build(**kw)
        result = f(cache, prompt)
        return {"returned": list(result) if isinstance(result, (list, tuple)) else result,
                "state after the call": _cache_state(cache)}

    rng = _rng(61)
    a = [rng.randrange(500) for _ in range(20)]
    b = a[:8] + [rng.randrange(500) for _ in range(9)]

    def case(name, prompt, show, **kw):
        return Case(name, lambda: (copy.deepcopy(kw), list(prompt)), f"{show}; prompt_ids={_short(prompt, 90)}")

    cases = [
        case("empty cache", a, "nothing cached", num_blocks=8, sequences=[]),
        case("prompt shorter than a block", a[:3], "A (20 tokens) cached", num_blocks=8, sequences=[a]),
        case("prompt of exactly B tokens: the last token is recomputed", a[:4], "A cached",
             num_blocks=8, sequences=[a]),
        case("prompt of B+1 tokens", a[:5], "A cached", num_blocks=8, sequences=[a]),
        case("prompt of exactly 2B tokens: one block", a[:8], "A cached", num_blocks=8, sequences=[a]),
        case("whole prompt cached: all but the last token's block", a, "A cached", num_blocks=8, sequences=[a]),
        case("shared prefix of two blocks", b, "A cached, prompt B shares its first 8 tokens",
             num_blocks=12, sequences=[a]),
        case("first block differs: no hit", [a[0] + 1] + a[1:], "A cached", num_blocks=8, sequences=[a]),
        case("freed blocks still hit (no reference taken)", a, "A cached, then freed", num_blocks=8,
             sequences=[a], release=[0]),
        case("evicted block ends the match", a, "A cached, freed, then 7 blocks allocated (evicting)",
             num_blocks=8, sequences=[a], release=[0], evict=7),
        case("hash collision: tokens differ, stop there", a, "A cached, block 1 forged (same hash, other tokens)",
             num_blocks=8, sequences=[a], forge=(0, 1)),
        case("prefix caching disabled", a, "A cached, cache.enabled = False", num_blocks=8, sequences=[a],
             enabled=False),
        case("two cached sequences", b + [1, 2, 3], "A and B cached", num_blocks=16, sequences=[a, b]),
    ]

    def extra(rng):
        out = []
        for k in (1, 2, 3):
            base = [rng.randrange(500) for _ in range(rng.randint(1, 24))]
            seqs = [base[:rng.randint(1, len(base))] + [rng.randrange(500) for _ in range(rng.randint(0, 8))]
                    for _ in range(rng.randint(1, 3))]
            slack = rng.randint(0, 4)
            release = sorted(rng.sample(range(len(seqs)), rng.randint(0, len(seqs))))
            freed = slack + sum(-(len(seqs[i]) // -B) for i in release)
            evict = rng.randint(0, freed)
            prompt = base[:rng.randint(0, len(base))] + [rng.randrange(500) for _ in range(rng.randint(0, 6))]
            out.append(case(f"seeded case {k}", prompt or [rng.randrange(500)],
                            f"cached: {len(seqs)} sequences {_short(seqs, 160)}, sequences {release} freed, then "
                            f"{evict} blocks allocated", num_blocks=sum(-(len(q) // -B) for q in seqs) + slack,
                            sequences=seqs, release=release, evict=evict))
        return out
    return Spec(lambda cache, prompt: cache.match(prompt), cases, run=drive, extra=extra)


# ============================================================================== ex05: the engine


class ToyTokenizer:
    """A fixed vocabulary of short strings; id 0 is the special EOS token. `decode` joins the pieces."""

    VOCAB = ["<eos>", "a", "b", "c", " ", "\n", "ab", "ba", "STOP", "ST", "OP", "!", ".", "ROMEO", ":", "the", "end"]
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def _new_request(rid, prompt, max_new_tokens=8, tokenizer=None, **params):
    from minirt.request import Request
    from minirt.sampling import SamplingParams

    eos = frozenset({ToyTokenizer.eos_token_id}) if tokenizer is not None else frozenset()
    return Request(rid, None, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, **params), eos, tokenizer)


def _request_state(r) -> dict:
    return {"block_table": list(r.block_table), "num_computed_tokens": r.num_computed_tokens,
            "num_cached_tokens": r.num_cached_tokens, "num_registered_blocks": r.num_registered_blocks,
            "num_prefill_tokens": getattr(r, "num_prefill_tokens", None)}


@_task
def ex05_try_allocate() -> Spec:
    """Check `try_allocate(scheduler, request) -> bool` (`Scheduler.try_allocate`) over admission scenarios."""
    from minirt.config import EngineConfig
    from minirt.kv.block_pool import BlockPool
    from minirt.kv.prefix_cache import PrefixCache
    from minirt.scheduler import Scheduler

    def drive(f, inputs):
        block_size, num_blocks, caching, ops = inputs
        pool = BlockPool(num_blocks)
        cache = PrefixCache(pool, block_size, caching)
        sched = Scheduler(EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                       enable_prefix_caching=caching), pool, cache)
        reqs, trace = {}, []
        for op in ops:
            kind, rid = op[0], op[1]
            if kind == "admit":                     # the function under test
                r = reqs[rid] = _new_request(rid, op[2], op[3])
                try:
                    ok = f(sched, r)
                except NotImplementedError:
                    raise
                except Exception as e:  # noqa: BLE001 - recorded at the step where it happened
                    ok = f"raised {_describe_exc(e)}"
                if ok is True:
                    sched.prefilling_requests.append(r)   # admitted: the engine is no longer empty
                trace.append({"op": f"admit {rid}", "returned": ok, "request": _request_state(r),
                              "pool": _cache_state(cache), "prefix_cache_hits": cache.hits,
                              "prefix_cache_queries": cache.queries})
                if isinstance(ok, str):
                    break
            elif kind == "prefill":                 # compute its prompt: full blocks are registered
                r = reqs[rid]
                if r.block_table:
                    r.num_registered_blocks = cache.register(r.token_ids, r.block_table, r.num_prompt_tokens,
                                                             r.num_registered_blocks)
                    r.num_computed_tokens = r.num_prompt_tokens
            elif kind == "finish":                  # free its blocks (cached blocks stay in the cache)
                r = reqs[rid]
                if r in sched.prefilling_requests:
                    sched.prefilling_requests.remove(r)
                pool.release_all(r.block_table)
        return trace

    rng = _rng(71)
    tok = [rng.randrange(300) for _ in range(64)]
    other = [rng.randrange(300, 600) for _ in range(64)]

    def case(name, ops, B=4, num_blocks=8, caching=True):
        def fmt(op):
            return f"{op[0]} {op[1]}" + (f" (prompt {len(op[2])} tokens, max_new_tokens {op[3]})" if op[0] == "admit"
                                          else "")
        show = f"block_size={B}, num_kv_blocks={num_blocks}, prefix caching {'on' if caching else 'off'}; ops: " + \
            "; ".join(fmt(o) for o in ops)
        return Case(name, lambda: (B, num_blocks, caching, copy.deepcopy(ops)), show)

    cases = [
        case("fits in the empty pool", [("admit", "r0", tok[:10], 6)]),
        case("prompt of exactly one block", [("admit", "r0", tok[:4], 4)]),
        case("prompt of B+1 tokens", [("admit", "r0", tok[:5], 1)]),
        case("larger than the free blocks: refused, nothing changes",
             [("admit", "r0", tok[:16], 4), ("admit", "r1", other[:17], 4)], num_blocks=8),
        case("pool filled up one request at a time",
             [("admit", f"r{i}", other[i * 8:i * 8 + 7], 2) for i in range(6)], num_blocks=8),
        case("prefix hit on blocks another request holds",
             [("admit", "r0", tok[:12], 2), ("prefill", "r0"), ("admit", "r1", tok[:10] + other[:3], 2)]),
        case("prefix hit on freed (cached) blocks revives them",
             [("admit", "r0", tok[:12], 2), ("prefill", "r0"), ("finish", "r0"), ("admit", "r1", tok[:14], 2)]),
        case("hits in the free list do not count as free blocks",
             [("admit", "r0", tok[:8], 1), ("prefill", "r0"), ("finish", "r0"),
              ("admit", "r1", tok[:8] + other[:25], 1)], num_blocks=8),
        case("whole prompt cached: the last block is computed again",
             [("admit", "r0", tok[:8], 1), ("prefill", "r0"), ("finish", "r0"), ("admit", "r1", tok[:8], 1)]),
        case("prefix caching disabled: no hits",
             [("admit", "r0", tok[:12], 2), ("prefill", "r0"), ("finish", "r0"), ("admit", "r1", tok[:12], 2)],
             caching=False),
        case("watermark: with requests admitted, 1% of the pool stays free",
             [("admit", "r0", tok[:40], 8), ("admit", "r1", other[:44], 8), ("admit", "r2", other[44:60], 8)],
             B=1, num_blocks=100),
        case("watermark does not apply to an empty engine",
             [("admit", "r0", other[:50] + tok[:50], 8)], B=1, num_blocks=100),
    ]

    def extra(rng):
        out = []
        for k in (1, 2, 3):
            B = rng.choice([1, 2, 4, 8])
            ops, running = [], []
            for i in range(rng.randint(1, 6)):
                src = rng.choice([tok, other])
                start = 0 if src is tok else rng.randrange(8)
                ops.append(("admit", f"r{i}", src[start:start + rng.randint(1, 40)], rng.randint(1, 8)))
                if rng.random() < 0.7:
                    ops.append(("prefill", f"r{i}"))
                running.append(f"r{i}")
                if rng.random() < 0.5:
                    ops.append(("finish", running.pop(rng.randrange(len(running)))))
            out.append(case(f"seeded case {k}", ops, B=B, num_blocks=rng.randint(4, 40), caching=rng.random() < 0.8))
        return out
    return Spec(lambda sched, r: sched.try_allocate(r), cases, run=drive, extra=extra)


@_task
def ex05_append_token() -> Spec:
    """Check `append_token(request, token_id, now)` (`Request.append_token`): EOS, stop ids, stop strings, length."""
    V = {s: i for i, s in enumerate(ToyTokenizer.VOCAB)}
    tokenizer = ToyTokenizer()

    def drive(f, inputs):
        params, tokens = inputs
        r = _new_request("r", [V["ROMEO"], V[":"]], tokenizer=tokenizer, **params)
        trace = []
        for t, token in enumerate(tokens):
            f(r, token, 100.0 + t)
            step = {"token_ids": list(r.token_ids), "finish_reason": r.finish_reason,
                    "first_token_time": r.first_token_time, "last_token_time": r.last_token_time,
                    "token_times": list(getattr(r, "token_times", []))}
            if r.params.stop:
                step["text"] = r.text
            trace.append(step)
            if r.finish_reason is not None:
                break
        return trace

    def case(name, words, **params):
        tokens = [V[w] for w in words]
        show = f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in params.items())}); tokens appended: {words}"
        return Case(name, lambda: (dict(params), list(tokens)), show)

    cases = [
        case("length limit max_new_tokens=1", ["a", "b", "c"], max_new_tokens=1),
        case("length limit 4", ["a", "b", "c", "a", "b", "c"], max_new_tokens=4),
        case("EOS ends with 'stop' (EOS kept in token_ids)", ["a", "<eos>", "b"], max_new_tokens=8),
        case("EOS on the last allowed token: 'stop' wins", ["a", "b", "<eos>"], max_new_tokens=3),
        case("ignore_eos: EOS is an ordinary token", ["a", "<eos>", "b", "c"], max_new_tokens=4, ignore_eos=True),
        case("stop_token_ids", ["a", "!", "b"], max_new_tokens=8, stop_token_ids=(V["!"],)),
        case("stop string in one token", ["a", "b", "STOP", "c"], max_new_tokens=8, stop=("STOP",)),
        case("stop string across two tokens", ["a", "ST", "OP", "c"], max_new_tokens=8, stop=("STOP",)),
        case("stop string across token pieces", ["c", "a", "ba", "c"], max_new_tokens=8, stop=("aba",)),
        case("stop string at the very start", ["the", " ", "end"], max_new_tokens=8, stop=("th",)),
        case("earliest of two stop strings wins", ["a", "ab", "c", "end"], max_new_tokens=8, stop=("c", "ab")),
        case("two stop strings complete at once: the earlier one cuts", ["a", "STOP", "b"], max_new_tokens=8,
             stop=("OP", "ST")),
        case("stop string on the last allowed token: 'stop' wins", ["a", "b", "."], max_new_tokens=3, stop=("b.",)),
        case("stop string never completed: 'length'", ["ST", "a", "OP", "b"],
             max_new_tokens=4, stop=("STOP",)),
        case("stop string and EOS", ["a", "b", "<eos>"], max_new_tokens=8, stop=("xyz",)),
        case("newline as a stop string", ["the", "\n", "end"], max_new_tokens=8, stop=("\n",)),
        case("a stop id completes a stop string: the text is still cut", ["the", " ", "a", "!", "b"], max_new_tokens=8,
             stop=("a!",), stop_token_ids=(V["!"],)),
        case("the last allowed token completes a stop string", ["ST", "a", "ST", "OP", "b"], max_new_tokens=4,
             stop=("STOP",)),
    ]

    def extra(rng):
        out = []
        for k in range(1, 5):
            words = [rng.choice(ToyTokenizer.VOCAB) for _ in range(rng.randint(1, 10))]
            params = {"max_new_tokens": rng.randint(1, 10)}
            if rng.random() < 0.3:
                params["ignore_eos"] = True
            if rng.random() < 0.3:
                params["stop_token_ids"] = tuple(rng.sample(range(1, len(ToyTokenizer.VOCAB)), rng.randint(1, 2)))
            if rng.random() < 0.6:
                params["stop"] = tuple(rng.sample(["STOP", "ab", "c", "b.", "\n", "the end", "a!", "ba", "OPa"],
                                                  rng.randint(1, 2)))
            out.append(case(f"seeded case {k}", words, **params))
        return out
    return Spec(lambda r, token, now: r.append_token(token, now), cases, run=drive, extra=extra)


# ============================================================================== ex06: chunked prefill


@_task
def ex06_split_budget() -> Spec:
    """Check `split_budget(budget, num_decodes, remaining_prompts, max_prefill_chunk) -> (decodes, chunks)`."""
    from minirt.scheduler import split_budget as reference

    def case(name, budget, decodes, remaining, cap):
        return Case(name, lambda: (budget, decodes, list(remaining), cap),
                    f"budget={budget}, num_decodes={decodes}, remaining_prompts={_short(remaining, 100)}, "
                    f"max_prefill_chunk={cap}")

    rng = _rng(81)
    cases = [
        case("no work", 8192, 0, [], 1024),
        case("only decodes", 8192, 5, [], 1024),
        case("more decodes than budget", 4, 7, [10], 1024),
        case("decodes use the budget exactly", 5, 5, [3, 3], 1024),
        case("one short prompt", 8192, 0, [17], 1024),
        case("prompt longer than the chunk cap", 8192, 0, [3000], 1024),
        case("prompt of exactly the chunk cap", 8192, 2, [1024], 1024),
        case("budget runs out in the second prompt", 100, 10, [50, 70, 20], 64),
        case("prompts after the budget get 0", 16, 0, [8, 8, 8, 8], 1024),
        case("a finished prompt (0 remaining)", 32, 1, [0, 12], 8),
        case("budget of one token", 1, 0, [5, 5], 4),
        case("random", 8192, 37, [rng.randint(1, 5000) for _ in range(12)], 1024),
        case("random, small cap", 300, 12, [rng.randint(1, 200) for _ in range(9)], 48),
    ]
    return Spec(reference, cases)


def _simulate(schedule_fn, cfg_kw: dict, arrivals: list[tuple[int, str, list[int], int]], max_steps: int = 300):
    """Run the engine's step loop without a model: `schedule_fn(scheduler)` decides each step, then the
    scheduler's bookkeeping runs as in `Engine.step`. Sampled tokens are made up deterministically; every
    request stops at its `max_new_tokens`. Returns one record per step."""
    from minirt.config import EngineConfig
    from minirt.kv.block_pool import BlockPool
    from minirt.kv.prefix_cache import PrefixCache
    from minirt.scheduler import Scheduler

    cfg = EngineConfig(**cfg_kw)
    pool = BlockPool(cfg.num_kv_blocks)
    sched = Scheduler(cfg, pool, PrefixCache(pool, cfg.block_size, cfg.enable_prefix_caching))
    pending = sorted(arrivals, key=lambda a: a[0])
    ids = lambda rs: [r.request_id for r in rs]  # noqa: E731
    trace = []
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_new = pending.pop(0)
            sched.add(_new_request(rid, prompt, max_new))
        if not sched.has_work():
            if not pending:
                break
            continue
        try:
            batch = schedule_fn(sched)
            items = list(getattr(batch, "items", batch) or [])
            scheduled = [(r.request_id, n) for r, n in items]
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - recorded at the step where it happened
            batch, items, scheduled = None, [], f"raised {_describe_exc(e)}"
        trace.append({"step": step, "batch": scheduled,
                      "num_decodes": getattr(batch, "num_decodes", None),
                      "waiting": ids(sched.waiting_queue), "prefilling": ids(sched.prefilling_requests),
                      "running": ids(sched.running_requests),
                      "block_tables": {r.request_id: list(r.block_table)
                                       for r in [*sched.prefilling_requests, *sched.running_requests]}})
        if isinstance(scheduled, str):
            break
        try:
            for r, n in items:
                sched.update_after_step(r, n)
            for r, n in items:
                if r.num_computed_tokens == len(r.token_ids):
                    r.append_token((len(r.token_ids) * 7 + r.num_prompt_tokens) % 50 + 1, float(step))
                    if r.finish_reason is not None:
                        sched.remove(r)
                        r.finish(r.finish_reason)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a wrong batch breaks the bookkeeping: that is the finding
            trace.append({"step": step, "error after this batch": _describe_exc(e)})
            break
    return trace


@_task
def ex06_schedule() -> Spec:
    """Check `schedule(scheduler) -> ScheduledBatch` (`Scheduler.schedule`) by simulating whole workloads."""

    def drive(f, inputs):
        cfg_kw, arrivals = inputs
        return _simulate(f, cfg_kw, arrivals)

    rng = _rng(91)

    def prompts(n, lo, hi):
        return [[rng.randrange(1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]

    def case(name, arrivals, **cfg):
        cfg_kw = dict(dict(block_size=4, num_kv_blocks=64, max_num_seqs=256, max_num_batched_tokens=8192,
                           max_prefill_chunk=1024), **cfg)
        show = (", ".join(f"{k}={v}" for k, v in cfg_kw.items()) + "; arrivals (step, id, prompt tokens, "
                "max_new_tokens): " + _short([(s, rid, len(p), m) for s, rid, p, m in arrivals], 200))
        return Case(name, lambda: (cfg_kw, copy.deepcopy(arrivals)), show)

    P = prompts(12, 3, 30)
    shared = [rng.randrange(1000) for _ in range(16)]
    cases = [
        case("one short request", [(0, "r0", P[0], 3)]),
        case("three at once, large budget", [(0, f"r{i}", P[i], 4) for i in range(3)]),
        case("decodes go first, then prefill chunks", [(0, "r0", P[1], 6), (2, "r1", P[2], 3), (3, "r2", P[3], 3)],
             max_num_batched_tokens=12),
        case("chunk cap smaller than the prompt", [(0, "r0", P[4] + P[5], 3), (1, "r1", P[6], 2)],
             max_prefill_chunk=8),
        case("budget smaller than the prompts", [(0, f"r{i}", P[i], 3) for i in range(5)],
             max_num_batched_tokens=10, max_prefill_chunk=6),
        case("budget of one token", [(0, "r0", P[7][:5], 3), (0, "r1", P[8][:4], 2)], max_num_batched_tokens=1),
        case("max_num_seqs=1", [(0, f"r{i}", P[i], 2) for i in range(4)], max_num_seqs=1),
        case("head-of-line: a big request waits and nobody overtakes it",
             [(0, "r0", P[9][:20], 6), (1, "big", [5] * 30, 6), (1, "small", [6] * 3, 2)], num_kv_blocks=12),
        case("tight pool: decodes take new blocks, preemption by recompute",
             [(0, f"r{i}", P[i][:10], 10) for i in range(4)], num_kv_blocks=12, max_prefill_chunk=8),
        case("prefix cache hits on a shared prefix",
             [(0, "r0", shared + [1, 2, 3], 3), (4, "r1", shared + [4, 5], 3), (4, "r2", shared[:9], 2)]),
        case("staggered arrivals, mixed lengths",
             [(2 * i, f"r{i}", p, 1 + i % 4) for i, p in enumerate(prompts(8, 1, 40))],
             max_num_batched_tokens=24, max_prefill_chunk=16, num_kv_blocks=40),
    ]
    def extra(rng):
        def arrivals():
            return [(rng.randint(0, 6), f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 30))],
                     rng.randint(1, 5)) for i in range(rng.randint(1, 6))]
        return [case(f"seeded case {k}", arrivals(), max_num_batched_tokens=rng.randint(4, 40),
                     max_prefill_chunk=rng.randint(2, 16), num_kv_blocks=rng.randint(24, 64)) for k in (1, 2)]
    return Spec(lambda sched: sched.schedule(), cases, run=drive, extra=extra)


# ============================================================================== ex07: making it fast


@_task
def ex07_capture_sizes() -> Spec:
    """Check `capture_sizes(max_num_seqs) -> list[int]`."""
    from minirt.fast.cuda_graphs import capture_sizes as reference

    cases = [Case(f"max_num_seqs={n}", lambda n=n: (n,), f"max_num_seqs={n}")
             for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 100, 256, 512)]
    return Spec(reference, cases)


def _split_partials(seed: int, lead: tuple[int, ...], num_keys: int, num_splits: int, head_dim: int,
                    scale: float = 1.0):
    """(acc, m, l) of `num_splits` contiguous key shares of random attention inputs (empty shares allowed)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(*lead, num_keys, generator=gen) * scale
    values = torch.randn(*lead, num_keys, head_dim, generator=gen)
    share = -(-num_keys // num_splits)
    acc = torch.zeros(*lead, num_splits, head_dim)
    m = torch.full((*lead, num_splits), float("-inf"))
    l = torch.zeros(*lead, num_splits)
    for j in range(num_splits):
        lo, hi = j * share, min(num_keys, (j + 1) * share)
        if lo < hi:
            s = scores[..., lo:hi]
            m[..., j] = s.amax(-1)
            p = torch.exp(s - m[..., j, None])
            l[..., j] = p.sum(-1)
            acc[..., j, :] = (p[..., None] * values[..., lo:hi, :]).sum(-2)
    return acc, m, l


@_task
def ex07_combine_splits() -> Spec:
    """Check `combine_splits(acc, m, l) -> [..., head_dim]`."""
    from minirt.fast.attention import combine_splits as reference

    def case(name, lead, num_keys, num_splits, head_dim=8, scale=1.0, seed=0):
        show = (f"leading dims {list(lead)}, {num_keys} keys in {num_splits} splits, head_dim={head_dim}, "
                f"scores ~ N(0, {scale}^2)")
        return Case(name, lambda: _split_partials(seed, lead, num_keys, num_splits, head_dim, scale), show)

    cases = [
        case("one split (nothing to combine)", (2,), 7, 1, seed=1),
        case("two equal splits", (2,), 8, 2, seed=2),
        case("uneven last split", (3,), 10, 3, seed=3),
        case("more splits than keys need: empty splits", (2,), 5, 8, seed=4),
        case("a single key", (1,), 1, 4, seed=5),
        case("tokens x heads", (3, 4), 33, 4, head_dim=16, seed=6),
        case("large scores (exp would overflow without the max)", (2, 2), 20, 4, scale=60.0, seed=7),
        case("no leading dims", (), 12, 3, seed=8),
    ]
    extra = lambda rng: [case(f"seeded case {k}", tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2))),  # noqa: E731
                              rng.randint(1, 40), rng.randint(1, 6), seed=rng.randrange(10**6)) for k in (1, 2)]
    return Spec(reference, cases, extra=extra)


# ============================================================================== ex08: serving


def _delta(text: str, token_ids: list[int], finished: bool = False, reason: str | None = None,
           prompt_len: int = 3, num_generated: int = 5):
    from minirt.request import RequestOutput, StreamDelta

    output = None
    if finished:
        output = RequestOutput("cmpl-1", None, list(range(prompt_len)), list(range(num_generated)), "(all text)", reason)
    return StreamDelta("cmpl-1", list(token_ids), text, finished, reason, output)


@_task
def ex08_delta_chunks() -> Spec:
    """Check `delta_chunks(delta, head, chat, first, include_usage) -> list[dict]`."""
    from minirt.serve.protocol import delta_chunks as reference

    head = {"id": "cmpl-1", "created": 1700000000, "model": "default_model"}

    def case(name, delta, chat, first, usage):
        show = (f"delta(text={delta.text!r}, token_ids={delta.token_ids}, finished={delta.finished}, "
                f"finish_reason={delta.finish_reason!r}), chat={chat}, first={first}, include_usage={usage}")
        return Case(name, lambda: (delta, dict(head), chat, first, usage), show)

    cases = [
        case("completion: a piece of text", _delta(" the", [7]), False, True, False),
        case("completion: a later piece", _delta(" king", [9, 4]), False, False, False),
        case("completion: no text yet (held back)", _delta("", [11]), False, False, False),
        case("completion: the last delta, with text", _delta(" end", [3], True, "length"), False, False, False),
        case("completion: the last delta, no text", _delta("", [], True, "stop"), False, False, False),
        case("completion: usage on", _delta(" the", [7]), False, True, True),
        case("completion: the last delta, usage on", _delta(" end", [3], True, "length", 4, 9), False, False, True),
        case("chat: the first delta carries the role", _delta("Who", [5]), True, True, False),
        case("chat: the first delta without text still announces the role", _delta("", [5]), True, True, False),
        case("chat: a later delta", _delta(" goes", [6]), True, False, False),
        case("chat: a later delta without text", _delta("", [6]), True, False, False),
        case("chat: the last delta, no text", _delta("", [], True, "stop"), True, False, False),
        case("chat: the last delta, with text", _delta(" there", [8], True, "length"), True, False, False),
        case("chat: first and last at once, usage on", _delta("Hi", [2], True, "stop", 6, 1), True, True, True),
        case("chat: usage on, a middle delta", _delta(" goes", [6]), True, False, True),
    ]

    def extra(rng):
        out = []
        for k in range(1, 5):
            finished = rng.random() < 0.5
            text = rng.choice(["", " the", "Hi", " king\n", "é!", " a b"])
            delta = _delta(text, [rng.randrange(1000) for _ in range(rng.randint(0 if finished else 1, 3))], finished,
                           rng.choice(["stop", "length"]) if finished else None, rng.randint(1, 50),
                           rng.randint(1, 50))
            out.append(case(f"seeded case {k}", delta, rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5))
        return out
    return Spec(reference, cases, extra=extra)


@_task
def ex08_admission() -> Spec:
    """Check `admission(num_waiting, max_waiting, draining) -> None | (status, reason)` (the status only)."""
    from minirt.serve.app import admission as reference

    cases = [Case(f"num_waiting={w}, max_waiting={m}, draining={d}", lambda w=w, m=m, d=d: (w, m, d),
                  f"num_waiting={w}, max_waiting={m}, draining={d}")
             for w, m, d in [(0, 1, False), (0, 256, False), (1, 1, False), (255, 256, False), (256, 256, False),
                             (300, 256, False), (0, 1, True), (5, 1, True), (3, 4, False)]]

    def run(f, inputs):
        out = f(*inputs)
        return out if out is None else out[0]        # the status decides; the reason's wording is yours
    return Spec(reference, cases, run=run)


def _results(seed: int, n: int) -> list[dict]:
    rng = _rng(seed)
    out = []
    for i in range(n):
        ok = rng.random() > 0.1
        tokens = rng.choice([1, 2, 16, 32])
        out.append({"ok": ok, "ttft_s": round(rng.uniform(0.01, 0.6), 4) if ok else None,
                    "tpot_s": (round(rng.uniform(0.005, 0.09), 4) if tokens > 1 else None) if ok else None,
                    "output_tokens": tokens if ok else 0})
    return out


@_task
def ex08_goodput() -> Spec:
    """Check `goodput(results, duration_s, ttft_slo_s, tpot_slo_s) -> float` (requests/s)."""
    from minirt.serve.bench import goodput as reference

    def case(name, results, duration, ttft, tpot):
        return Case(name, lambda: ([dict(r) for r in results], duration, ttft, tpot),
                    f"{len(results)} results {_short(results, 160)}, duration_s={duration}, ttft_slo_s={ttft}, "
                    f"tpot_slo_s={tpot}")

    good = {"ok": True, "ttft_s": 0.1, "tpot_s": 0.02, "output_tokens": 8}
    cases = [
        case("no requests", [], 2.0, 0.5, 0.05),
        case("one good request", [good], 2.0, 0.5, 0.05),
        case("exactly at both SLOs (<=)", [{**good, "ttft_s": 0.5, "tpot_s": 0.05}], 1.0, 0.5, 0.05),
        case("TTFT over the SLO", [{**good, "ttft_s": 0.51}], 1.0, 0.5, 0.05),
        case("TPOT over the SLO", [{**good, "tpot_s": 0.051}], 1.0, 0.5, 0.05),
        case("one token: no TPOT, meets that SLO", [{**good, "tpot_s": None, "output_tokens": 1}], 1.0, 0.5, 0.05),
        case("a failed request never counts", [{"ok": False, "ttft_s": None, "tpot_s": None, "output_tokens": 0}],
             1.0, 0.5, 0.05),
        case("zero duration", [good], 0.0, 0.5, 0.05),
        case("random, loose SLOs", _results(1, 40), 8.0, 1.0, 0.1),
        case("random, tight SLOs", _results(2, 40), 8.0, 0.2, 0.03),
        case("random, long run", _results(3, 200), 37.5, 0.3, 0.05),
    ]
    return Spec(reference, cases)


# ============================================================================== ex09: tensor parallelism


class SimulatedAllReduce:
    """A stand-in for `minirt.parallel.Communicator` that lets one process play every rank (the checks of ex09).

    Pass 1 (`sums is None`): `all_reduce(x)` records each call's tensor and returns it unchanged. Pass 2 (`sums` the
    element-wise sums over the ranks of pass 1's calls, in order): `all_reduce(x)` writes the next sum into `x` and
    returns it, as a real all-reduce would on every rank."""

    def __init__(self, sums: list[torch.Tensor] | None = None):
        self.sums, self.calls = sums, []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.sums is None:
            self.calls.append(x.detach().clone())
            return x
        if len(self.calls) >= len(self.sums):
            raise RuntimeError("all_reduce called more often than in the first pass")
        self.calls.append(None)
        return x.copy_(self.sums[len(self.calls) - 1])


def simulate_ranks(build: Callable, world_size: int, x_of: Callable[[int], Any]) -> list:
    """Every rank's output of `build(rank, comm)(x_of(rank))` with the all-reduces summed over the ranks, in one
    process: a first pass records what each rank contributes, a second replays the forward with the sums."""
    first = []
    for rank in range(world_size):
        comm = SimulatedAllReduce()
        build(rank, comm)(x_of(rank))
        first.append(comm.calls)
    counts = {len(calls) for calls in first}
    if len(counts) != 1:
        raise RuntimeError(f"the ranks called all_reduce a different number of times: {[len(c) for c in first]}")
    sums = [sum(calls[i] for calls in first) for i in range(counts.pop())]
    return [build(rank, SimulatedAllReduce(sums))(x_of(rank)) for rank in range(world_size)]


def _linear_case(seed: int, in_features: int, out_features: int, bias: bool) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear.requires_grad_(False).to(device())


_SHARD_SHAPES = [("two ranks, no bias", 8, 6, False, 2), ("two ranks, bias", 8, 6, True, 2),
                 ("four ranks", 16, 12, True, 4), ("one rank (nothing to split)", 4, 6, True, 1),
                 ("as many ranks as rows", 4, 4, True, 4), ("eight ranks", 16, 32, False, 8),
                 ("three ranks", 9, 6, True, 3), ("wide input, two ranks", 32, 8, True, 2)]


@_task
def ex09_column_parallel() -> Spec:
    """Check `column_parallel(linear, rank, world_size) -> nn.Linear` (each rank's weight, bias and output)."""
    from minirt.parallel.sharding import column_parallel as reference

    def drive(f, inputs):
        linear, world_size, x = inputs
        outs = []
        for rank in range(world_size):
            shard = f(linear, rank, world_size)
            outs.append({"weight": shard.weight, "bias": shard.bias, "output": shard(x)})
        return outs

    cases = [Case(name, lambda i=i, o=o, b=b, n=n, k=k: (_linear_case(k, i, o, b), n, _randn(3, i, seed=k + 50)),
                  f"nn.Linear({i}, {o}, bias={b}), world_size={n}, x [3, {i}]")
             for k, (name, i, o, b, n) in enumerate(_SHARD_SHAPES)]

    def seeded(j, i, o, b, n, k):
        return Case(f"seeded case {j}", lambda: (_linear_case(k, i, o, b), n, _randn(3, i, seed=k + 50)),
                    f"nn.Linear({i}, {o}, bias={b}), world_size={n}, x [3, {i}]")
    extra = lambda rng: [seeded(j, *_seeded_shape(rng)) for j in (1, 2, 3)]  # noqa: E731
    return Spec(reference, cases, run=drive, extra=extra)


def _seeded_shape(rng: random.Random) -> tuple[int, int, bool, int, int]:
    """(in_features, out_features, bias, world_size, seed): the split features (`out_features`) divide."""
    n = rng.choice([1, 2, 3, 4, 8])
    return rng.randint(1, 32), n * rng.randint(1, 4), rng.random() < 0.5, n, rng.randrange(10**6)


@_task
def ex09_row_parallel() -> Spec:
    """Check `RowParallelLinear(linear, rank, world_size, comm)`: every rank's output after the all-reduce, given
    its share of the input's features, equals `linear` on the whole input (`simulate_ranks`)."""
    from minirt.parallel.sharding import RowParallelLinear as reference

    def drive(cls, inputs):
        linear, world_size, x = inputs
        part = x.shape[-1] // world_size
        return simulate_ranks(lambda rank, comm: cls(linear, rank, world_size, comm), world_size,
                              lambda rank: x[..., rank * part:(rank + 1) * part].clone())

    cases = [Case(name, lambda i=i, o=o, b=b, n=n, k=k: (_linear_case(k, o, i, b), n, _randn(2, 3, o, seed=k + 60)),
                  f"nn.Linear({o}, {i}, bias={b}), world_size={n}, x [2, 3, {o}] split by features")
             for k, (name, i, o, b, n) in enumerate(_SHARD_SHAPES)]

    def seeded(j, i, o, b, n, k):
        return Case(f"seeded case {j}", lambda: (_linear_case(k, o, i, b), n, _randn(2, 3, o, seed=k + 60)),
                    f"nn.Linear({o}, {i}, bias={b}), world_size={n}, x [2, 3, {o}] split by features")
    extra = lambda rng: [seeded(j, *_seeded_shape(rng)) for j in (1, 2, 3)]  # noqa: E731
    return Spec(reference, cases, run=drive, extra=extra)


@_task
def ex09_vocab_parallel_embedding() -> Spec:
    """Check `VocabParallelEmbedding(embedding, rank, world_size, comm)`: every rank's lookup after the all-reduce
    equals the whole embedding's, including a vocabulary that does not divide (`simulate_ranks`)."""
    from minirt.parallel.sharding import VocabParallelEmbedding as reference

    def make(seed, vocab, hidden, world_size, ids):
        gen = torch.Generator().manual_seed(seed)
        embedding = torch.nn.Embedding(vocab, hidden).requires_grad_(False)
        with torch.no_grad():
            embedding.weight.copy_(torch.randn(vocab, hidden, generator=gen))
        return embedding.to(device()), world_size, torch.tensor(ids, device=device())

    def drive(cls, inputs):
        embedding, world_size, ids = inputs
        return simulate_ranks(lambda rank, comm: cls(embedding, rank, world_size, comm), world_size, lambda r: ids)

    specs = [("two ranks", 8, 4, 2, [[0, 3, 4, 7]]), ("the first and last ids", 12, 3, 3, [[0, 11, 4, 3, 8]]),
             ("vocabulary 10 over 4 ranks: the last shard is short", 10, 4, 4, [[9, 8, 0, 2, 5]]),
             ("vocabulary 7 over 3 ranks", 7, 2, 3, [[6, 6, 5, 0], [1, 2, 3, 4]]),
             ("one rank", 5, 3, 1, [[4, 0, 2]]), ("repeated ids, 4 ranks", 16, 8, 4, [[5] * 6 + [15, 0]]),
             ("ids at the shard boundaries, 2 ranks", 6, 5, 2, [[2, 3, 5]]),
             ("ids of shape [2, 2, 2], vocabulary 9 over 2 ranks", 9, 3, 2, [[[0, 8], [4, 5]], [[3, 3], [1, 7]]])]
    cases = [Case(name, lambda k=k, v=v, h=h, n=n, i=i: make(k, v, h, n, i),
                  f"nn.Embedding({v}, {h}), world_size={n}, ids {i}")
             for k, (name, v, h, n, i) in enumerate(specs)]

    def seeded(j, rng):
        n = rng.choice([1, 2, 3, 4, 8])
        v, h, k = rng.randint(n, 40), rng.randint(1, 8), rng.randrange(10**6)
        width = rng.randint(1, 8)
        ids = [[rng.randrange(v) for _ in range(width)] for _ in range(rng.randint(1, 3))]
        return Case(f"seeded case {j}", lambda: make(k, v, h, n, ids), f"nn.Embedding({v}, {h}), world_size={n}, ids {ids}")
    return Spec(reference, cases, run=drive, extra=lambda rng: [seeded(j, rng) for j in (1, 2, 3)])


# ============================================================================== ex10: quantization


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values as `t [N, K]`, stored column by column: a non-contiguous view (strides (1, N))."""
    return t.t().contiguous().t()


def _plain_q(q: Any) -> Any:
    """A quantized tensor in a form the grader can carry and compare: FP8 values as float32 (every e4m3 value is
    exactly a float32; two neighbours differ by more than float32's tolerance), anything else as it is."""
    if isinstance(q, torch.Tensor) and q.dtype.is_floating_point and q.element_size() == 1:
        return q.float()
    return q


def _quantized_pair(out: Any) -> Any:
    """What `quantize` returned, as the check compares it: q's dtype first, then q and the scales."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
        return out
    q, scale = out
    return {"q dtype": str(q.dtype), "q": _plain_q(q), "scale": scale}


def _weight_show(w: torch.Tensor, what: str) -> str:
    return f"weight [{w.shape[0]}, {w.shape[1]}] {str(w.dtype).removeprefix('torch.')} {what}" if w.dim() == 2 \
        else f"weight of shape {list(w.shape)} {what}"


@_task
def ex10_quantize() -> Spec:
    """Check `quantize(weight [N, K], method) -> (q [N, K] int8 | float8_e4m3fn, scale [N] float32)`: one
    symmetric absmax scale per output channel (row), compared exactly (q) and within float32's tolerance (scale)."""
    from minirt.quant.formats import quantize as reference

    def run(f, inputs):
        weight, method, layout = inputs
        return _quantized_pair(f(_column_major(weight) if layout == "column-major" else weight, method))

    def case(name, make_weight, method, what, layout="row-major"):
        def make():
            return make_weight(), method, layout
        w = make_weight()
        extra = ", stored column-major (a non-contiguous view)" if layout == "column-major" else ""
        return Case(name, make, f"{_weight_show(w, what)}{extra}, method={method!r}")

    def fixed(rows):
        return lambda: torch.tensor(rows, dtype=torch.float32, device=device())

    def magnitudes(seed):              # one row ~1e-3, one ~1, one ~1e3: a per-tensor scale crushes the first
        return lambda: _randn(3, 16, seed=seed) * torch.tensor([[1e-3], [1.0], [1e3]], device=device())

    def zero_row(seed):
        def make():
            w = _randn(4, 8, seed=seed)
            w[2] = 0.0
            return w
        return make

    def outlier(seed, value):
        def make():
            w = _randn(2, 12, seed=seed) * 0.01
            w[1, 5] = value
            return w
        return make

    negative = [[-5.0, 1.0, 2.5, 4.9], [0.3, -0.7, 0.2, 0.1]]
    ties = [[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5], [63.5, 0.25, 0.75, 1.25, -0.25, -0.75, -1.25, 0.0]]
    cases = [
        case("int8: a [2, 3] weight by hand", fixed([[1.0, -0.5, 0.25], [2.0, 4.0, -8.0]]), "int8",
             "[[1.0, -0.5, 0.25], [2.0, 4.0, -8.0]]"),
        case("int8: rows of very different magnitudes (one scale per row, not per tensor)", magnitudes(1), "int8",
             "random, rows scaled by 1e-3, 1 and 1e3"),
        case("int8: the largest magnitude is negative: -amax -> -127", fixed(negative), "int8", str(negative)),
        case("int8: halfway values round to even (torch.round): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2", fixed(ties), "int8",
             f"{ties} (scales exactly 1.0 and 0.5)"),
        case("int8: a zero row: scale MIN_SCALE, q all 0", zero_row(2), "int8", "random, row 2 all zeros"),
        case("int8: a row of tiny values (amax 3e-11 < 127 * MIN_SCALE): its scale stops at MIN_SCALE",
             fixed([[3e-11, -1e-11, 2e-12, 0.0], [1.0, -2.0, 0.5, 0.25]]), "int8",
             "[[3e-11, -1e-11, 2e-12, 0.0], [1.0, -2.0, 0.5, 0.25]]"),
        case("int8: one outlier (3.0 among values ~0.01): the others round to 0 or +-1", outlier(3, 3.0), "int8",
             "random ~N(0, 0.01^2), weight[1, 5] = 3.0"),
        case("int8: a bfloat16 weight (quantized in float32)", lambda: _randn(6, 20, seed=4, dtype=torch.bfloat16),
             "int8", "random"),
        case("int8: a column-major (non-contiguous) weight", lambda: _randn(5, 7, seed=5), "int8", "random",
             layout="column-major"),
        case("int8: one input channel (K = 1)", fixed([[0.3], [-2.0], [0.0], [7.0]]), "int8",
             "[[0.3], [-2.0], [0.0], [7.0]]"),
        case("int8: random [16, 64]", lambda: _randn(16, 64, seed=6), "int8", "random (seed 6)"),
        case("fp8: a [2, 3] weight by hand", fixed([[1.0, -0.5, 0.25], [2.0, 4.0, -8.0]]), "fp8",
             "[[1.0, -0.5, 0.25], [2.0, 4.0, -8.0]]"),
        case("fp8: rows of very different magnitudes (one scale per row, not per tensor)", magnitudes(7), "fp8",
             "random, rows scaled by 1e-3, 1 and 1e3"),
        case("fp8: the largest magnitude is negative: -amax -> -448", fixed(negative), "fp8", str(negative)),
        case("fp8: halfway between two e4m3 values: to the even one (17 -> 16, 19 -> 20)",
             fixed([[448.0, 17.0, 19.0, -17.0, -19.0, 1.0]]), "fp8", "[[448.0, 17.0, 19.0, -17.0, -19.0, 1.0]] "
             "(scale exactly 1.0)"),
        case("fp8: a zero row: scale MIN_SCALE, q all 0", zero_row(8), "fp8", "random, row 2 all zeros"),
        case("fp8: values far beyond e4m3's 448 (|w| up to 3e5): scaled into range, none saturates",
             lambda: _randn(3, 10, seed=9, scale=1e5), "fp8", "random ~N(0, 1e5^2)"),
        case("fp8: one outlier (1000 among values ~0.01): the small values become e4m3 subnormals or 0",
             outlier(10, 1000.0), "fp8", "random ~N(0, 0.01^2), weight[1, 5] = 1000.0"),
        case("fp8: a bfloat16 weight (quantized in float32)", lambda: _randn(6, 20, seed=11, dtype=torch.bfloat16),
             "fp8", "random"),
        case("fp8: a column-major (non-contiguous) weight", lambda: _randn(5, 7, seed=12), "fp8", "random",
             layout="column-major"),
        case("fp8: random [16, 64]", lambda: _randn(16, 64, seed=13), "fp8", "random (seed 13)"),
        case("method 'int4' -> ValueError", lambda: _randn(2, 4, seed=14), "int4", "random"),
        case("a 1-D weight -> ValueError", lambda: _randn(8, seed=15), "int8", "random"),
    ]

    def seeded(j, rng):
        n, k, seed = rng.randint(1, 24), rng.randint(1, 80), rng.randrange(10**6)
        method, dtype = rng.choice(["int8", "fp8"]), rng.choice([torch.float32, torch.bfloat16])
        magnitude, zero = 10.0 ** rng.randint(-4, 4), rng.randrange(n) if rng.random() < 0.3 else None
        layout = rng.choice(["row-major", "column-major"])

        def make_weight():
            w = _randn(n, k, seed=seed, scale=magnitude)
            if zero is not None:
                w[zero] = 0.0
            return w.to(dtype)
        what = f"random ~N(0, {magnitude:g}^2) (seed {seed})" + (f", row {zero} all zeros" if zero is not None else "")
        return case(f"seeded case {j}", make_weight, method, what, layout)
    return Spec(reference, cases, run=run, extra=lambda rng: [seeded(j, rng) for j in (1, 2, 3)])


@_task
def ex10_dequantize() -> Spec:
    """Check `dequantize(q [N, K] int8 | float8_e4m3fn, scale [N] float32) -> [N, K] float32`: `q * scale` row by
    row, and ValueError for scales of another shape."""
    from minirt.quant.formats import STORAGE_DTYPE, quantize
    from minirt.quant.formats import dequantize as reference

    def run(f, inputs):
        q, scale, method, layout = inputs
        q = q.to(STORAGE_DTYPE[method])                # FP8 values travel as float32; each is an exact e4m3 value
        return f(_column_major(q) if layout == "column-major" else q, scale)

    def case(name, make_q, make_scale, method, what, layout="row-major"):
        def make():
            return _plain_q(make_q()), make_scale(), method, layout
        q, scale = make_q(), make_scale()
        extra = ", stored column-major (a non-contiguous view)" if layout == "column-major" else ""
        values = f" = {[float(f'{v:.6g}') for v in scale.flatten().tolist()]}" if scale.numel() <= 6 else ""
        return Case(name, make, f"q [{q.shape[0]}, {q.shape[1]}] {str(q.dtype).removeprefix('torch.')} {what}{extra}, "
                                f"scale {list(scale.shape)}{values}")

    def tensor(rows, dtype=torch.float32):
        return lambda: torch.tensor(rows, dtype=torch.float32).to(dtype=dtype, device=device())

    def quantized(seed, n, k, method, scale=1.0, zero=None):
        def pair():
            w = _randn(n, k, seed=seed, scale=scale)
            if zero is not None:
                w[zero] = 0.0
            return quantize(w, method)
        return (lambda: pair()[0]), (lambda: pair()[1])

    fp8_rows = [[448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 0.0], [16.0, 20.0, -1.125, 0.015625, 240.0]]
    q1, s1 = quantized(1, 16, 64, "int8")
    q2, s2 = quantized(2, 3, 5, "int8", zero=1)
    q3, s3 = quantized(3, 16, 64, "fp8")
    q4, s4 = quantized(4, 4, 9, "fp8", scale=1e3)
    q5, s5 = quantized(5, 5, 7, "int8")
    q6, s6 = quantized(6, 6, 1, "fp8")
    cases = [
        case("int8: a [2, 3] q by hand", tensor([[127, -64, 0], [1, -127, 50]], torch.int8), tensor([0.5, 0.01]),
             "int8", "[[127, -64, 0], [1, -127, 50]]"),
        case("int8: the extremes +-127 and a scale of 1", tensor([[127, -127], [-127, 127]], torch.int8),
             tensor([1.0, 3.0]), "int8", "[[127, -127], [-127, 127]]"),
        case("int8: a zero row with scale MIN_SCALE: exact zeros", q2, s2, "int8", "quantize()d, row 1 all zeros"),
        case("int8: random [16, 64] from quantize", q1, s1, "int8", "quantize()d random (seed 1)"),
        case("fp8: q by hand: +-448 and the e4m3 subnormals +-2^-9", tensor(fp8_rows, torch.float8_e4m3fn),
             tensor([0.25, 2.0]), "fp8", str(fp8_rows)),
        case("fp8: random [16, 64] from quantize", q3, s3, "fp8", "quantize()d random (seed 3)"),
        case("fp8: large weights (|w| ~ 1e3: every scale above 1)", q4, s4, "fp8", "quantize()d random ~N(0, 1e3^2)"),
        case("int8: a column-major (non-contiguous) q", q5, s5, "int8", "quantize()d random", layout="column-major"),
        case("fp8: one input channel (K = 1)", q6, s6, "fp8", "quantize()d random"),
        case("scale of shape [N, 1] -> ValueError", tensor([[1, 2], [3, 4], [5, 6]], torch.int8),
             lambda: torch.ones(3, 1, device=device()), "int8", "[[1, 2], [3, 4], [5, 6]]"),
        case("scale of shape [N + 1] -> ValueError", tensor([[1, 2], [3, 4]], torch.int8),
             lambda: torch.ones(3, device=device()), "int8", "[[1, 2], [3, 4]]"),
    ]

    def seeded(j, rng):
        n, k, seed = rng.randint(1, 24), rng.randint(1, 80), rng.randrange(10**6)
        method, magnitude = rng.choice(["int8", "fp8"]), 10.0 ** rng.randint(-4, 4)
        zero = rng.randrange(n) if rng.random() < 0.3 else None
        q, s = quantized(seed, n, k, method, magnitude, zero)
        return case(f"seeded case {j}", q, s, method, f"quantize()d random ~N(0, {magnitude:g}^2) (seed {seed})"
                    + (f", row {zero} all zeros" if zero is not None else ""),
                    rng.choice(["row-major", "column-major"]))
    return Spec(reference, cases, run=run, extra=lambda rng: [seeded(j, rng) for j in (1, 2, 3)])


@_task
def ex10_quantized_linear() -> Spec:
    """Check `QuantizedLinear(linear, method)`: its state_dict (names, dtypes, shapes), its quantized weight and
    scales, and `forward(x)` = `x @ dequantize(weight, weight_scale).T + bias` in x's dtype."""
    from minirt.quant.linear import QuantizedLinear

    def reference(linear, method):
        return QuantizedLinear.from_linear(linear, method)

    def run(cls, inputs):
        weight, bias, method, x, layout = inputs
        n, k = weight.shape
        # built here from its tensors (a Linear on the wire would arrive in float32): same dtype on both sides
        linear = torch.nn.Linear(k, n, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        layer = cls(linear.requires_grad_(False), method)
        with torch.no_grad():
            y = layer(_column_major(x) if layout == "column-major" else x)
        state = {name: f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
                 for name, t in sorted(layer.state_dict().items())}
        return {"state_dict": state, "weight": _plain_q(layer.weight), "weight_scale": layer.weight_scale,
                "output": y}

    def case(name, n, k, bias, method, x_shape, seed, dtype=torch.float32, zero=None, layout="row-major"):
        def make():
            w = _randn(n, k, seed=seed, scale=k ** -0.5)
            if zero is not None:
                w[zero] = 0.0
            b = _randn(n, seed=seed + 1).to(dtype) if bias else None
            return w.to(dtype), b, method, _randn(*x_shape, seed=seed + 2, dtype=dtype), layout
        dt = str(dtype).removeprefix("torch.")
        show = (f"nn.Linear({k}, {n}, bias={bias}) in {dt}" + (f" with output channel {zero} all zeros" if zero
                is not None else "") + f", method={method!r}, x {list(x_shape)} {dt}"
                + (" stored column-major (a non-contiguous view)" if layout == "column-major" else ""))
        return Case(name, make, show)

    cases = [
        case("int8, no bias: x [3, K]", 6, 8, False, "int8", (3, 8), 1),
        case("int8, bias", 6, 8, True, "int8", (3, 8), 4),
        case("fp8, bias", 6, 8, True, "fp8", (3, 8), 7),
        case("fp8, no bias: x [2, 3, K] (leading dims)", 5, 16, False, "fp8", (2, 3, 16), 10),
        case("int8, bias: an all-zero output channel gives its bias", 4, 8, True, "int8", (2, 8), 13, zero=2),
        case("int8, bias, bfloat16: the output in bfloat16", 8, 32, True, "int8", (4, 32), 16, dtype=torch.bfloat16),
        case("fp8, no bias, bfloat16: the output in bfloat16", 8, 32, False, "fp8", (4, 32), 19, dtype=torch.bfloat16),
        case("int8, bias: x of shape [K] (one token, no batch dimension)", 3, 5, True, "int8", (5,), 22),
        case("fp8, bias: x a column-major (non-contiguous) view", 4, 6, True, "fp8", (5, 6), 25, layout="column-major"),
        case("int8, bias: random [32, 64], x [7, 64]", 32, 64, True, "int8", (7, 64), 28),
        case("fp8, bias: random [32, 64], x [7, 64]", 32, 64, True, "fp8", (7, 64), 31),
        case("method 'int4' -> ValueError", 2, 4, False, "int4", (1, 4), 34),
    ]

    def seeded(j, rng):
        n, k, t, seed = rng.randint(1, 24), rng.randint(1, 64), rng.randint(1, 6), rng.randrange(10**6)
        zero = rng.randrange(n) if rng.random() < 0.3 else None
        return case(f"seeded case {j}", n, k, rng.random() < 0.5, rng.choice(["int8", "fp8"]), (t, k), seed,
                    rng.choice([torch.float32, torch.bfloat16]), zero, rng.choice(["row-major", "column-major"]))
    return Spec(reference, cases, run=run, extra=lambda rng: [seeded(j, rng) for j in (1, 2, 3)])


# ============================================================================== ex11: speculative decoding


def chi_square_pvalue(observed, expected) -> float:
    """Pearson's chi-square test of counts `observed` against probabilities `expected` (same shape): the
    probability of a statistic at least this large if the counts were drawn from `expected`. Cells expecting
    fewer than 5 draws are pooled into one; a draw in a cell of probability 0 gives 0.0. The tail of the
    chi-square law is the regularized upper incomplete gamma function: P(X >= x) = Q(df / 2, x / 2)."""
    obs = torch.as_tensor(observed, dtype=torch.float64).flatten().cpu()
    prob = torch.as_tensor(expected, dtype=torch.float64).flatten().cpu()
    if bool((obs[prob <= 0] > 0).any()):
        return 0.0
    exp = prob * obs.sum()
    big, small = exp >= 5, (exp > 0) & (exp < 5)
    o, e = obs[big], exp[big]
    if bool(small.any()):
        o, e = torch.cat([o, obs[small].sum()[None]]), torch.cat([e, exp[small].sum()[None]])
    if len(e) < 2:
        return 1.0
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2))


def speculative_outcome_probs(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """`[k+1, V]`: the probability that speculative sampling accepts exactly j drafts and emits token y last,
    when draft i is drawn from draft_probs[i] (one-hot rows: a fixed draft) and scored by target_probs[i].

    Draft i is accepted with probability beta_i = sum(min(p_i, q_i)) (Leviathan et al. 2023, section 3.3), the
    correction after j acceptances is norm(max(0, p_j - q_j)) and the bonus after k is p_k, so
    P(j, y) = beta_0 ... beta_{j-1} * max(0, p_j(y) - q_j(y)) for j < k, and beta_0 ... beta_{k-1} * p_k(y)."""
    p, q = target_probs.double().cpu(), draft_probs.double().cpu()
    k = q.shape[0]
    beta = torch.minimum(p[:k], q).sum(-1)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), beta.cumprod(0)])
    last = torch.cat([(p[:k] - q).clamp(min=0), p[k:]])
    return reach[:, None] * last


_SPEC_PVALUE = 1e-6        # an honest implementation fails one distribution case about once in a million


def _draft_rows(draft_probs, draft: list[int], V: int, dev) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs
    return torch.nn.functional.one_hot(torch.tensor(draft, dtype=torch.long), V).to(torch.float32).to(dev)


def _emitted_problem(out, draft: list[int], V: int) -> str | None:
    """Why `out` is not a valid result of one speculative step for `draft` (None if it is)."""
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                      for t in out):
        return f"expected a list of Python ints, got {_short(out, 80)}"
    out = [int(t) for t in out]
    if not 1 <= len(out) <= len(draft) + 1:
        return f"returned {len(out)} tokens {out}: one step emits 1 to k + 1 = {len(draft) + 1}"
    if out[:-1] != draft[:len(out) - 1]:
        return f"returned {out}: all tokens but the last must be the draft's first ones ({draft})"
    if not 0 <= out[-1] < V:
        return f"returned {out}: token {out[-1]} is outside the vocabulary [0, {V})"
    return None


def _spec_distribution(f, inputs) -> dict:
    """Run `f` over `draws` seeded generators (a fresh draft from q each time, or the fixed draft) and test what
    it emits against the closed forms. Every value is "ok" for a correct implementation."""
    p, q, fixed, draws, seed = inputs
    dev, V, k = p.device, p.shape[1], p.shape[0] - 1
    drafts_gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, V, dtype=torch.float64)
    first = torch.zeros(V, dtype=torch.float64)
    shape = "ok"
    for s in range(draws):
        draft = fixed if q is None else [int(torch.multinomial(q[i].cpu(), 1, generator=drafts_gen)) for i in range(k)]
        out = f(list(draft), q, p, torch.Generator(device=dev).manual_seed(seed * 100003 + s))
        problem = _emitted_problem(out, draft, V)
        if problem:
            shape = f"draw {s}, draft {draft}: {problem}"
            break
        counts[len(out) - 1, int(out[-1])] += 1
        first[int(out[0])] += 1
    same = "ok"
    for s in range(8):
        draft = fixed if q is None else [0] * k
        runs = []
        for global_seed in (1, 2):
            torch.manual_seed(global_seed)
            runs.append(f(list(draft), q, p, torch.Generator(device=dev).manual_seed(seed + s)))
        if runs[0] != runs[1]:
            same = (f"generator seeded {seed + s} gave {runs[0]}, then {runs[1]} under another torch.manual_seed: "
                    "draw every random number from `generator`")
            break
    result = {"every draw returns the accepted drafts, then one token": shape,
              "the same generator seed gives the same tokens": same}
    if shape != "ok":
        return {**result, "first token ~ p_0": "not tested", "(accepted, last token) ~ closed form": "not tested"}
    want_first = p[0].double().cpu()
    pv = chi_square_pvalue(first, want_first)
    result["first token ~ p_0"] = "ok" if pv > _SPEC_PVALUE else (
        f"first tokens {[round(x, 3) for x in (first / draws).tolist()]} over {draws} draws against "
        f"p_0 = {[round(x, 3) for x in want_first.tolist()]}: "
        f"chi-square p-value {pv:.2g}")
    joint = speculative_outcome_probs(_draft_rows(q, fixed, V, dev), p)
    pv = chi_square_pvalue(counts, joint)
    accepted, want = counts.sum(1) / draws, joint.sum(1)
    result["(accepted, last token) ~ closed form"] = "ok" if pv > _SPEC_PVALUE else (
        f"drafts accepted 0..k: {[round(x, 3) for x in accepted.tolist()]} against "
        f"{[round(x, 3) for x in want.tolist()]} (with the last token: chi-square p-value {pv:.2g})")
    return result


@_task
def ex11_greedy_accept() -> Spec:
    """Check `greedy_accept(draft [k], target_argmax [k+1]) -> list[int]` (the longest matching prefix, then the
    target's own token)."""
    from minirt.spec.acceptance import greedy_accept as reference

    def case(name, draft, target):
        return Case(name, lambda: (list(draft), list(target)), f"draft={draft}, target_argmax={target}")

    def random_case(j, rng):
        k, V = rng.randint(0, 8), rng.randint(2, 4)
        target = [rng.randrange(V) for _ in range(k + 1)]
        cut = rng.randint(0, k)
        draft = target[:cut] + [rng.randrange(V) for _ in range(k - cut)]
        return case(f"random case {j}" if j > 0 else f"seeded case {-j}", draft, target)

    rng = _rng(111)
    cases = [
        case("no drafts (k = 0): the target's own token", [], [7]),
        case("all 3 drafts accepted, then the bonus token", [5, 9, 2], [5, 9, 2, 4]),
        case("the first draft rejected: the target's token only", [5, 9, 2], [6, 9, 2, 4]),
        case("rejected in the middle", [5, 9, 2, 8], [5, 9, 3, 8, 1]),
        case("the last draft rejected", [5, 9, 2], [5, 9, 1, 4]),
        case("a match after a mismatch does not count", [1, 2, 3, 4], [1, 7, 3, 4, 5]),
        case("repeated tokens", [3, 3, 3, 3], [3, 3, 3, 3, 3]),
        case("k = 1, accepted", [0], [0, 0]),
        case("target_argmax of length k -> ValueError", [1, 2], [1, 2]),
        case("target_argmax of length k + 2 -> ValueError", [1], [1, 2, 3]),
    ] + [random_case(j, rng) for j in range(1, 5)]
    return Spec(reference, cases, extra=lambda rng: [random_case(-j, rng) for j in (1, 2, 3)])


def _onehot_rows(tokens: list[int], V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), V).to(torch.float32).to(device())


def _probs(seed: int, rows: int, V: int, zero: list[tuple[int, int]] = ()) -> torch.Tensor:
    """`[rows, V]` seeded distributions, skewed (uniform draws cubed), optionally zero at (row, token)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(rows, V, generator=g) + 0.1) ** 3
    for r, t in zero:
        w[r, t] = 0.0
    return (w / w.sum(-1, keepdim=True)).to(device())


@_task
def ex11_rejection_sample() -> Spec:
    """Check `rejection_sample(draft [k], draft_probs [k, V] | None, target_probs [k+1, V], generator) -> list[int]`:
    exact results where the rule leaves nothing to chance, then the distribution of what it emits over thousands of
    seeded generators (chi-square tests against p_0 and against the closed form; p-value threshold 1e-6)."""
    from minirt.sampling import probs_after_filters
    from minirt.spec.acceptance import rejection_sample as reference

    def run(f, inputs):
        mode, rest = inputs
        if mode == "exact":
            draft, q, p, seed = rest
            return f(list(draft), q, p, torch.Generator(device=p.device).manual_seed(seed))
        return _spec_distribution(f, rest)

    def exact(name, draft, q, p, seed=0, show=""):
        return Case(name, lambda: ("exact", (list(draft), q() if q else None, p(), seed)),
                    f"draft={draft}, {show}")

    def dist(name, p, q, fixed, draws, seed, show):
        return Case(name, lambda: ("distribution", (p(), q() if q else None, fixed, draws, seed)),
                    f"{show}; {draws} draws, each with torch.Generator().manual_seed(...) of its own")

    V = 5
    mixed = lambda: _probs(3, 3, V)                                                  # noqa: E731
    filtered = lambda: torch.stack([probs_after_filters(_randn(6, seed=40 + i), 0.8, 4, 0.95)  # noqa: E731
                                    for i in range(3)])
    cases = [
        exact("no drafts (k = 0): one token from a one-hot p_0", [], None, lambda: _onehot_rows([3], V),
              show="draft_probs=None, target_probs one-hot at [3]"),
        exact("no drafts, draft_probs of shape [0, V]", [], lambda: torch.zeros(0, V, device=device()),
              lambda: _onehot_rows([1], V), show="draft_probs [0, 5], target_probs one-hot at [1]"),
        exact("every p_i(x_i) >= q_i(x_i): all accepted, then the bonus token", [1, 2, 0],
              lambda: _probs(5, 3, V), lambda: torch.cat([_onehot_rows([1, 2, 0], V), _onehot_rows([4], V)]),
              show="q random, target_probs one-hot at [1, 2, 0, 4]"),
        exact("p_0(x_0) = 0: rejected at once, the residual holds one token", [2, 2],
              lambda: _probs(6, 2, V), lambda: _onehot_rows([4, 2, 0], V), show="q random, p one-hot at [4, 2, 0]"),
        exact("q_1(x_1) = 0 < p_1(x_1): accepted (min(1, p/q) = 1)", [1, 3],
              lambda: _probs(7, 2, V, zero=[(1, 3)]), lambda: torch.cat([_onehot_rows([1], V), _probs(8, 1, V),
                                                                          _onehot_rows([2], V)]),
              show="q_1(3) = 0, p_0 one-hot at 1, p_1 random, p_2 one-hot at 2"),
        exact("draft_probs None, one-hot target (greedy): the longest matching prefix", [3, 1, 4, 1], None,
              lambda: _onehot_rows([3, 1, 0, 1, 2], V), show="draft_probs=None, p one-hot at [3, 1, 0, 1, 2]"),
        exact("draft_probs None, the target certain of every draft: k + 1 tokens", [0, 4], None,
              lambda: _onehot_rows([0, 4, 4], V), show="draft_probs=None, p one-hot at [0, 4, 4]"),
        dist("a drafter with its own q (k = 2, V = 5)", mixed, lambda: _probs(4, 2, V), None, 3000, 11,
             "p [3, 5] and q [2, 5] random"),
        dist("draft_probs None: a fixed draft (k = 3, V = 5)", lambda: _probs(9, 4, V), None, [2, 0, 3], 3000, 12,
             "draft=[2, 0, 3], draft_probs=None, p [4, 5] random"),
        dist("q puts mass where p has none and p where q has none (k = 2, V = 5)",
             lambda: _probs(13, 3, V, zero=[(0, 1), (1, 4)]), lambda: _probs(14, 2, V, zero=[(0, 3), (1, 0)]), None,
             3000, 13, "p_0(1) = p_1(4) = 0, q_0(3) = q_1(0) = 0"),
        dist("a target after temperature 0.8, top-k 4, top-p 0.95 (k = 2, V = 6)", filtered,
             lambda: _probs(15, 2, 6), None, 3000, 14, "p = probs_after_filters(logits, 0.8, 4, 0.95) per row"),
    ]

    def seeded(j, rng):
        k, V = rng.randint(1, 3), rng.randint(3, 5)
        a, b, seed = rng.randrange(10**6), rng.randrange(10**6), rng.randrange(10**4)
        if rng.random() < 0.5:
            fixed = [rng.randrange(V) for _ in range(k)]
            return dist(f"seeded case {j}", lambda: _probs(a, k + 1, V), None, fixed, 2000, seed,
                        f"draft={fixed}, draft_probs=None, p [{k + 1}, {V}] random (seed {a})")
        return dist(f"seeded case {j}", lambda: _probs(a, k + 1, V), lambda: _probs(b, k, V), None, 2000, seed,
                    f"p [{k + 1}, {V}] and q [{k}, {V}] random (seeds {a}, {b})")
    return Spec(reference, cases, run=run, extra=lambda rng: [seeded(j, rng) for j in (1, 2)])


@_task
def ex11_rollback_block_table() -> Spec:
    """Check `rollback_block_table(block_table, pool, num_tokens, block_size) -> list[int]` on a `minirt.kv.BlockPool`:
    what it returns, the table after it, every block's ref_count, the free list in order and the cached blocks."""
    from minirt.kv.block_pool import BlockPool
    from minirt.kv.prefix_cache import PrefixCache
    from minirt.spec.rollback import rollback_block_table as reference

    def run(f, inputs):
        num_blocks, table, shared, hashed, num_tokens, B = inputs
        pool = BlockPool(num_blocks)
        for _ in range(num_blocks):
            pool.allocate()
        for b in range(num_blocks):
            if b not in table:
                pool.release(b)                    # the free list: the blocks outside the table, in id order
        for b in shared:
            pool.acquire(b)                        # another request holds these too (a prefix-cache hit)
        if hashed:
            PrefixCache(pool, B).register(list(range(hashed * B)), table, hashed * B, 0)
        mine = list(table)
        returned = f(mine, pool, num_tokens, B)
        return {"returned": returned, "block_table": mine, "ref_counts": [b.ref_count for b in pool.blocks],
                "num_free_blocks": pool.num_free_blocks, "free list, oldest first": list(pool.free),
                "cached blocks": sorted(pool.cached.values())}

    def case(name, num_blocks, table, num_tokens, B, shared=(), hashed=0):
        show = (f"BlockPool({num_blocks}), block_table={table}, num_tokens={num_tokens}, block_size={B}"
                + (f", blocks {list(shared)} shared (ref_count 2)" if shared else "")
                + (f", the first {hashed} block(s) in the prefix cache" if hashed else ""))
        return Case(name, lambda: (num_blocks, list(table), list(shared), hashed, num_tokens, B), show)

    def random_case(name, rng):
        B, n = rng.choice([1, 2, 4, 16]), rng.randint(1, 6)
        num_blocks = n + rng.randint(0, 4)
        table = rng.sample(range(num_blocks), n)
        shared = rng.sample(table, rng.randint(0, min(2, n)))
        return case(name, num_blocks, table, rng.randint(0, n * B), B, shared, rng.randint(0, n - 1))

    rng = _rng(113)
    cases = [
        case("nothing rejected: every block kept", 6, [2, 0, 4], 12, 4),
        case("the kept tokens end inside the last block: kept", 6, [2, 0, 4], 10, 4),
        case("block boundary B: the block after it released", 6, [1, 3], 4, 4),
        case("block boundary B-1", 6, [1, 3], 3, 4),
        case("block boundary B+1", 6, [1, 3, 5], 5, 4),
        case("several whole blocks released, last block first", 8, [7, 1, 6, 2, 5], 3, 4),
        case("num_tokens = 0: every block released", 4, [3, 0], 0, 4),
        case("a shared block (ref_count 2) is released, not freed", 6, [0, 1, 2], 4, 4, shared=[1, 2]),
        case("a shared prefix-cached block kept; the cache untouched", 6, [4, 1, 2], 5, 4, shared=[4], hashed=1),
        case("block_size 1", 6, [5, 4, 3, 2], 2, 1),
        case("block_size 16, a draft run across a block boundary", 4, [2, 3], 15, 16, hashed=0),
        case("num_tokens < 0 -> ValueError", 4, [0], -1, 4),
    ] + [random_case(f"random case {j}", rng) for j in range(1, 4)]
    return Spec(reference, cases, run=run, extra=lambda rng: [random_case(f"seeded case {j}", rng) for j in (1, 2, 3)])


# ============================================================================== registry

TASKS: dict[str, Callable[[Callable], None]] = {
    "ex01.greedy_next_token": ex01_greedy_next_token,
    "ex01.naive_generate": ex01_naive_generate,
    "ex02.left_pad": ex02_left_pad,
    "ex02.kv_cache_generate": ex02_kv_cache_generate,
    "ex03.slot_mapping": ex03_slot_mapping,
    "ex03.block_pool": ex03_block_pool,
    "ex03.paged_attention": ex03_paged_attention,
    "ex04.block_hashes": ex04_block_hashes,
    "ex04.match": ex04_match,
    "ex05.try_allocate": ex05_try_allocate,
    "ex05.append_token": ex05_append_token,
    "ex06.split_budget": ex06_split_budget,
    "ex06.schedule": ex06_schedule,
    "ex07.capture_sizes": ex07_capture_sizes,
    "ex07.combine_splits": ex07_combine_splits,
    "ex08.delta_chunks": ex08_delta_chunks,
    "ex08.admission": ex08_admission,
    "ex08.goodput": ex08_goodput,
    "ex09.column_parallel": ex09_column_parallel,
    "ex09.row_parallel": ex09_row_parallel,
    "ex09.vocab_parallel_embedding": ex09_vocab_parallel_embedding,
    "ex10.quantize": ex10_quantize,
    "ex10.dequantize": ex10_dequantize,
    "ex10.quantized_linear": ex10_quantized_linear,
    "ex11.greedy_accept": ex11_greedy_accept,
    "ex11.rejection_sample": ex11_rejection_sample,
    "ex11.rollback_block_table": ex11_rollback_block_table,
}
# minirt's own implementation of each task ("module:qualname"): handing one in, or calling it, is not a
# solution; the grader scores it 0 (`minirt.course.provenance`).
REFERENCE_NAMES: dict[str, tuple[str, ...]] = {
    "ex01.greedy_next_token": ("minirt.sampling:sample",),
    "ex01.naive_generate": ("minirt.generate.naive:naive_generate",),
    "ex02.left_pad": ("minirt.generate.kv_cache:left_pad",),
    "ex02.kv_cache_generate": ("minirt.generate.kv_cache:kv_cache_generate",),
    "ex03.slot_mapping": ("minirt.kv.paged_cache:slot_mapping",),
    "ex03.block_pool": ("minirt.kv.block_pool:BlockPool",),
    "ex03.paged_attention": ("minirt.attention:paged_attention_reference",),
    "ex04.block_hashes": ("minirt.kv.prefix_cache:block_hashes",),
    "ex04.match": ("minirt.kv.prefix_cache:PrefixCache.match",),
    "ex05.try_allocate": ("minirt.scheduler:Scheduler.try_allocate",),
    "ex05.append_token": ("minirt.request:Request.append_token",),
    "ex06.split_budget": ("minirt.scheduler:split_budget",),
    "ex06.schedule": ("minirt.scheduler:Scheduler.schedule",),
    "ex07.capture_sizes": ("minirt.fast.cuda_graphs:capture_sizes",),
    "ex07.combine_splits": ("minirt.fast.attention:combine_splits",),
    "ex08.delta_chunks": ("minirt.serve.protocol:delta_chunks",),
    "ex08.admission": ("minirt.serve.app:admission",),
    "ex08.goodput": ("minirt.serve.bench:goodput",),
    "ex09.column_parallel": ("minirt.parallel.sharding:column_parallel",),
    "ex09.row_parallel": ("minirt.parallel.sharding:RowParallelLinear",),
    "ex09.vocab_parallel_embedding": ("minirt.parallel.sharding:VocabParallelEmbedding",),
    "ex10.quantize": ("minirt.quant.formats:quantize",),
    "ex10.dequantize": ("minirt.quant.formats:dequantize",),
    # the layer is quantize, dequantize and one product: minirt's own two are no part of a solution either
    "ex10.quantized_linear": ("minirt.quant.linear:QuantizedLinear", "minirt.quant.formats:quantize",
                              "minirt.quant.formats:dequantize"),
    "ex11.greedy_accept": ("minirt.spec.acceptance:greedy_accept",),
    "ex11.rejection_sample": ("minirt.spec.acceptance:rejection_sample",),
    "ex11.rollback_block_table": ("minirt.spec.rollback:rollback_block_table",),
}

# ============================================================================== seeded extra cases (the grader's)


def _seeded(k: int, make: Callable[[], Any], show: str) -> Case:
    return Case(f"seeded case {k}", make, show)


def _extra_slot_mapping(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 5):
        B, n = rng.choice([1, 2, 3, 4, 8, 16]), rng.randint(1, 8)
        table = rng.sample(range(64), n)
        end = rng.randint(0, n * B)
        start = rng.randint(0, end)
        out.append(_seeded(k, lambda t=table, s=start, e=end, b=B: (list(t), s, e, b),
                           f"block_table={table}, start={start}, end={end}, block_size={B}"))
    return out


def _extra_split_budget(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 5):
        budget, decodes, cap = rng.randint(1, 200), rng.randint(0, 20), rng.randint(1, 64)
        remaining = [rng.randint(0, 100) for _ in range(rng.randint(0, 6))]
        out.append(_seeded(k, lambda b=budget, d=decodes, r=remaining, c=cap: (b, d, list(r), c),
                           f"budget={budget}, num_decodes={decodes}, remaining_prompts={remaining}, "
                           f"max_prefill_chunk={cap}"))
    return out


def _extra_block_hashes(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 4):
        tokens, B = [rng.randrange(1000) for _ in range(rng.randint(0, 40))], rng.randint(1, 8)
        n = rng.choice([None, rng.randint(0, 5)])
        out.append(_seeded(k, lambda t=tokens, b=B, m=n: (list(t), b, m),
                           f"token_ids={_short(tokens, 100)}, block_size={B}, num_blocks={n}"))
    return out


def _extra_left_pad(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 4):
        prompts = [[rng.randrange(100) for _ in range(rng.randint(1, 10))] for _ in range(rng.randint(1, 5))]
        pad = rng.randint(0, 50)
        out.append(_seeded(k, lambda p=prompts, q=pad: (copy.deepcopy(p), q), f"prompts={_short(prompts, 120)}, pad_id={pad}"))
    return out


def _extra_capture_sizes(rng: random.Random) -> list[Case]:
    return [_seeded(k, lambda n=n: (n,), f"max_num_seqs={n}") for k, n in
            enumerate(sorted(rng.sample(range(1, 600), 4)), 1)]


def _extra_admission(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 4):
        m = rng.randint(1, 300)
        w, d = rng.randint(0, 2 * m), rng.random() < 0.3
        out.append(_seeded(k, lambda w=w, m=m, d=d: (w, m, d), f"num_waiting={w}, max_waiting={m}, draining={d}"))
    return out


def _extra_goodput(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 3):
        results, duration = _results(rng.randrange(10**6), rng.randint(1, 60)), round(rng.uniform(0.5, 30), 2)
        ttft, tpot = round(rng.uniform(0.05, 0.6), 3), round(rng.uniform(0.005, 0.09), 4)
        out.append(_seeded(k, lambda r=results, d=duration, a=ttft, b=tpot: ([dict(x) for x in r], d, a, b),
                           f"{len(results)} results {_short(results, 160)}, duration_s={duration}, "
                           f"ttft_slo_s={ttft}, tpot_slo_s={tpot}"))
    return out


def _extra_greedy_next_token(rng: random.Random) -> list[Case]:
    out = []
    for k in range(1, 3):
        B, V, seed = rng.randint(1, 16), rng.randint(2, 200), rng.randrange(10**6)
        out.append(_seeded(k, lambda B=B, V=V, seed=seed: (_randn(B, V, seed=seed),), f"logits [{B}, {V}] random"))
    return out


#: task -> cases the grader adds, drawn from a seed the students do not have (`python -m minirt grade --seed`):
#: a table of the public cases' answers no longer scores. The notebook's check cell runs the public cases only.
EXTRA_CASES: dict[str, Callable[[random.Random], list[Case]]] = {
    "ex01.greedy_next_token": _extra_greedy_next_token,
    "ex02.left_pad": _extra_left_pad,
    "ex03.slot_mapping": _extra_slot_mapping,
    "ex04.block_hashes": _extra_block_hashes,
    "ex06.split_budget": _extra_split_budget,
    "ex07.capture_sizes": _extra_capture_sizes,
    "ex08.admission": _extra_admission,
    "ex08.goodput": _extra_goodput,
}


def extra_cases(task_id: str, seed: int, spec: Spec | None = None) -> list[Case]:
    """The seeded extra cases of a task: from `EXTRA_CASES`, or from its Spec's own generator (`Spec.extra`, for the
    tasks whose inputs are built inside their Spec); none for a task with neither."""
    make = EXTRA_CASES.get(task_id)
    if make is None:
        make = (spec if spec is not None else SPECS[task_id]()).extra
    return make(random.Random(f"{seed}:{task_id}")) if make else []


__all__ = ["CheckFailed", "Case", "REFERENCE_NAMES", "RemoteError", "SPECS", "Spec", "TASKS", "compare",
           "reference_outcome", "SimulatedAllReduce", "ToyTokenizer", "chi_square_pvalue", "device", "run_check", "simulate_ranks",
           "speculative_outcome_probs", "tiny_model",
           *(name.replace(".", "_") for name in TASKS)]
