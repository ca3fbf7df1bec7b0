"""Sampling parameters and the batched sampler: greedy, temperature, top-k, top-p, per-request seeds.

Order of the filters as in `transformers`' logits warpers and vLLM's sampler: divide by the
temperature, keep the top-k logits, then keep the smallest set of tokens whose probability mass
reaches top-p (nucleus sampling; Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration", section 3.1). The most likely token is always kept. Temperature 0 means greedy, and so does
any temperature below `SAMPLING_EPS` (vLLM's `_SAMPLING_EPS`, vllm/sampling_params.py): dividing the logits
by 1e-40 overflows float32 to inf and the softmax to nan, which would fail the whole batch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

#: Temperatures below this are greedy (SamplingParams stores them as 0). At or above it the float32 sampler
#: cannot overflow: |logit| / 1e-5 stays finite for any |logit| < 3e33.
SAMPLING_EPS = 1e-5


def _as_int(x) -> int | None:
    """x as a Python int if it is an integer (numpy's integers too, bools not), else None."""
    return int(x) if isinstance(x, numbers.Integral) and not isinstance(x, bool) else None


def _as_float(x) -> float | None:
    """x as a finite Python float if it is a real number (numpy's too, bools not), else None."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return None
    try:
        x = float(x)
    except OverflowError:                       # an int too large for a float
        return None
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    max_new_tokens: generated tokens at most (>= 1). temperature: 0 = greedy, else softmax(logits / T); a
    temperature below `SAMPLING_EPS` (1e-5) is greedy and stored as 0.0. top_p: nucleus mass in (0, 1].
    top_k: keep the k most likely tokens, 0 = all (k at or above the vocabulary size keeps all too), below
    2**63. seed: in [0, 2**63), makes this request's samples reproducible whatever else is in the batch.
    stop: strings that end generation (matched on the decoded text and cut from it). stop_token_ids: ids that
    end generation (kept in `token_ids`; the engine checks them against the vocabulary). ignore_eos: keep
    going past the tokenizer's EOS. Numbers may be numpy scalars (stored as Python int/float); bools are
    not numbers here.
    Raises ValueError naming the field for any value out of range or of the wrong type.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | str = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        max_new_tokens = _as_int(self.max_new_tokens)
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        temperature = _as_float(self.temperature)
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        top_p = _as_float(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        top_k = _as_int(self.top_k)
        if top_k is None or not 0 <= top_k < 2**63:       # the sampler holds it in an int64
            raise ValueError(f"top_k: must be an integer >= 0 and < 2**63 (0 = no limit), got {self.top_k!r}")
        seed = None if self.seed is None else _as_int(self.seed)
        if self.seed is not None and (seed is None or not 0 <= seed < 2**63):
            raise ValueError(f"seed: must be an integer in [0, 2**63) or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: must be a string or a sequence of non-empty strings, got {self.stop!r}")
        ids = self.stop_token_ids
        ids = [_as_int(i) for i in ids] if isinstance(ids, (tuple, list)) else None
        if ids is None or not all(i is not None and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids: must be a sequence of integers >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if temperature < SAMPLING_EPS:
            temperature = 0.0                             # greedy: see SAMPLING_EPS
        for name, value in dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop), stop_token_ids=tuple(ids)).items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every logit outside top-k, then outside the top-p nucleus.

    logits `[B, V]` float32 (already divided by the temperature); top_k `[B]` int64 (0 = off);
    top_p `[B]` float32. Returns a new `[B, V]` tensor.
    """
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)
    drop = (top_k[:, None] > 0) & (ranks[None, :] >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs           # mass of strictly more likely tokens
    # Rank 0 is always kept, even where top_p is 0 in float32 (1e-300 underflows): dropping every token
    # would make the softmax nan. top_p = 1 filters nothing (the float32 cumsum can reach 1.0 before the
    # tail, so it must not be compared).
    drop = drop | ((top_p[:, None] < 1) & (mass_before >= top_p[:, None]) & (ranks[None, :] > 0))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs_after_filters(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution one row is sampled from: logits `[V]` -> probabilities `[V]` (one-hot if greedy)."""
    if temperature < SAMPLING_EPS:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).to(torch.float32)
    row = (logits.float() / temperature)[None]
    dev = logits.device
    filtered = filter_logits(row, torch.tensor([top_k], device=dev), torch.tensor([top_p], device=dev))
    return filtered.softmax(-1)[0]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Pick one token per row. logits `[B, V]` float32; temperature/top_p `[B]` float32; top_k `[B]` int64.

    Rows with temperature below `SAMPLING_EPS` (0 from SamplingParams) take the argmax. The others are drawn
    from the filtered softmax; a row with its own generator (a seeded request) draws from it, so its tokens do
    not depend on the batch around it. Returns `[B]` int64 on the logits' device.
    """
    next_ids = logits.argmax(dim=-1)
    sampled = temperature >= SAMPLING_EPS
    if not bool(sampled.any()):
        return next_ids
    rows = sampled.nonzero().flatten()
    scaled = logits[rows] / temperature[rows, None]
    probs = filter_logits(scaled, top_k[rows], top_p[rows]).softmax(dim=-1)
    picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    row_list = rows.tolist()
    unseeded = [j for j, r in enumerate(row_list) if generators[r] is None]
    if unseeded:
        picks[unseeded] = torch.multinomial(probs[unseeded], 1).flatten()
    for j, r in enumerate(row_list):
        if generators[r] is not None:
            picks[j] = torch.multinomial(probs[j], 1, generator=generators[r])[0]
    next_ids[rows] = picks
    return next_ids
