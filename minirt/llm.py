"""`LLM`: the synchronous front door - a list of prompts in, a list of outputs out (vLLM's `LLM` class).

It owns one `Engine` and, for each `generate` call, runs the engine's event loop until every
request is done. Inside Jupyter (where a loop is already running) the loop runs on a helper thread.
"""

from __future__ import annotations

import asyncio
import os
import threading

from minirt.engine import DEFAULT_MODEL, Engine
from minirt.request import RequestOutput
from minirt.sampling import SamplingParams


def run_sync(coro):
    """Run a coroutine to completion from synchronous code, even under a running event loop.

    Under a running loop (Jupyter) the coroutine gets its own loop on a helper thread; an interrupt
    (Ctrl-C, Jupyter's "interrupt kernel") cancels it there, which aborts its requests between two
    engine steps, and is then re-raised here.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    outcome: dict = {}
    done = threading.Event()   # not Thread.join: an interrupted join() can leave the thread marked stopped

    def run():
        try:
            outcome["result"] = loop.run_until_complete(task)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = e
        finally:
            loop.close()
            done.set()

    threading.Thread(target=run, name="minirt-llm", daemon=True).start()
    try:
        while not done.wait(0.05):
            pass
    except KeyboardInterrupt:
        loop.call_soon_threadsafe(task.cancel)
        done.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def normalize_prompts(prompts) -> list:
    """str | list[str] | list[int] | list[list[int]] -> a list of prompts. Raises ValueError otherwise."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]          # one prompt given as token ids
        return list(prompts)
    raise ValueError(f"prompts: must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")


class LLM:
    """Offline batch generation over one `Engine` (see `minirt.Engine` and `minirt.config.EngineConfig`
    for what each setting means). Raises ValueError naming the field for a bad setting."""

    def __init__(self, model: str | os.PathLike = DEFAULT_MODEL, *, device=None, dtype=None, block_size: int = 16,
                 num_kv_blocks: int | None = None, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_prefill_chunk: int = 1024, max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 attention_backend: str = "auto", split_kv: bool = True, enforce_eager: bool = False,
                 fused_ops: bool | None = None, merge_projections: bool | None = None, gemv: bool | None = None,
                 num_scheduler_steps: int | None = None, norm_in_gemv: bool | None = None,
                 rotary_kernel: bool | None = None, pdl: bool | None = None,
                 kv_write_in_rotary: bool | None = None, combine_in_attention: bool = False,
                 prefetch_kv: bool | None = None, l2_prefetch: bool | None = None):
        self.engine = Engine(model, device=device, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_prefill_chunk=max_prefill_chunk, max_model_len=max_model_len,
                             enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
                             split_kv=split_kv, enforce_eager=enforce_eager, fused_ops=fused_ops,
                             merge_projections=merge_projections, gemv=gemv, num_scheduler_steps=num_scheduler_steps,
                             norm_in_gemv=norm_in_gemv, rotary_kernel=rotary_kernel, pdl=pdl,
                             kv_write_in_rotary=kv_write_in_rotary, combine_in_attention=combine_in_attention,
                             prefetch_kv=prefetch_kv, l2_prefetch=l2_prefetch)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns one `RequestOutput` per prompt, in prompt order.

        sampling_params: one for all prompts, or a list with one per prompt. Every request is validated
        before any runs, so a bad one raises ValueError (naming the field) and nothing is submitted.
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
        for prompt, p in zip(prompts, params):
            self.engine.validate(prompt, p)

        async def run_all():
            async with self.engine:
                return await asyncio.gather(*(self.engine.generate(pr, p) for pr, p in zip(prompts, params)))

        return list(run_sync(run_all()))
