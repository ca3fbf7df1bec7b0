"""Multi-step decode (EngineConfig.num_scheduler_steps, chapter 07): several decode steps per schedule, each
step's tokens fed to the next on the device, give exactly the tokens of single steps.

Oracle: transformers greedy (conftest.hf_greedy); for seeded sampling, the same engine with single steps
(the draws of each request's generator must come in the same order). Both paths run on the CPU: the eager
forward, and the static buffers of `DecodeGraphs(capture=False)`; on CUDA the captured graphs run too.
"""

import asyncio
import random

import pytest
import torch

import minirt
from conftest import hf_greedy, hold_the_gpu_after, random_prompts
from test_cuda_graphs import padded_engine

KW = dict(device="cpu", dtype=torch.float32, block_size=4)


def greedy(n, **kw):
    return minirt.SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def spy_on_bursts(llm) -> list[int]:
    """Record the step count of every burst launched (`start_decode_steps`, which `execute_decode_steps` calls,
    and `continue_decode_steps`), and check the scheduler after every step. The list's `continued` attribute
    holds the counts of the bursts launched before the one before them was taken (overlap scheduling)."""
    counts = Counts()
    runner = llm.engine.model_runner
    start, cont = runner.start_decode_steps, runner.continue_decode_steps

    def starting(items, num_steps):
        counts.append(num_steps)
        return start(items, num_steps)

    def continuing(burst, num_steps):
        counts.append(num_steps)
        counts.continued.append(num_steps)
        return cont(burst, num_steps)

    runner.start_decode_steps, runner.continue_decode_steps = starting, continuing
    llm.engine.step_callbacks.append(lambda engine, batch: engine.scheduler.check_invariants())
    return counts


class Counts(list):
    def __init__(self):
        super().__init__()
        self.continued = []


OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])


def build(path, how, steps, overlap=True, **kw):
    if how == "eager":
        return minirt.LLM(model=path, **KW, num_scheduler_steps=steps, overlap_scheduling=overlap, **kw)
    return padded_engine(path, num_scheduler_steps=steps, overlap_scheduling=overlap, **kw)  # the graphs' buffers


@OVERLAP
@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_multi_step_equals_transformers(tiny_model_path, how, overlap):
    llm = build(tiny_model_path, how, 4, overlap, max_num_seqs=8)
    bursts = spy_on_bursts(llm)
    rng = random.Random(3)
    prompts = random_prompts(21, [rng.randint(1, 14) for _ in range(6)])
    ns = [1, 2, 5, 9, 11, 14]                         # requests end part-way through bursts
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
        assert o.finish_reason == "length"
    assert bursts and max(bursts) == 4 and min(bursts) >= 2, bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_advance_decode_inputs_against_a_loop(compiled):
    """`advance_decode_inputs`, eager and compiled as the runner runs it with fused ops (`minirt.fast.ops.fused`),
    against a Python loop over the rows; on views of larger buffers, as a decode graph's static inputs are, and
    for several steps in a row (each step's tokens new, the slots looked up in the block tables)."""
    from minirt.fast.ops import fused
    from minirt.fast.runner import advance_decode_inputs

    advance = fused(advance_decode_inputs) if compiled else advance_decode_inputs
    rng, B, W = random.Random(4), 4, 9
    for n in (1, 3, 37):
        tables = [[rng.randrange(500) for _ in range(W)] for _ in range(40)]
        pos = [rng.randrange(B * W - 4) for _ in range(40)]
        state = {"ids": [0] * 40, "pos": pos, "ctx": [p + 1 for p in pos], "slots": [0] * 40}
        dev = {k: torch.tensor(v) for k, v in state.items()}
        views = [dev["ids"][:n], dev["pos"][:n], dev["slots"][:n], dev["ctx"][:n], torch.tensor(tables)[:n]]
        for _ in range(3):
            nxt = [rng.randrange(1000) for _ in range(n)]
            advance(torch.tensor(nxt), *views, B)
            for s in range(n):
                state["ids"][s] = nxt[s]
                state["pos"][s] += 1
                state["ctx"][s] += 1
                p = state["pos"][s]
                state["slots"][s] = tables[s][p // B] * B + p % B
            for k in state:
                assert dev[k].tolist() == state[k], (n, k)        # rows past n untouched too


def test_bursts_with_the_compiled_advance_equal_transformers(tiny_model_path):
    """With fused ops the runner moves a burst's inputs on with the compiled `advance_decode_inputs`."""
    from minirt.fast.runner import advance_decode_inputs

    llm = build(tiny_model_path, "eager", 4, max_num_seqs=8, fused_ops=True)
    runner = llm.engine.model_runner
    compiled, calls = runner.advance, []
    assert compiled is not advance_decode_inputs
    runner.advance = lambda *args: calls.append(len(args[0])) or compiled(*args)
    bursts = spy_on_bursts(llm)
    prompts = random_prompts(23, [3, 8, 5])
    outs = llm.generate(prompts, [greedy(n) for n in (9, 12, 6)])
    for p, o, n in zip(prompts, outs, (9, 12, 6)):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n)
    assert bursts and max(bursts) == 4, bursts
    # every step of a burst but the first of one started afresh (a continued burst's first comes from the last's)
    assert len(calls) == sum(bursts) - (len(bursts) - len(bursts.continued)), (calls, bursts, bursts.continued)
    assert build(tiny_model_path, "eager", 4, max_num_seqs=8).engine.model_runner.advance is advance_decode_inputs


