"""Workloads and measurements for the chapter notebooks.

Everything here *drives or observes* the real package - `minirt.Engine`, `minirt.generate` - and
never re-implements it: a notebook that measures the engine measures the code it shows.

* Workloads: seeded length mixes (`length_mix`), prompts of a given length cut from public-domain
  text (`text_prompt`), a shared-system-prompt workload (`shared_prefix_prompts`).
* Measurements: the duration of every forward pass of a generation loop (`record_forwards`), a
  step-by-step record of the engine's collections, batches and block tables (`record_timeline`),
  static versus continuous batching (`run_requests`), per-token times derived from a record
  (`token_times`, `max_stall_s`), the torch operators a piece of code runs (`count_ops`).

Times are in seconds (`time.perf_counter`), lengths in tokens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import random
import time
from dataclasses import dataclass, field

import torch
import torch.utils._python_dispatch

# Public-domain text to cut prompts from (Shakespeare, Hamlet III.1 and Sonnet 18; Milton, Paradise Lost I),
# the same kind of text the embedded model was trained on.
SAMPLE_TEXT = """HAMLET.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles,
And by opposing end them? To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause: there's the respect
That makes calamity of so long life;
For who would bear the whips and scorns of time,
The oppressor's wrong, the proud man's contumely,
The pangs of despised love, the law's delay,
The insolence of office and the spurns
That patient merit of the unworthy takes,
When he himself might his quietus make
With a bare bodkin? who would fardels bear,
To grunt and sweat under a weary life,
But that the dread of something after death,
The undiscover'd country from whose bourn
No traveller returns, puzzles the will
And makes us rather bear those ills we have
Than fly to others that we know not of?

Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date:
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance, or nature's changing course, untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall Death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.

Of Mans First Disobedience, and the Fruit
Of that Forbidden Tree, whose mortal tast
Brought Death into the World, and all our woe,
With loss of Eden, till one greater Man
Restore us, and regain the blissful Seat,
Sing Heav'nly Muse, that on the secret top
Of Oreb, or of Sinai, didst inspire
That Shepherd, who first taught the chosen Seed,
In the Beginning how the Heav'ns and Earth
Rose out of Chaos: Or if Sion Hill
Delight thee more, and Siloa's Brook that flow'd
Fast by the Oracle of God; I thence
Invoke thy aid to my adventrous Song,
That with no middle flight intends to soar
Above th' Aonian Mount, while it pursues
Things unattempted yet in Prose or Rhime.
"""

#: A shared "system prompt" for the prefix-cache chapter: the Prologue of Romeo and Juliet.
PROLOGUE = """THE PROLOGUE.

Enter Chorus.

CHORUS.
Two households, both alike in dignity,
In fair Verona, where we lay our scene,
From ancient grudge break to new mutiny,
Where civil blood makes civil hands unclean.
From forth the fatal loins of these two foes
A pair of star-cross'd lovers take their life;
Whose misadventur'd piteous overthrows
Doth with their death bury their parents' strife.
The fearful passage of their death-mark'd love,
And the continuance of their parents' rage,
Which, but their children's end, nought could remove,
Is now the two hours' traffic of our stage;
The which, if you with patient ears attend,
What here shall miss, our toil shall strive to mend.

