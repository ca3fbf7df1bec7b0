"""The exercise system: solutions pass nbval, the distributed exercises fail every graded check,
exercises/ is what tools/make_exercises.py generates, and every checker catches wrong implementations
with a message that names the case."""

from __future__ import annotations

import copy
import functools
import importlib.util
import pkgutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from minirt.course import checks
from minirt.course.checks import CheckFailed

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("ex[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("ex[0-9][0-9]_*.ipynb"))


def _load_make_exercises():
    spec = importlib.util.spec_from_file_location("make_exercises", ROOT / "tools" / "make_exercises.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nbval():
    import ipykernel  # noqa: F401  (the notebook tests need the notebooks extra: pip install -e '.[notebooks]')
    import nbval  # noqa: F401


# ---------------------------------------------------------------------------------------- the notebooks


def test_six_exercises_with_at_least_two_graded_tasks_each():
    import nbformat
    names = [p.name for p in SOLUTIONS]
    assert [n[:4] for n in names] == ["ex01", "ex02", "ex03", "ex04", "ex05", "ex06", "ex07", "ex08", "ex09",
                                     "ex10", "ex11"], names
    assert [p.name for p in EXERCISES] == names
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        tasks = [c.metadata["minirt"]["task"] for c in nb.cells if "task" in c.metadata.get("minirt", {})]
        assert len(tasks) >= 2, path.name
        assert all(t in checks.TASKS for t in tasks), tasks


def test_solutions_pass_nbval():
    """Every cell of every solution notebook runs, and its output equals the stored one (no --nbval-lax)."""
    _nbval()
    cmd = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p", "no:cacheprovider", "-q",
           "-o", "addopts=", "--nbval-cell-timeout", "300", *map(str, SOLUTIONS)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_exercises_are_generated_from_solutions():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_exercises.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_graded_cell_of_the_distributed_exercises_fails():
    """The starter notebooks are not already solutions: with the stubs, every check cell fails."""
    _nbval()
    from minirt.course import grading

    rows = grading.grade(EXERCISES, timeout=300, verbose=False)
    for row in rows:
        assert row["exercise"] is not None and row["max"] >= 2, row
        assert row["total"] == 0, row
        assert len(row["scores"]) >= 2
        for task in row["scores"]:
            assert row["notes"][task] == "task not implemented yet", (row["submission"], task, row["notes"])


# ---------------------------------------------------------------------------------------- the generator


def test_generator_replaces_solution_regions_and_keeps_check_outputs():
    import nbformat
    mk = _load_make_exercises()
    src = ("class A:\n    def f(self):\n        \"\"\"Doc.\"\"\"\n        ### BEGIN SOLUTION\n        return 1\n"
           "        ### END SOLUTION\n\n    def g(self):\n    ### BEGIN SOLUTION\n        return 2\n"
           "    ### END SOLUTION\n")
    out, n = mk.strip_solutions(src)
    assert n == 2
    assert out == ("class A:\n    def f(self):\n        \"\"\"Doc.\"\"\"\n        raise NotImplementedError("
                   "\"write your solution here\")\n\n    def g(self):\n    raise NotImplementedError("
                   "\"write your solution here\")\n")
    with pytest.raises(mk.MarkerError):
        mk.strip_solutions("### BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(mk.MarkerError):
        mk.strip_solutions("x = 1\n### END SOLUTION\n")

    nb = nbformat.read(SOLUTIONS[2], as_version=4)
    ex = mk.make_exercise(nb)
    assert mk.dumps(ex) == mk.dumps(mk.make_exercise(copy.deepcopy(nb)))          # deterministic
    for sol_cell, ex_cell in zip(nb.cells, ex.cells):
        if "task" in sol_cell.metadata.get("minirt", {}):
            assert ex_cell.outputs == sol_cell.outputs and ex_cell.outputs            # PASS line kept
            assert ex_cell.execution_count is not None                             # nbval compares it
        elif "### BEGIN SOLUTION" in sol_cell.source:
            assert ex_cell.outputs == [] and ex_cell.execution_count is None
            assert "### BEGIN SOLUTION" not in ex_cell.source
            assert ex_cell.source.split("\n")[0] == sol_cell.source.split("\n")[0]   # the signature stays


def test_generator_check_mode_names_the_stale_file(tmp_path):
    mk = _load_make_exercises()
    out = tmp_path / "exercises"
    assert mk.main(["--exercises", str(out)]) == 0
    assert mk.main(["--exercises", str(out), "--check"]) == 0
    stale = out / EXERCISES[0].name
    stale.write_text(stale.read_text().replace("raise NotImplementedError", "pass  # "))
    assert mk.main(["--exercises", str(out), "--check"]) == 1


def test_instructor_files_are_never_exercises_nor_handed_out(tmp_path):
    """solutions/README.md (the instructor's guide) and solutions/answers/ (the chapters' answers) beside the
    solution notebooks: the generator writes only exNN notebooks, the grader reads only those, and
    `exercise start` copies one exercise notebook and nothing else."""
    import shutil

    from minirt.course import grading, work

    mk = _load_make_exercises()
    sol, out, dest = tmp_path / "solutions", tmp_path / "exercises", tmp_path / "work"
    (sol / "answers").mkdir(parents=True)
    shutil.copy(SOLUTIONS[0], sol / SOLUTIONS[0].name)
    (sol / "README.md").write_text("# Instructor's guide\n")
    (sol / "answers" / "ch01.md").write_text("# Answers\n")
    (sol / "answers" / "ex99_answers.ipynb").write_text("{}")        # not at the top level: never read
    assert mk.main(["--solutions", str(sol), "--exercises", str(out)]) == 0
    assert sorted(p.name for p in out.rglob("*")) == [SOLUTIONS[0].name]
    assert list(grading.load_specs(sol)) == [SOLUTIONS[0].name[:4]]
    copy = work.start(SOLUTIONS[0].name[:4], dest, out)
    assert sorted(p.name for p in dest.rglob("*")) == [copy.name] == [SOLUTIONS[0].name]
    for name in ("README", "answers", "ch01"):
        with pytest.raises(ValueError, match="no exercise"):
            work.start(name, dest, out)
    assert (ROOT / "solutions" / "README.md").is_file(), "the instructor's guide is missing"


# ---------------------------------------------------------------------------------------- the checkers

REFERENCES = {
    "ex01.greedy_next_token": lambda logits: logits.argmax(-1),
    "ex01.naive_generate": "minirt.generate:naive_generate",
    "ex02.left_pad": "minirt.generate:left_pad",
    "ex02.kv_cache_generate": "minirt.generate:kv_cache_generate",
    "ex03.slot_mapping": "minirt.kv.paged_cache:slot_mapping",
    "ex03.block_pool": "minirt.kv.block_pool:BlockPool",
    "ex03.paged_attention": "minirt.attention:paged_attention_reference",
    "ex04.block_hashes": "minirt.kv.prefix_cache:block_hashes",
    "ex04.match": lambda cache, prompt: cache.match(prompt),
    "ex05.try_allocate": lambda scheduler, request: scheduler.try_allocate(request),
    "ex05.append_token": lambda request, token, now: request.append_token(token, now),
    "ex06.split_budget": "minirt.scheduler:split_budget",
    "ex06.schedule": lambda scheduler: scheduler.schedule(),
    "ex07.capture_sizes": "minirt.fast.cuda_graphs:capture_sizes",
    "ex07.combine_splits": "minirt.fast.attention:combine_splits",
    "ex08.delta_chunks": "minirt.serve.protocol:delta_chunks",
    "ex08.admission": "minirt.serve.app:admission",
    "ex08.goodput": "minirt.serve.bench:goodput",
    "ex09.column_parallel": "minirt.parallel.sharding:column_parallel",
    "ex09.row_parallel": "minirt.parallel.sharding:RowParallelLinear",
    "ex09.vocab_parallel_embedding": "minirt.parallel.sharding:VocabParallelEmbedding",
    "ex10.quantize": "minirt.quant.formats:quantize",
    "ex10.dequantize": "minirt.quant.formats:dequantize",
    "ex10.quantized_linear": lambda linear, method: pkgutil.resolve_name(
        "minirt.quant.linear:QuantizedLinear").from_linear(linear, method),
    "ex11.greedy_accept": "minirt.spec.acceptance:greedy_accept",
    "ex11.rejection_sample": "minirt.spec.acceptance:rejection_sample",
    "ex11.rollback_block_table": "minirt.spec.rollback:rollback_block_table",
}


def _resolve(ref):
    if callable(ref):
        return ref
    return pkgutil.resolve_name(ref)


@pytest.mark.parametrize("task", sorted(checks.TASKS))
def test_reference_passes_with_exactly_one_line(task, capsys):
    checks.TASKS[task](_resolve(REFERENCES[task]))
    out = capsys.readouterr()
    assert out.err == ""
    lines = out.out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"PASS {task} (")
    k = lines[0].split("(")[1].split("/")[0]
    assert lines[0] == f"PASS {task} ({k}/{k} cases)" and int(k) >= 8


@pytest.mark.parametrize("task", sorted(checks.TASKS))
def test_stub_fails_with_not_implemented(task, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("write your solution here")

    with pytest.raises(CheckFailed, match="task not implemented yet"):
        checks.TASKS[task](stub)
    assert capsys.readouterr().out == ""


def _wrong_block_pool():
    from minirt.kv import Block

    class LIFOPool:                      # hands out the most recently freed block first
        def __init__(self, n):
            if n < 1:
                raise ValueError("num_blocks")
            self.blocks = [Block(i) for i in range(n)]
            self.free = OrderedDict((i, None) for i in range(n))

        @property
        def num_free_blocks(self):
            return len(self.free)

        def allocate(self):
            if not self.free:
                raise RuntimeError("empty")
            b, _ = self.free.popitem(last=True)
            self.blocks[b].ref_count = 1
            return b

        def acquire(self, b):
            if self.blocks[b].ref_count == 0:
                del self.free[b]
            self.blocks[b].ref_count += 1

        def release(self, b):
            if self.blocks[b].ref_count <= 0:
                raise RuntimeError("over-release")
            self.blocks[b].ref_count -= 1
            if self.blocks[b].ref_count == 0:
                self.free[b] = None
    return LIFOPool


def _match_without_last_token_rule(cache, prompt):
    from minirt.kv.prefix_cache import block_hashes

    if not cache.enabled:
        return []
    B, out = cache.block_size, []
    for i, h in enumerate(block_hashes(prompt, B)):
        b = cache.pool.cached.get(h)
        if b is None or cache.pool.blocks[b].token_ids != tuple(prompt[i * B:(i + 1) * B]):
            break
        out.append(b)
    return out


def _try_allocate_ignoring_revived_hits(scheduler, request):
    from minirt.config import cdiv

    pool, B = scheduler.pool, scheduler.config.block_size
    hits = scheduler.prefix_cache.match(request.token_ids)
    total = cdiv(len(request.token_ids), B)
    watermark = scheduler.watermark_blocks if (scheduler.prefilling_requests or scheduler.running_requests) else 0
    if total - len(hits) > pool.num_free_blocks - watermark:       # forgets that free hits are in the free list
        return False
    for b in hits:
        pool.acquire(b)
    request.block_table = hits + [pool.allocate() for _ in range(total - len(hits))]
    request.num_computed_tokens = request.num_cached_tokens = len(hits) * B
    request.num_registered_blocks = len(hits)
    request.num_prefill_tokens = len(request.token_ids)
    scheduler.prefix_cache.record(len(request.token_ids), request.num_cached_tokens)
    return True


def _append_token_length_before_stop(request, token_id, now):
    request.append_token(token_id, now)
    if request.num_output_tokens >= request.params.max_new_tokens:
        request.finish_reason = "length"


def _schedule_letting_small_requests_overtake(scheduler):
    """Wrong: a waiting request that does not fit is skipped, and the ones behind it are admitted."""
    from minirt.request import RequestStatus
    from minirt.scheduler import ScheduledBatch, split_budget

    cfg, batch, i = scheduler.config, ScheduledBatch(), 0
    while i < len(scheduler.running_requests) and batch.num_decodes < cfg.max_num_batched_tokens:
        request = scheduler.running_requests[i]
        if scheduler.ensure_decode_slot(request):
            batch.items.append((request, 1))
            batch.num_decodes += 1
            i += 1
    _, chunks = split_budget(cfg.max_num_batched_tokens, batch.num_decodes,
                             [r.num_prefill_tokens - r.num_computed_tokens for r in scheduler.prefilling_requests],
                             cfg.max_prefill_chunk)
    batch.items += [(r, n) for r, n in zip(scheduler.prefilling_requests, chunks) if n > 0]
    budget = cfg.max_num_batched_tokens - batch.num_tokens
    for request in list(scheduler.waiting_queue):
        if budget <= 0 or len(scheduler.prefilling_requests) + len(scheduler.running_requests) >= cfg.max_num_seqs:
            break
        if not scheduler.try_allocate(request):
            continue
        scheduler.waiting_queue.remove(request)
        request.status = RequestStatus.PREFILLING
        scheduler.prefilling_requests.append(request)
        n = min(request.num_prefill_tokens - request.num_computed_tokens, cfg.max_prefill_chunk, budget)
        batch.items.append((request, n))
        budget -= n
    return batch


def _right_pad(prompts, pad_id=0):
    """Wrong: pads on the right."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        mask[i, :len(p)] = 1
    return ids, mask


def _kv_cache_generate_wrong(model, prompts, max_new_tokens, eos_token_id=None, *, pad_is_real=False,
                             column_positions=False):
    """A static-batch loop with one planted bug: `pad_is_real` announces every column as a real token (rows attend
    to their left padding); `column_positions` gives every row the column indices `arange(T)` as positions (a
    left-padded row's first real token sits at its pad count, not 0: RoPE sees only distances, so the tokens
    stay the reference's)."""
    from minirt.generate import ContiguousKVCache, left_pad

    ids, mask = (t.to(model.device) for t in left_pad(prompts))
    B, T = ids.shape
    cache = ContiguousKVCache(model, B, T + max_new_tokens)
    positions = (torch.arange(T, device=model.device)[None].repeat(B, 1) if column_positions
                 else (mask.cumsum(-1) - 1).clamp(min=0))
    out, done = [[] for _ in range(B)], [False] * B
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            cache.append(torch.ones_like(mask) if pad_is_real else mask)
            nxt = model.compute_logits(model(ids, positions, attn=cache)[:, -1]).argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t == eos_token_id
            if all(done):
                break
            ids, positions = nxt[:, None], positions[:, -1:] + 1
            mask = torch.ones(B, 1, dtype=torch.long, device=model.device)
    return out


_kv_cache_generate_attending_to_padding = functools.partial(_kv_cache_generate_wrong, pad_is_real=True)
_kv_cache_generate_column_positions = functools.partial(_kv_cache_generate_wrong, column_positions=True)


def _paged_attention_without_causal_mask(q, k_cache, v_cache, meta):
    from minirt.attention import sdpa

    B, outs = k_cache.shape[1], []
    for s in range(meta.context_lens.shape[0]):
        a, b, ctx = int(meta.query_start_loc[s]), int(meta.query_start_loc[s + 1]), int(meta.context_lens[s])
        pos = torch.arange(ctx, device=q.device)
        slots = meta.block_tables[s, pos // B] * B + pos % B
        outs.append(sdpa(q[None, a:b], k_cache.flatten(0, 1)[slots][None], v_cache.flatten(0, 1)[slots][None])[0])
    return torch.cat(outs)


def _combine_splits_without_the_max(acc, m, l):     # exact in exact arithmetic; overflows to inf/inf = NaN
    weights = torch.exp(m)
    return (weights[..., None] * acc).sum(-2) / (weights * l).sum(-1, keepdim=True)


def _delta_chunks_dropping_the_finish(delta, head, chat, first, include_usage):
    """Sends only text: a last delta without text (a stop string cut from the end) loses its finish_reason."""
    from minirt.serve.protocol import delta_chunks

    if not delta.text and not (chat and first):
        return [c for c in delta_chunks(delta, head, chat, first, include_usage) if not c["choices"]]
    return delta_chunks(delta, head, chat, first, include_usage)


def _goodput_failing_one_token_requests(results, duration_s, ttft_slo_s, tpot_slo_s):
    """Counts a request without a TPOT (one token) as missing the TPOT SLO."""
    return sum(r["ok"] and r["ttft_s"] <= ttft_slo_s and r["tpot_s"] is not None and r["tpot_s"] <= tpot_slo_s
               for r in results) / duration_s
def _column_parallel_strided(linear, rank, world_size):       # every world_size-th row: heads torn apart
    import torch

    shard = torch.nn.Linear(linear.in_features, linear.out_features // world_size, bias=linear.bias is not None)
    with torch.no_grad():
        shard.weight.copy_(linear.weight[rank::world_size])
        if linear.bias is not None:
            shard.bias.copy_(linear.bias[rank::world_size])
    return shard.to(linear.weight.device)


def _row_parallel_bias_on_every_rank():                      # the bias inside the sum: counted world_size times
    import torch.nn.functional as F

    from minirt.parallel.sharding import RowParallelLinear

    class BiasBeforeTheSum(RowParallelLinear):
        def forward(self, x):
            return self.comm.all_reduce(F.linear(x, self.weight, self.bias))

    return BiasBeforeTheSum


def _vocab_embedding_without_the_mask():                     # others' ids read this rank's clamped rows
    import torch.nn.functional as F

    from minirt.parallel.sharding import VocabParallelEmbedding

    class NoMask(VocabParallelEmbedding):
        def forward(self, ids):
            return self.comm.all_reduce(F.embedding((ids - self.vocab_start).clamp(0, self.rows - 1), self.weight))

    return NoMask


def _greedy_accept_counting_every_match(draft, target):       # keeps matches after the first mismatch
    if len(target) != len(draft) + 1:
        raise ValueError("target_argmax")
    return [x for x, t in zip(draft, target) if x == t] + [target[-1]]


def _rejection_sample_residual_from_p(draft, draft_probs, target_probs, generator):
    """At a rejection, draws from p itself instead of max(0, p - q): the first token is no longer ~ p_0."""
    from minirt.spec.acceptance import rejection_sample

    out = rejection_sample(draft, draft_probs, target_probs, generator)
    if len(out) <= len(draft):
        out[-1] = int(torch.multinomial(target_probs[len(out) - 1], 1, generator=generator))
    return out


def _rollback_releasing_first_block_first(block_table, pool, num_tokens, block_size):
    if num_tokens < 0:
        raise ValueError("num_tokens")
    keep = -(-num_tokens // block_size)
    released = block_table[keep:]
    for b in released:                                                 # front first: the free list's order differs
        pool.release(b)
    del block_table[keep:]
    return released


_QMAX = {"int8": 127.0, "fp8": 448.0}


def _quantize_wrong(weight, method, *, per_tensor=False, truncate=False, qmax=None, half_away=False):
    """Per-channel absmax quantization with one planted bug: `per_tensor` one scale for the whole weight (a row of
    small weights loses its precision), `truncate` rounds toward zero, `qmax` divides amax by another grid size
    (128: the int8 grid's -128 end, which a symmetric scheme never uses), `half_away` rounds halfway values away
    from zero (Python 2's round, C's lround) instead of to even."""
    if method not in _QMAX or weight.dim() != 2:
        raise ValueError("method or weight")
    w = weight.float()
    amax = w.abs().amax().expand(w.shape[0]) if per_tensor else w.abs().amax(dim=1)
    scale = (amax / (qmax or _QMAX[method])).clamp(min=1e-12)
    x = w / scale[:, None]
    if method == "fp8":
        return x.clamp(-448, 448).to(torch.float8_e4m3fn), scale
    x = x.trunc() if truncate else torch.sign(x) * torch.floor(x.abs() + 0.5) if half_away else x.round()
    return x.clamp(-127, 127).to(torch.int8), scale


def _quantize_without_min_scale(weight, method):
    """A zero row's division guarded (0/0 -> 0), but no floor under the scale: a row of tiny weights gets a tiny
    scale and its q spreads over the whole grid where the reference's stays near 0."""
    if method not in _QMAX or weight.dim() != 2:
        raise ValueError("method or weight")
    w = weight.float()
    scale = w.abs().amax(dim=1) / _QMAX[method]
    x = torch.where(scale[:, None] > 0, w / scale[:, None], torch.zeros_like(w))
    return (x.round().clamp(-127, 127).to(torch.int8) if method == "int8" else x.to(torch.float8_e4m3fn)), scale


def _quantize_in_the_input_dtype(weight, method):
    """Scales and divides in the weight's own dtype: bfloat16's 8-bit mantissa rounds w / scale before round()."""
    if method not in _QMAX or weight.dim() != 2:
        raise ValueError("method or weight")
    scale = (weight.abs().amax(dim=1) / _QMAX[method]).clamp(min=1e-12)
    x = weight / scale[:, None]
    q = x.round().clamp(-127, 127).to(torch.int8) if method == "int8" else x.to(torch.float8_e4m3fn)
    return q, scale.float()


def _dequantize_in_bfloat16(q, scale):                       # the wrong dtype: the model's, not float32
    if tuple(scale.shape) != (q.shape[0],):
        raise ValueError("scale")
    return (q.float() * scale[:, None]).to(torch.bfloat16)


def _dequantize_along_columns(q, scale):                      # scale[k] multiplies column k: only square q runs
    if tuple(scale.shape) != (q.shape[0],):
        raise ValueError("scale")
    return q.float() * scale


def _quantized_linear(*, bias=True, per_tensor=False, float32=False):
    """A `QuantizedLinear(linear, method)` with one planted bug: `bias=False` forgets the bias, `per_tensor` keeps
    one scale for the whole weight (repeated per row), `float32` dequantizes into float32 whatever x's dtype."""
    import torch.nn.functional as F

    from minirt.quant.formats import dequantize

    class Wrong(torch.nn.Module):
        def __init__(self, linear, method):
            super().__init__()
            q, scale = _quantize_wrong(linear.weight, method, per_tensor=per_tensor)
            self.register_buffer("weight", q)
            self.register_buffer("weight_scale", scale.contiguous())
            self.bias = linear.bias

        def forward(self, x):
            dtype = torch.float32 if float32 else x.dtype
            y = F.linear(x.to(dtype), dequantize(self.weight, self.weight_scale, dtype=dtype))
            return y + self.bias.to(dtype) if bias and self.bias is not None else y

    return Wrong


def _quantized_linear_keeping_a_float_weight():
    """Right outputs, wrong memory: the dequantized float32 weight kept as a buffer beside q and its scales."""
    from minirt.quant.formats import dequantize

    Right = _quantized_linear()

    class FloatToo(Right):
        def __init__(self, linear, method):
            super().__init__(linear, method)
            self.register_buffer("weight_float", dequantize(self.weight, self.weight_scale))

    return FloatToo


WRONG = [
    ("ex01.greedy_next_token", lambda logits: logits.shape[-1] - 1 - logits.flip(-1).argmax(-1), "tie"),
    ("ex01.naive_generate",
     lambda model, p, n, eos=None: importlib.import_module("minirt.generate").naive_generate(model, p, n), "EOS"),
    ("ex02.left_pad", lambda prompts, pad_id=0: _right_pad(prompts, pad_id), "two lengths"),
    ("ex02.kv_cache_generate", _kv_cache_generate_attending_to_padding, "max_new_tokens=1"),
    ("ex02.kv_cache_generate", _kv_cache_generate_column_positions, "'per-row positions"),
    ("ex03.slot_mapping", lambda table, start, end, B: [table[p // B] * B + p % B for p in range(start, end - 1)],
     "one token"),
    ("ex03.block_pool", _wrong_block_pool(), "in order"),
    ("ex03.paged_attention", _paged_attention_without_causal_mask, "prefill"),
    ("ex04.block_hashes", lambda t, B, n=None: [hash((0, tuple(t[i * B:(i + 1) * B])))
                                                for i in range(len(t) // B if n is None else n)], "blocks"),
    ("ex04.match", _match_without_last_token_rule, "last token"),
    ("ex05.try_allocate", _try_allocate_ignoring_revived_hits, "free list"),
    ("ex05.append_token", _append_token_length_before_stop, "'stop' wins"),
    ("ex06.split_budget", lambda budget, d, rem, cap: importlib.import_module("minirt.scheduler").split_budget(
        budget, d, rem, 10**9), "chunk cap"),
    ("ex06.schedule", _schedule_letting_small_requests_overtake, "head-of-line"),
    ("ex07.capture_sizes", lambda n: [1, 2, 4, 8] + list(range(16, n + 1, 16)), "max_num_seqs=1"),
    ("ex07.combine_splits", _combine_splits_without_the_max, "large scores"),
    ("ex08.delta_chunks", _delta_chunks_dropping_the_finish, "the last delta, no text"),
    ("ex08.admission", lambda waiting, limit, draining: None if waiting < limit else (429, "busy"), "draining=True"),
    ("ex08.goodput", _goodput_failing_one_token_requests, "no TPOT"),
    ("ex09.column_parallel", _column_parallel_strided, "two ranks"),
    ("ex09.row_parallel", _row_parallel_bias_on_every_rank(), "two ranks, bias"),
    ("ex09.vocab_parallel_embedding", _vocab_embedding_without_the_mask(), "two ranks"),
    ("ex10.quantize", functools.partial(_quantize_wrong, per_tensor=True), "a [2, 3] weight by hand"),
    ("ex10.quantize", functools.partial(_quantize_wrong, truncate=True), "result['q']"),
    ("ex10.quantize", functools.partial(_quantize_wrong, qmax=128.0), "result['scale']"),
    ("ex10.quantize", functools.partial(_quantize_wrong, half_away=True), "halfway values round to even"),
    ("ex10.quantize", _quantize_without_min_scale, "its scale stops at MIN_SCALE"),
    ("ex10.quantize", _quantize_in_the_input_dtype, "a bfloat16 weight"),
    ("ex10.dequantize", _dequantize_in_bfloat16, "expected dtype torch.float32, got torch.bfloat16"),
    ("ex10.dequantize", _dequantize_along_columns, "a [2, 3] q by hand"),
    ("ex10.dequantize", lambda q, scale: q.float() * scale[:, None], "scale of shape [N, 1] -> ValueError"),
    ("ex10.quantized_linear", _quantized_linear(bias=False), "'int8, bias'"),
    ("ex10.quantized_linear", _quantized_linear(per_tensor=True), "result['weight']"),
    ("ex10.quantized_linear", _quantized_linear(float32=True), "the output in bfloat16"),
    ("ex10.quantized_linear", _quantized_linear_keeping_a_float_weight(), "result['state_dict']"),
    ("ex11.greedy_accept", _greedy_accept_counting_every_match, "the first draft rejected"),
    ("ex11.rejection_sample", _rejection_sample_residual_from_p, "first token ~ p_0"),
    ("ex11.rollback_block_table", _rollback_releasing_first_block_first, "last block first"),
]


@pytest.mark.parametrize("task,wrong,case_words", WRONG, ids=[w[0] for w in WRONG])
def test_checker_catches_a_wrong_implementation(task, wrong, case_words, capsys):
    with pytest.raises(CheckFailed) as info:
        checks.TASKS[task](wrong)
    message = str(info.value)
    assert message.startswith(f"{task} failed on case "), message
    assert case_words in message, message
    assert "inputs:" in message and "expected" in message, message
    assert capsys.readouterr().out == ""          # no PASS line, no noise


def test_the_quantization_scaffolds_pass_without_their_planted_bug(capsys):
    """Control for exercise 10's wrong implementations: with no bug switched on, `_quantize_wrong` and
    `_quantized_linear()` pass their checks, so each failure above comes from its one bug."""
    checks.ex10_quantize(_quantize_wrong)
    checks.ex10_quantized_linear(_quantized_linear())
    assert capsys.readouterr().out.splitlines() == ["PASS ex10.quantize (23/23 cases)",
                                                    "PASS ex10.quantized_linear (12/12 cases)"]

def test_column_index_positions_generate_the_reference_tokens_and_fail_on_positions(capsys):
    """Oracle: the reference `kv_cache_generate`. Column-index positions shift each left-padded row by its pad count;
    RoPE sees only distances, so the tokens agree with the reference's, and only the recorded positions tell."""
    from minirt.generate import kv_cache_generate

    model = checks.tiny_model()
    prompts = checks._prompts(40, [3, 11, 7, 1])
    assert _kv_cache_generate_column_positions(model, prompts, 4) == kv_cache_generate(model, prompts, 4)
    with pytest.raises(CheckFailed) as info:
        checks.ex02_kv_cache_generate(_kv_cache_generate_column_positions)
    msg = str(info.value)
    assert "'per-row positions: rows with different pad counts" in msg, msg
    assert "result['positions'][0][0]: expected 0, got 8" in msg, msg       # row 0: 3 tokens after 8 pads
    assert capsys.readouterr().out == ""


def test_off_by_one_slot_mapping_names_the_case_expected_and_got():
    def off_by_one(table, start, end, B):          # shifted one slot: position p goes to p + 1's slot
        return [table[(p + 1) // B] * B + (p + 1) % B if (p + 1) // B < len(table) else -1 for p in range(start, end)]

    with pytest.raises(CheckFailed) as info:
        checks.ex03_slot_mapping(off_by_one)
    msg = str(info.value)
    assert "case 2/14 'one token'" in msg and "block_table=[5], start=0, end=1, block_size=4" in msg
    assert "expected 20, got 21" in msg


def test_student_prints_are_captured_and_failures_show_them(capsys):
    def chatty(table, start, end, B):
        print("debug:", table)
        return [table[p // B] * B + p % B for p in range(start, end)]

    checks.ex03_slot_mapping(chatty)
    assert capsys.readouterr().out == "PASS ex03.slot_mapping (14/14 cases)\n"

    def chatty_wrong(table, start, end, B):
        print("debug: hello")
        return []

    with pytest.raises(CheckFailed, match="your function printed: 'debug: hello"):
        checks.ex03_slot_mapping(chatty_wrong)


def test_wrong_exception_type_and_unexpected_exception_are_reported():
    from minirt.generate import left_pad

    def raises_type_error(prompts, pad_id=0):
        raise TypeError("oops")

    with pytest.raises(CheckFailed, match="your function raised TypeError: oops"):
        checks.ex02_left_pad(raises_type_error)

    def no_validation(model, prompt_ids, max_new_tokens, eos_token_id=None):
        return [] if not prompt_ids or max_new_tokens < 1 else \
            importlib.import_module("minirt.generate").naive_generate(model, prompt_ids, max_new_tokens, eos_token_id)

    with pytest.raises(CheckFailed, match="expected: ValueError to be raised"):
        checks.ex01_naive_generate(no_validation)
    assert left_pad  # the reference itself is untouched


def _run_in_ipython(code: str) -> tuple[bool, str]:
    """Run `code` in an IPython shell as a notebook cell; (succeeded, what the shell printed)."""
    import contextlib
    import io

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = shell.run_cell(code, store_history=False)
    return result.success, out.getvalue()


def test_a_failing_check_shows_its_message_without_the_checkers_traceback():
    """In Jupyter a failing check shows the case, inputs, expected and got, and no frame of checks.py; the
    cell still fails (nbval and nbclient see an error). A function that raises shows its own frames."""
    ok, shown = _run_in_ipython("from minirt.course import checks\n"
                                "def slot_mapping(t, s, e, B):\n    return []\n"
                                "checks.ex03_slot_mapping(slot_mapping)\n")
    assert not ok
    assert "ex03.slot_mapping failed on case 2/14 'one token'" in shown and "inputs:" in shown, shown
    assert "checks.py" not in shown and "Traceback" not in shown, shown
    assert len(shown.strip().splitlines()) <= 6, shown

    ok, shown = _run_in_ipython("def helper(t):\n    return t[99]\n"
                                "def slot_mapping(t, s, e, B):\n    return helper(t)\n"
                                "checks.ex03_slot_mapping(slot_mapping)\n")
    assert not ok
    assert "your function raised IndexError" in shown and "in helper" in shown and "return t[99]" in shown, shown
    assert "checks.py" not in shown, shown


def test_check_messages_name_the_task_heading_the_student_sees():
    """A failing check says "the check cell of Task k" (nbval's "Cell N" counts code cells from 0, which a
    student cannot find): true only if each check cell sits under its exercise's "## Task k" heading."""
    import re

    import nbformat

    for path in SOLUTIONS:
        heading = None
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                found = re.findall(r"^## Task (\d+)", cell.source, re.M)
                heading = int(found[-1]) if found else heading
            elif "task" in cell.metadata.get("minirt", {}):
                task = cell.metadata["minirt"]["task"]
                assert heading == checks.task_number(task), (path.name, task, heading)
    with pytest.raises(CheckFailed, match=r"failed on case 2/14 'one token' \(the check cell of Task 1\)"):
        checks.ex03_slot_mapping(lambda t, s, e, B: [])
