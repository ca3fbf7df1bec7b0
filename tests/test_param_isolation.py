"""One request's parameters never fail another: edge values of every SamplingParams field, each next to ordinary
requests. Each is either refused (at construction, or at submission where the limit is the engine's) with a
ValueError naming the field, or the ordinary requests get the tokens they get alone (the oracle: run alone).

Checked twice: through `minirt.sampling.sample` with two rows, its inputs built by the engine's own code
(`ModelRunner.sampling_tensors`, `Request`'s generator), and through `minirt.LLM` on the embedded model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import minirt
from minirt import sampling
from minirt.model_runner import ModelRunner
from minirt.request import Request

VOCAB = 4096                      # the embedded model's
ORDINARY = [minirt.SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True),
            minirt.SamplingParams(max_new_tokens=8, ignore_eos=True)]          # seeded sampling, and greedy
PROMPTS = ["ROMEO:", "JULIET:", "KING HENRY:"]

# Values that must run; the last field says whether the row must then be the argmax.
ACCEPTED = {
    "temperature 1e-40": (dict(temperature=1e-40), True),
    "temperature 1e-300 with a seed": (dict(temperature=1e-300, seed=3), True),
    "temperature just below 1e-5": (dict(temperature=0.99e-5), True),
    "temperature 1e-5": (dict(temperature=1e-5, top_k=3), False),
    "temperature 1e300 (inf in float32)": (dict(temperature=1e300), False),
    "top_p 1e-300 (0 in float32)": (dict(temperature=1.0, top_p=1e-300), True),
    "top_p 1e-45": (dict(temperature=1.0, top_p=1e-45, seed=5), True),
    "top_k above the vocabulary": (dict(temperature=1.0, top_k=10**6), False),
    "top_k 2**63 - 1": (dict(temperature=1.0, top_k=2**63 - 1, seed=9), False),
    "seed 0": (dict(temperature=1.0, seed=0), False),
    "seed 2**63 - 1": (dict(temperature=1.0, seed=2**63 - 1), False),
    "numpy scalars": (dict(temperature=np.float32(0.7), top_p=np.float64(0.9), top_k=np.int64(5), seed=np.uint64(7),
                           max_new_tokens=np.int32(8), stop_token_ids=[np.int64(VOCAB - 1)]), False),
}
STOPS = {
    "a very long stop string": dict(stop=("x" * 100_000,)),
    "many stop strings": dict(stop=tuple(f"@{i}@" for i in range(2000))),
    "unicode stop strings": dict(stop=("\u00e9", "\U0001F600", "\ufffd", "\ud800", "\u0301", "\u4e2d")),
    "many stop token ids": dict(stop_token_ids=tuple(range(VOCAB // 2, VOCAB))),
}

# Values refused when the SamplingParams is made: field, value.
REFUSED = [
    ("max_new_tokens", True), ("max_new_tokens", math.inf), ("max_new_tokens", np.float64(8.0)),
    ("temperature", True), ("temperature", math.nan), ("temperature", -math.inf), ("temperature", np.float32("nan")),
    ("temperature", np.bool_(True)), ("temperature", 10**400),
    ("top_p", False), ("top_p", math.nan), ("top_p", math.inf), ("top_p", np.float64("nan")), ("top_p", 0.0),
    ("top_k", True), ("top_k", 2**63), ("top_k", 10**30), ("top_k", math.inf), ("top_k", np.float32(3)),
    ("seed", True), ("seed", 2**63), ("seed", -1), ("seed", math.nan), ("seed", np.int64(-1)),
    ("stop_token_ids", (True,)), ("stop_token_ids", (1.0,)), ("stop_token_ids", (np.int64(-3),)),
    ("ignore_eos", np.bool_(True)), ("ignore_eos", 1),
]


def params_of(kwargs) -> minirt.SamplingParams:
    return minirt.SamplingParams(**{"max_new_tokens": 8, "ignore_eos": True, **kwargs})


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v!r}"[:40] for f, v in REFUSED])
def test_refused_at_construction(field, value):
    with pytest.raises(ValueError) as info:
        params_of({field: value})
    assert str(info.value).startswith(f"{field}:"), info.value


def test_tiny_temperature_is_stored_as_greedy():
    assert params_of(dict(temperature=1e-40)).temperature == 0.0 and params_of(dict(temperature=1e-40)).greedy
    assert params_of(dict(temperature=1e-5)).temperature == 1e-5
    numpy = params_of(ACCEPTED["numpy scalars"][0])
    assert type(numpy.temperature) is float and type(numpy.top_k) is int and type(numpy.seed) is int
    assert type(numpy.stop_token_ids[0]) is int


# ---------------------------------------------------------------------------------------------------------
# the batched sampler, two rows
# ---------------------------------------------------------------------------------------------------------
def sampler_inputs(params: list[minirt.SamplingParams]):
    """(temperature, top_k, top_p) and the generators, as the engine builds them for these requests."""
    requests = [Request(f"r{i}", None, [1], p, frozenset()) for i, p in enumerate(params)]
    tensors = ModelRunner.sampling_tensors(SimpleNamespace(device=torch.device("cpu")), requests)
    if tensors is None:                              # all greedy: the engine takes the argmax without the sampler
        n = len(params)
        tensors = (torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.ones(n))
    return tensors, [r.generator for r in requests]


@pytest.mark.parametrize("name", list(ACCEPTED))
@pytest.mark.parametrize("ordinary", ORDINARY, ids=["seeded", "greedy"])
def test_sample_two_rows(name, ordinary):
    kwargs, argmax = ACCEPTED[name]
    bad = params_of(kwargs)
    logits = torch.randn(16, 2, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    pair, pair_generators = sampler_inputs([bad, ordinary])
    single, single_generators = sampler_inputs([ordinary])
    for step in range(len(logits)):
        out = sampling.sample(logits[step], *pair, pair_generators)
        alone = sampling.sample(logits[step, 1:], *single, single_generators)
        assert int(out[1]) == int(alone[0]), f"step {step}"
        assert 0 <= int(out[0]) < VOCAB
        if argmax:
            assert int(out[0]) == int(logits[step, 0].argmax())


@pytest.mark.parametrize("temperature,top_p", [(1e-40, 1.0), (1e-38, 0.5), (1.0, 0.0), (0.5, 1e-40)])
def test_sample_raw_tensors_with_tiny_values(temperature, top_p):
    """`sample` called directly (not through SamplingParams): a tiny temperature row is greedy, a top_p of 0
    keeps the top token, and the seeded row next to it draws what it draws alone."""
    logits = torch.randn(8, 2, VOCAB, generator=torch.Generator().manual_seed(2)) * 4
    generators = [None, torch.Generator().manual_seed(11)]
    single_generator = [torch.Generator().manual_seed(11)]
    for step in range(len(logits)):
        out = sampling.sample(logits[step], torch.tensor([temperature, 0.8]), torch.tensor([0, 50]),
                              torch.tensor([top_p, 0.9]), generators)
        alone = sampling.sample(logits[step, 1:], torch.tensor([0.8]), torch.tensor([50]), torch.tensor([0.9]),
                                single_generator)
        assert int(out[0]) == int(logits[step, 0].argmax()) and int(out[1]) == int(alone[0])


def test_probs_after_filters_tiny_values():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    for temperature, top_p in ((1e-40, 1.0), (1.0, 1e-300), (1e-30, 1e-300)):
        probs = sampling.probs_after_filters(logits, temperature, 0, top_p)
        assert int(probs.argmax()) == int(logits.argmax()) and float(probs.max()) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------
# end to end, on the embedded model
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alone(default_llm):
    """Each ordinary request run alone: the oracle."""
    return [list(default_llm.generate([prompt], p)[0].token_ids) for prompt, p in zip(PROMPTS[1:], ORDINARY)]


def check_ordinary_undisturbed(outs, alone):
    for out, want in zip(outs, alone):
        assert out.error is None and out.finish_reason == "length", out.error
        assert list(out.token_ids) == want


@pytest.mark.parametrize("name", list(ACCEPTED) + list(STOPS))
def test_llm_batch_with_one_edge_request(default_llm, alone, name):
    kwargs = ACCEPTED[name][0] if name in ACCEPTED else STOPS[name]
    outs = default_llm.generate(PROMPTS, [params_of(kwargs)] + ORDINARY)
    assert outs[0].error is None and outs[0].finish_reason in ("length", "stop"), outs[0].error
    check_ordinary_undisturbed(outs[1:], alone)


@pytest.mark.parametrize("field,kwargs,words", [
    ("prompt + max_new_tokens", dict(max_new_tokens=10**30), "max_model_len"),
    ("stop_token_ids", dict(stop_token_ids=(VOCAB,)), f"[0, {VOCAB})"),
    ("stop_token_ids", dict(stop_token_ids=(1, 2**70)), f"[0, {VOCAB})"),
])
def test_refused_at_submission_and_the_engine_still_serves(default_llm, alone, field, kwargs, words):
    with pytest.raises(ValueError) as info:
        default_llm.generate(PROMPTS, [params_of(kwargs)] + ORDINARY)
    assert str(info.value).startswith(f"{field}:") and words in str(info.value), info.value
    check_ordinary_undisturbed(default_llm.generate(PROMPTS[1:], ORDINARY), alone)