@OVERLAP
@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_a_stop_part_way_through_a_burst(tiny_models, how, overlap):
    """A request that hits a stop token in the middle of a burst ends there (the later tokens are dropped, its
    blocks freed) while the other request of the burst carries on unchanged. With overlap scheduling the next
    burst is already running when the stop is found: its tokens for the stopped request are dropped too, and the
    one after it is scheduled afresh."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(22, [6, 9])
    full = hf_greedy(path, prompts[0], 16)
    j = next(i for i in range(2, 9) if full[i] not in full[:i])      # tokens 1..8 come from the first burst
    llm = build(path, how, 8, overlap, max_num_seqs=4)
    bursts = spy_on_bursts(llm)
    outs = llm.generate(prompts, [greedy(16, stop_token_ids=[full[j]]), greedy(20)])
    assert outs[0].token_ids == full[:j + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == hf_greedy(path, prompts[1], 20)
    assert bursts[0] == 8 and bursts.continued[:1] == ([8] if overlap else []), bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@OVERLAP
@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_overlap_launches_the_next_burst_before_taking_tokens(tiny_models, how, overlap):
    """Requests that all have tokens to go: with overlap scheduling every burst after the first is launched from
    the device state the one before left (`continue_decode_steps`), and the tokens are transformers' still; the
    last burst is cut to the tokens left, and none runs past a request's max_new_tokens."""
    path = tiny_models["llama"]
    prompts = random_prompts(27, [5, 11, 3])
    llm = build(path, how, 4, overlap, max_num_seqs=4)
    bursts = spy_on_bursts(llm)
    outs = llm.generate(prompts, [greedy(20)] * 3)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, 20)
    assert bursts == [4, 4, 4, 4, 3] and bursts.continued == ([4, 4, 4, 3] if overlap else []), bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@OVERLAP
@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_bursts_run_past_a_request_that_ends(tiny_models, how, overlap):
    """Requests that end one after another (max_new_tokens 3, 6, ..., 18): the bursts go on past each one's last
    token (its row's later tokens are dropped, as after a stop) instead of shrinking to the fewest tokens any
    request has left, which would turn them into single steps; every request gets transformers' tokens, no more."""
    path = tiny_models["qwen3"]
    prompts = random_prompts(29, [4, 7, 2, 9, 5, 3])
    ns = [3, 6, 9, 12, 15, 18]
    llm = build(path, how, 4, overlap, max_num_seqs=8)
    bursts = spy_on_bursts(llm)
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(path, p, n), f"n={n}"
        assert o.finish_reason == "length"
    # 17 decode steps after the prefill's token: four bursts of 4, then one single step (a burst needs 2 or more);
    # with overlap, the burst after the one in which a request ends is scheduled afresh, not continued
    assert bursts == [4, 4, 4, 4] and bursts.continued == ([4, 4] if overlap else []), bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@OVERLAP
@pytest.mark.parametrize("how", ["eager", "static buffers"])
def test_bursts_stop_at_max_model_len(tiny_models, how, overlap):
    """A request that ends at max_model_len takes no surplus steps past it (its block table cannot grow past
    max_model_len / block_size blocks, the static buffers' width), though a longer-running request still has tokens
    to go: the bursts shrink to the positions it has left, and both requests get transformers' tokens."""
    path = tiny_models["llama"]
    at_limit, short = random_prompts(30, [14, 3])
    llm = build(path, how, 4, overlap, max_num_seqs=4, max_model_len=24)
    bursts = spy_on_bursts(llm)
    outs = llm.generate([at_limit, short], [greedy(10), greedy(20)])
    assert outs[0].token_ids == hf_greedy(path, at_limit, 10)
    assert outs[1].token_ids == hf_greedy(path, short, 20)
    # at_limit's 9 decode tokens: 4, 4, then the 2 positions it has left (one surplus); short's go on by 4
    assert bursts == [4, 4, 2, 4, 4] and bursts.continued == ([4, 2, 4] if overlap else []), bursts
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@OVERLAP
def test_arrivals_and_aborts_while_a_burst_is_in_flight(tiny_models, overlap):
    """A request that arrives, and one that is aborted, while bursts run (with overlap, while the next burst is
    already launched): the running request's tokens stay transformers', the newcomer's too, the aborted one ends
    with "abort", the bookkeeping holds after every step and every block is free at the end."""
    path = tiny_models["llama"]
    pa, pb, pc = random_prompts(28, [6, 4, 9])

    async def main():
        async with minirt.Engine(model=path, **KW, num_scheduler_steps=4, overlap_scheduling=overlap,
                                 max_num_seqs=4) as engine:
            engine.step_callbacks.append(lambda e, batch: e.scheduler.check_invariants())
            ids, later = [], []
            async for delta in engine.stream(pa, greedy(40)):
                ids.extend(delta.token_ids)
                if len(ids) >= 6 and not later:
                    later = [asyncio.ensure_future(engine.generate(pb, greedy(12))),
                             asyncio.ensure_future(engine.generate(pc, greedy(40), request_id="c"))]
                elif later and len(ids) >= 20 and engine.abort("c"):
                    pass
            b, c = await asyncio.gather(*later)
            return ids, b, c, engine.stats()

    ids, b, c, stats = asyncio.run(main())
    assert ids == hf_greedy(path, pa, 40)
    assert b.token_ids == hf_greedy(path, pb, 12) and b.finish_reason == "length"
    assert c.finish_reason == "abort" and c.token_ids == hf_greedy(path, pc, len(c.token_ids))
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_streamed_bursts_concatenate(tiny_models):
    path = tiny_models["llama"]
    prompt = random_prompts(23, [7])[0]

    async def main():
        async with minirt.Engine(model=path, **KW, num_scheduler_steps=4) as engine:
            ids, deltas = [], []
            async for delta in engine.stream(prompt, greedy(10)):
                deltas.append(delta)
                ids.extend(delta.token_ids)
            return ids, deltas

    ids, deltas = asyncio.run(main())
    assert ids == hf_greedy(path, prompt, 10)
    assert len(deltas) >= 3 and deltas[-1].finish_reason == "length"