"""

SPEAKERS = ["ROMEO", "JULIET", "MERCUTIO", "BENVOLIO", "TYBALT", "NURSE", "FRIAR LAWRENCE", "CAPULET",
            "LADY CAPULET", "MONTAGUE", "PRINCE", "PARIS", "SAMPSON", "GREGORY", "PETER", "BALTHASAR"]


def seed_all(seed: int = 0) -> None:
    """Seed Python's and torch's generators (CPU and every GPU)."""
    random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------- workloads


def text_prompt(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    """`num_tokens` token ids of `SAMPLE_TEXT` (repeated as needed), starting `offset` tokens in."""
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    reps = (offset + num_tokens) // len(ids) + 1
    return (ids * reps)[offset:offset + num_tokens]


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, seed: int = 0) -> list[int]:
    """n integer lengths from a log-normal with this median (tokens) and sigma, clipped to [low, high].

    Request lengths in real traffic are heavy-tailed (ShareGPT, LMSYS-Chat); a log-normal is the
    usual simple stand-in.
    """
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def length_mix(n: int, seed: int = 0, max_model_len: int = 2048) -> list[tuple[int, int]]:
    """A seeded, realistic mix of `(prompt_len, output_len)` pairs in tokens, each pair within max_model_len.

    Prompts: median 256 tokens, outputs: median 128 tokens, both log-normal with sigma 0.9.
    """
    prompts = lognormal_lengths(n, 256, 0.9, 4, max_model_len - 1, seed)
    outputs = lognormal_lengths(n, 128, 0.9, 1, max_model_len - 1, seed + 1)
    return [(p, min(o, max_model_len - p)) for p, o in zip(prompts, outputs)]


def shared_prefix_prompts(tokenizer, n: int, prefix: str = PROLOGUE) -> list[list[int]]:
    """n prompts (token ids) that share `prefix` and then differ: the prefix, then a speaker's name.

    Built as `prefix ids + suffix ids`, so the shared part is token-for-token identical (tokenizing
    the concatenated text could merge tokens across the boundary).
    """
    head = tokenizer.encode(prefix)              # a prompt's start: the tokenizer's own special tokens (a BOS)
    return [head + tokenizer.encode(f"{SPEAKERS[i % len(SPEAKERS)]}.\n", add_special_tokens=False)
            for i in range(n)]


# ----------------------------------------------------------------------------------- forward timing


@dataclass
class ForwardCall:
    """One forward pass of the model inside a generation loop.

    shape: `(B, T)` of its input_ids. seconds: from this forward's start to the next one's start (or
    the end of the recording) - one whole loop step, LM head and token choice included.
    input_ids, positions: CPU copies `[B, T]`, kept only with `keep_inputs=True`.
    """

    shape: tuple[int, int]
    seconds: float = 0.0
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.shape[0] * self.shape[1]


@contextlib.contextmanager
def record_forwards(model, keep_inputs: bool = False):
    """Record every forward call of `model` (a `minirt` DecoderModel) inside the block.

        with record_forwards(model) as calls:
            naive_generate(model, ids, 64)
        [c.seconds for c in calls]          # one entry per generated token

    Uses a forward pre-hook, so the generation code runs unchanged. On a GPU the device is
    synchronized at each step boundary so that the times are real.
    """
    calls: list[ForwardCall] = []
    cuda = model.device.type == "cuda"
    last = [None]

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(model.device)
        return time.perf_counter()

    def pre_hook(module, args, kwargs):
        t = now()
        if calls:
            calls[-1].seconds = t - last[0]
        input_ids = args[0] if args else kwargs["input_ids"]
        positions = args[1] if len(args) > 1 else kwargs.get("positions")
        call = ForwardCall(tuple(input_ids.shape))
        if keep_inputs:
            call.input_ids, call.positions = input_ids.cpu().clone(), positions.cpu().clone()
        calls.append(call)
        last[0] = t

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
        if calls:
            calls[-1].seconds = now() - last[0]


# ----------------------------------------------------------------------------------- engine timeline


@dataclass
class StepSnapshot:
    """The engine during one step, as seen right after the scheduler decided it.

    waiting / prefilling / running: request ids in each collection (prefilling includes requests
    admitted in this step; running ones decode one token). scheduled: new tokens computed per request.
    block_tables, ref_counts (per block), free_blocks (the free list, next to be handed out first),
    cached_blocks (blocks holding a prefix-cache hash): the pool during the step.
    num_computed: tokens per request with K/V in the cache at the *end* of the step.
    num_output: output tokens per request after the step. finished: ids that finished in the step.
    start_s / end_s: seconds since the recording began.
    """

    step: int
    start_s: float
    waiting: list[str]
    prefilling: list[str]
    running: list[str]
    scheduled: dict[str, int]
    block_tables: dict[str, list[int]]
    ref_counts: list[int]
    free_blocks: list[int]
    cached_blocks: list[int]
    num_computed: dict[str, int]
    block_size: int
    end_s: float = 0.0
    num_output: dict[str, int] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for rid, n in self.scheduled.items() if rid in self.running)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for rid, n in self.scheduled.items() if rid not in self.running)


@contextlib.contextmanager
def observe_steps(engine):
    """Record a `StepSnapshot` for every engine step taken inside the block (yields the list).

    The end of each step is observed through `engine.step_callbacks`. The collections and the pool are
    read at the moment the scheduler decides (before the step's bookkeeping moves, finishes and frees
    requests), so `engine.scheduler.schedule` is wrapped by an instance attribute that calls the
    original; the engine's own code runs unchanged, and both hooks are removed on exit. A step's end is
    matched to its own snapshot (with async scheduling the next step is scheduled before this one ends);
    a batch scheduled and then never run leaves no snapshot.
    """
    snapshots: list[StepSnapshot] = []
    by_batch: dict[int, tuple] = {}      # id(batch) -> (batch, its snapshot); the batch kept, so its id stays its own
    ended: set[int] = set()              # id() of the snapshots whose step ended
    scheduler, pool = engine.scheduler, engine.pool
    t0 = time.perf_counter()
    schedule = scheduler.schedule

    def observed_schedule():
        start = time.perf_counter() - t0
        batch = schedule()
        if not batch:                             # nothing was scheduled: not a step
            return batch
        admitted = scheduler.prefilling_requests + scheduler.running_requests
        scheduled = {r.request_id: n for r, n in batch.items}
        snapshots.append(snap := StepSnapshot(
            step=len(snapshots), start_s=start,
            waiting=[r.request_id for r in scheduler.waiting_queue],
            prefilling=[r.request_id for r in scheduler.prefilling_requests],
            running=[r.request_id for r in scheduler.running_requests],
            scheduled=scheduled,
            block_tables={r.request_id: list(r.block_table) for r in admitted},
            ref_counts=[b.ref_count for b in pool.blocks],
            free_blocks=list(pool.free),
            cached_blocks=[b.block_id for b in pool.blocks if b.block_hash is not None],
            num_computed={r.request_id: r.num_computed_tokens + scheduled.get(r.request_id, 0) for r in admitted},
            block_size=engine.config.block_size))
        by_batch[id(batch)] = (batch, snap)
        return batch

    def on_step(engine, batch):
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        snap = by_batch[id(batch)][1]      # a burst continued from another ends again under the same batch
        ended.add(id(snap))
        snap.end_s = time.perf_counter() - t0
        snap.num_output = {r.request_id: r.num_output_tokens for r, _ in batch.items}
        snap.finished = [r.request_id for r, _ in batch.items if r.is_finished]

    scheduler.schedule = observed_schedule
    engine.step_callbacks.append(on_step)
    try:
        yield snapshots
    finally:
        del scheduler.schedule
        engine.step_callbacks.remove(on_step)
        snapshots[:] = [s for s in snapshots if id(s) in ended]
        for i, snap in enumerate(snapshots):
            snap.step = i


async def record_timeline(engine, prompts: list, params, arrival_steps: list[int] | None = None,
                          request_ids: list[str] | None = None):
    """Run requests through `engine` (not yet started) and record every step.

    prompts: strings or token-id lists. params: one `SamplingParams` or one per prompt.
    arrival_steps: request i is submitted once the engine has taken `arrival_steps[i]` steps (or at
    once if the engine is idle); None = all at step 0. request_ids: default "A", "B", ...
    Returns `(outputs in prompt order, list[StepSnapshot])`. Arrival by step count, not by clock,
    keeps the schedule - and so every figure drawn from it - deterministic.
    """
    n = len(prompts)
    params = params if isinstance(params, (list, tuple)) else [params] * n
    arrival_steps = arrival_steps or [0] * n
    request_ids = request_ids or [chr(ord("A") + i) if n <= 26 else f"r{i}" for i in range(n)]
    order = sorted(range(n), key=lambda i: arrival_steps[i])
    requests = [None] * n
    with observe_steps(engine) as snapshots:
        async with engine:
            for i in order:
                while engine.num_steps < arrival_steps[i] and engine.scheduler.has_work():
                    await asyncio.sleep(0)                     # let the engine loop take a step
                requests[i] = engine.submit(prompts[i], params[i], request_ids[i])
            outputs = await asyncio.gather(*(r.future for r in requests))
    return list(outputs), snapshots


def token_times(snapshots: list[StepSnapshot]) -> dict[str, list[float]]:
    """Per request, the time (seconds since the recording began) at which each output token appeared."""
    times: dict[str, list[float]] = {}
    for s in snapshots:
        for rid, count in s.num_output.items():
            got = times.setdefault(rid, [])
            got += [s.end_s] * (count - len(got))
    return times


def max_stall_s(snapshots: list[StepSnapshot], request_ids: list[str] | None = None) -> float:
    """The longest gap between two consecutive output tokens of any (of these) request(s), in seconds."""
    gaps = [b - a for rid, ts in token_times(snapshots).items() if request_ids is None or rid in request_ids
            for a, b in zip(ts, ts[1:])]
    return max(gaps, default=0.0)


async def run_requests(engine, prompts: list, params, batch_size: int | None = None):
    """Serve all prompts with `engine` (not yet started); returns `(outputs, wall_time_s)`.

    batch_size None: every request is submitted at once and the engine batches continuously
    (a finished request's seat is refilled at the next step). batch_size k: *static batching* -
    k requests are submitted, and the next k only when all of them have finished, so a batch
    lasts as long as its longest request.
    """
    params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    k = batch_size or len(prompts)
    outputs = []
    async with engine:
        t = time.perf_counter()
        for i in range(0, len(prompts), k):
            outputs += await asyncio.gather(*(engine.generate(p, sp) for p, sp in
                                              zip(prompts[i:i + k], params[i:i + k])))
        wall = time.perf_counter() - t
    return outputs, wall


# ---------------------------------------------------------------------------------------------- operator counts
_METADATA_ONLY = {"detach_", "resolve_conj", "resolve_neg", "lift_fresh"}


def _storages(x) -> set[int]:
    tensors = [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)] \
        if isinstance(x, (list, tuple)) else []
    return {t.untyped_storage().data_ptr() for t in tensors}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inputs = set().union(*(_storages(a) for a in args)) if args else set()
        in_place = name.endswith("_") and name not in _METADATA_ONLY
        if in_place or not (_storages(out) <= inputs) and name not in _METADATA_ONLY:
            self.counts[name] += 1        # wrote memory: new output storage, or an in-place update
        else:
            self.views[name] += 1         # a view, a no-op cast, or metadata only: no kernel
        return out


@contextlib.contextmanager
def count_ops():
    """Count the torch operators (ATen ops, as dispatched to a device) run in this thread inside the block.

    `with count_ops() as counts: ...` leaves `counts` a `collections.Counter` {op name: calls} of the operators
    that compute something - write a new tensor or update one in place - which on a GPU are (at least) one
    kernel launch each: the launches an eager forward makes. Views, casts to the same dtype and other
    metadata-only operators are counted apart, in `counts.views`.
    """
    counter = _OpCounter()
    counter.counts.views = counter.views
    with counter:
        yield counter.counts
