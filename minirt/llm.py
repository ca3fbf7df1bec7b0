"""The front doors: `LLM`, the synchronous one - a list of prompts in, a list of outputs out (vLLM's `LLM` class) -
and `Engine`, which builds the asyncio engine for a set of settings (`minirt.LLM` and `minirt.Engine`).

`LLM` owns one engine and drives its steps itself, in the calling thread, until every request of a `generate`
call is done (nano-vllm's `LLMEngine.generate` loop): no event loop and no helper thread, so it runs the same in
a script and inside a running Jupyter kernel. An interrupt (Ctrl-C, Jupyter's "interrupt kernel") aborts the
call's requests, frees their blocks and is raised again, between two steps.

The engine built is the full one: chapter 07's `minirt.fast.FastEngine`, or chapter 09's
`minirt.parallel.TensorParallelEngine` when `tensor_parallel_size > 1`. Both are chapter 05's
`minirt.engine.Engine`, built on; their packages are imported when the first engine is built, not by `import minirt`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from minirt.config import EngineConfig, takes_settings
from minirt.engine import DEFAULT_MODEL
from minirt.request import RequestOutput
from minirt.sampling import SamplingParams


def normalize_prompts(prompts) -> list:
    """str | list[str] | list[int] | list[list[int]] -> a list of prompts. Raises ValueError otherwise."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]          # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts: must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")


@takes_settings
def Engine(model: str | os.PathLike = DEFAULT_MODEL, **settings) -> "minirt.engine.Engine":
    """`minirt.Engine`: the asyncio engine for `model` (a checkpoint directory or hub id) and `settings` (the
    fields of `minirt.config.EngineConfig`): a `minirt.fast.FastEngine` (the plan's speedups, `engine.plan`), or
    with `tensor_parallel_size > 1` a `minirt.parallel.TensorParallelEngine` (one process per rank). Either is a
    `minirt.engine.Engine`. Raises ValueError naming the field for a bad or unknown setting, or one that cannot run
    here (before the model loads)."""
    if EngineConfig.from_settings(settings).tensor_parallel_size > 1:
        from minirt.parallel.engine import TensorParallelEngine as engine_class
    else:
        from minirt.fast.engine import FastEngine as engine_class
    return engine_class(model, **settings)


class LLM:
    """Offline batch generation over one `Engine`. `model`: a checkpoint directory or hub id; `settings`: the
    fields of `minirt.config.EngineConfig`. Raises ValueError naming the field for a bad or unknown setting."""

    @takes_settings
    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, **settings):
        self.engine = Engine(model, **settings)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns one `RequestOutput` per prompt, in prompt order.

        prompts: text, tokenized as the checkpoint's tokenizer does by default (`tokenizer(text)`, a BOS
        included if it adds one, as in vLLM), or lists of token ids, taken as they are.
        sampling_params: one for all prompts, or a list with one per prompt. Every request is validated
        before any runs, so a bad one raises ValueError (naming the field) and nothing is submitted. A failed
        step (device out of memory, say) ends every request of the call with finish_reason "error", as in the
        asyncio engine. Raises RuntimeError if the engine's asyncio loop is running (use `Engine.generate` there).
        """
        prompts = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            raise ValueError("sampling_params: must be a minirt.SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        engine = self.engine
        if engine._loop_task is not None:
            raise RuntimeError("LLM.generate: the engine's asyncio loop is running; use `await engine.generate(...)`")
        checked = [engine.validate(prompt, p) for prompt, p in zip(prompts, params)]     # (text, ids, params)
        requests = []
        try:
            with interrupts_between_steps() as interrupted:
                for text, ids, p in checked:
                    requests.append(engine._enqueue(text, ids, p))
                while not interrupted():
                    if all(r.is_finished for r in requests):
                        break
                    if not engine.step_fn():  # validated requests always fit: no progress is a bug, never a wait
                        raise RuntimeError("the scheduler could not schedule any of the requests it holds")
                else:
                    raise KeyboardInterrupt
        except Exception as e:                # noqa: BLE001 - any failure must resolve every request
            engine._fail_all(e)
        except BaseException:                 # KeyboardInterrupt: abort this call's requests, then raise
            for request in requests:
                engine.abort(request.request_id, "interrupted")
            raise
        finally:
            engine._failure = None            # the next call starts afresh, as `async with engine` does
        return [r.output() for r in requests]


@contextlib.contextmanager
def interrupts_between_steps():
    """Hold a SIGINT (Ctrl-C, Jupyter's "interrupt kernel") until the engine step under way has finished, then raise
    KeyboardInterrupt there: an interrupt in the middle of a step could leave a block allocated to nobody. A second
    SIGINT while the first waits is raised at once. Only in the main thread (where Python delivers signals)."""
    pending: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield lambda: False
        return
    previous = signal.default_int_handler if previous is None else previous

    def hold(signum, frame):
        pending.append(signum)
        signal.signal(signal.SIGINT, previous)             # a second Ctrl-C acts at once

    signal.signal(signal.SIGINT, hold)
    try:
        yield lambda: bool(pending)
    finally:
        signal.signal(signal.SIGINT, previous)