def test_seeded_sampling_draws_as_with_single_steps(tiny_models):
    path = tiny_models["qwen2"]
    prompts = random_prompts(24, [5, 8, 3])
    params = [minirt.SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.9, top_k=20, seed=s)
              for s in (1, 2, 3)]
    single = minirt.LLM(model=path, **KW, num_scheduler_steps=1).generate(prompts, params)
    llm = minirt.LLM(model=path, **KW, num_scheduler_steps=4)
    bursts = spy_on_bursts(llm)
    multi = llm.generate(prompts, params)
    assert [o.token_ids for o in multi] == [o.token_ids for o in single]
    assert bursts


def test_bursts_wait_for_admission(tiny_models):
    """While a request waits or prefills, steps stay single: a burst would delay its first token."""
    path = tiny_models["llama"]
    llm = build(path, "eager", 8, max_num_seqs=1)          # one seat: the second request waits for the first
    bursts = spy_on_bursts(llm)
    seen = []
    llm.engine.step_callbacks.append(
        lambda engine, batch: seen.append((len(engine.waiting_queue), engine.num_steps)))
    prompts = random_prompts(25, [5, 6])
    outs = llm.generate(prompts, [greedy(6), greedy(6)])
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, 6)
    # while the second request waited, every engine step advanced num_steps by exactly one
    waiting_steps = [n for (w, n), (_, before) in zip(seen[1:], seen) if w and n - before != 1]
    assert not waiting_steps and bursts == [5], (seen, bursts)


def test_default_and_bad_values(tiny_models):
    assert minirt.LLM(model=tiny_models["llama"], **KW).engine.plan.num_scheduler_steps == 1   # no graphs: off
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            minirt.LLM(model=tiny_models["llama"], **KW, num_scheduler_steps=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_multi_step_through_cuda_graphs(tiny_model_path):
    llm = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=16,
                     num_kv_blocks=1024)
    assert llm.engine.plan.num_scheduler_steps == 8                   # the default with graphs
    bursts = spy_on_bursts(llm)
    rng = random.Random(11)
    prompts = random_prompts(26, [rng.randint(1, 30) for _ in range(12)])
    ns = [rng.randint(1, 40) for _ in prompts]
    outs = llm.generate(prompts, [greedy(n) for n in ns])
    for p, o, n in zip(prompts, outs, ns):
        assert o.token_ids == hf_greedy(tiny_model_path, p, n), f"prompt len {len(p)}, n={n}"
    assert 8 in bursts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_taking_a_bursts_tokens_does_not_wait_for_the_next_burst(tiny_model_path):
    """Overlap scheduling launches the next burst before it takes the tokens of the one in flight: taking them must
    wait for that burst only, so that the host's work on them runs while the GPU runs the next. Here the GPU is
    kept busy for about a second (`torch.cuda._sleep`) right after the first burst launched from the one before;
    `finish_decode_steps` of the one before must return while the sleep still runs (an event after it not yet
    reached). A read of the tokens queued when they are taken would come after the sleep and fail this."""
    llm = minirt.LLM(model=tiny_model_path, device="cuda", dtype=torch.float32, block_size=4, max_num_seqs=4,
                     num_kv_blocks=256)
    assert llm.engine.plan.overlap_scheduling
    seen = hold_the_gpu_after(llm.engine.model_runner, "continue_decode_steps", "finish_decode_steps")
    prompts = random_prompts(31, [6, 3, 9])
    outs = llm.generate(prompts, [greedy(30)] * 3)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_model_path, p, 30)
    assert seen == [False], "taking the burst's tokens waited for the work launched after it"
