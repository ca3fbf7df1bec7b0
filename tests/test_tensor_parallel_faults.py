"""Tensor parallelism, tests that each start their own two-rank engine (CPU, gloo; one group per process): a rank
that dies or hangs mid-generation resolves every request with an error within a bounded time (the collectives'
timeout), the other ranks are ended and nothing is left running; rank 0 dying ends the others; closing joins every
rank; the families with q/k/v biases and their own head_dim; the command line."""

from __future__ import annotations

import asyncio
import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import minirt
from conftest import random_prompts

KW = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, tensor_parallel_size=2)
LONG = minirt.SamplingParams(max_new_tokens=400, ignore_eos=True)
BOUND_S = 30                                      # every request resolves within this after the fault


@pytest.fixture(autouse=True)
def bounded():
    """End the run, with every thread's traceback, if a test hangs (a collective without its timeout blocks in C++,
    where no Python signal handler can interrupt it): a loud failure instead of a suite that never finishes."""
    faulthandler.dump_traceback_later(3 * BOUND_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _nothing_left(engine) -> None:
    group = engine.model_runner.group
    assert all(not p.is_alive() for p in group.processes)
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()


def test_a_rank_that_dies_fails_every_request_then_the_engine_refuses(tiny_models):
    async def main():
        engine = minirt.Engine(tiny_models["qwen3"], **KW)
        worker = engine.model_runner.group.processes[0]
        async with engine:
            tasks = [asyncio.ensure_future(engine.generate(p, LONG)) for p in random_prompts(1, [5, 17, 30])]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in tasks)
            start = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
            assert time.monotonic() - start < BOUND_S
            assert [o.finish_reason for o in outs] == ["error"] * 3
            assert all("rank 1 exited with code -9" in o.error for o in outs)
            stats = engine.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            _nothing_left(engine)
            await engine.restart()                             # the group is gone: a new engine is needed
            out = await engine.generate([1, 2, 3], minirt.SamplingParams(max_new_tokens=2))
            assert out.finish_reason == "error" and "build a new engine" in out.error

    asyncio.run(main())


def test_a_rank_that_hangs_fails_every_request_within_the_timeout(tiny_models, monkeypatch):
    monkeypatch.setenv("MINIRT_TP_TIMEOUT_S", "3")
    llm = minirt.LLM(tiny_models["qwen2"], **KW)
    worker = llm.engine.model_runner.group.processes[0]
    timer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGSTOP))     # hangs it mid-call
    timer.start()
    start = time.monotonic()
    outs = llm.generate(random_prompts(2, [5, 9]), LONG)
    timer.join()
    assert time.monotonic() - start < 0.5 + 3 + 10
    assert [o.finish_reason for o in outs] == ["error"] * 2
    assert all("did not answer within 3 s" in o.error for o in outs)
    _nothing_left(llm.engine)                                  # the stopped rank was killed


RANK0 = """
import sys, time
import minirt
llm = minirt.LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
print(llm.engine.model_runner.group.processes[0].pid, flush=True)
llm.generate([[1, 2, 3]], minirt.SamplingParams(max_new_tokens=2))
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_rank_zero_dying_ends_the_other_ranks(tiny_models):
    proc = subprocess.Popen([sys.executable, "-c", RANK0, tiny_models["llama"]], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        worker = int(proc.stdout.readline())
        assert _alive(worker)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + BOUND_S
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "rank 1 outlived rank 0"
    finally:
        proc.kill()


def test_close_joins_every_rank(tiny_models):
    llm = minirt.LLM(tiny_models["qwen3"], **KW)
    assert llm.generate([[4, 5, 6]], minirt.SamplingParams(max_new_tokens=3))[0].finish_reason == "length"
    runner = llm.engine.model_runner
    runner.close()
    assert [p.exitcode for p in runner.group.processes] == [0]      # stopped by the stop command, not killed
    _nothing_left(llm.engine)
    runner.close()                                             # idempotent
    out = llm.generate([[4, 5, 6]], minirt.SamplingParams(max_new_tokens=3))[0]
    assert out.finish_reason == "error" and "build a new engine" in out.error


def test_a_second_engine_in_one_process_is_refused_while_the_first_lives(tiny_models):
    llm = minirt.LLM(tiny_models["qwen3"], **KW)
    try:
        with pytest.raises(RuntimeError, match="already holds a torch.distributed group"):
            minirt.LLM(tiny_models["qwen3"], **KW)
        assert llm.generate([[4, 5, 6]], minirt.SamplingParams(max_new_tokens=2))[0].finish_reason == "length"
    finally:
        llm.engine.model_runner.close()
    _nothing_left(llm.engine)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_two_ranks_equal_transformers_with_qkv_bias_and_own_head_dim(tiny_models, hf_greedy_fn, family):
    path = tiny_models[family]
    prompts = random_prompts(12, [7, 19, 2, 33])
    llm = minirt.LLM(path, **{**KW, "max_prefill_chunk": 8})
    try:
        outs = llm.generate(prompts, minirt.SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert [o.token_ids for o in outs] == [hf_greedy_fn(path, p, 12) for p in prompts]
    finally:
        llm.engine.model_runner.close()
    _nothing_left(llm.engine)


def test_cli_generate_with_two_ranks_prints_the_one_process_text(default_model):
    prompt = "Shall I compare thee"
    proc = subprocess.run([sys.executable, "-m", "minirt", "generate", prompt, "--device", "cpu", "--max-new-tokens",
                           "12", "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = minirt.LLM(default_model, device="cpu").generate(prompt, minirt.SamplingParams(max_new_tokens=12))
    assert proc.stdout == prompt + expected[0].text + "\n"


def test_the_server_over_two_ranks_answers_as_one_process(default_model, default_llm):
    """`minirt.serve` on a TP engine (rank 0's steps run on the server's thread): plain and streamed completions equal
    one process's `LLM.generate`."""
    openai = pytest.importorskip("openai")
    from minirt.serve.server import BackgroundServer

    prompts = ["ROMEO:", "To be, or not to be, that is"]
    want = default_llm.generate(prompts, minirt.SamplingParams(max_new_tokens=16))
    engine = minirt.Engine(default_model, device="cpu", dtype="float32", tensor_parallel_size=2)
    bg = BackgroundServer(engine)
    url = bg.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt, w in zip(prompts, want):
            r = client.completions.create(model="default_model", prompt=prompt, max_tokens=16, temperature=0)
            assert r.choices[0].text == w.text
            chunks = client.completions.create(model="default_model", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
    finally:
        bg.stop()
        engine.model_runner.close()
    _nothing_left(engine)
