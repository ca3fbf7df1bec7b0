"""Every check case's label agrees with its data: what a label claims ("EOS first produced at step 3",
"-> ValueError", "refused", "preemption by recompute", "block boundary B+1", ...) is checked against the case's
inputs and the reference's own outcome on them. Each rule must match at least one case, so a renamed label
cannot make a rule vacuous."""

from __future__ import annotations

import re

import pytest
import torch

from minirt.course import checks


def _rows():
    """(task, case name, inputs, (kind, value) of the reference) of every case of every task."""
    out = []
    for task in checks.TASKS:
        spec = checks.SPECS[task]()
        for case in spec.cases:
            out.append((task, case.name, case.make(), checks.reference_outcome(spec, case)))
    return out


@pytest.fixture(scope="module")
def rows():
    return _rows()


def _raised(outcome, error: str) -> bool:
    kind, value = outcome
    if kind == "raised":
        return type(value).__name__ == error
    last = value[-1] if isinstance(value, list) and value and isinstance(value[-1], dict) else {}
    return str(last.get("returned", "")).startswith(f"raised {error}")


def _eos_first_at(m, inputs, outcome):
    _, n, eos = inputs
    out, k = outcome[1], int(m.group(1))
    return len(out) == k + 1 and out[-1] == eos and eos not in out[:-1] and k + 1 <= n


def _late_eos(m, inputs, outcome):
    return _eos_first_at(m, inputs, outcome) and int(m.group(1)) >= 3 and int(m.group(1)) + 1 < inputs[1]


def _eos_first_step(m, inputs, outcome):
    _, n, eos = inputs
    out = outcome[1]
    rows = out if out and isinstance(out[0], list) else [out]
    return n > 1 and all(r == [eos] for r in rows)


def _eos_never(m, inputs, outcome):
    _, n, eos = inputs
    out = outcome[1]
    rows = out if out and isinstance(out[0], list) else [out]
    return all(eos not in r and len(r) == n for r in rows)


def _one_row_early(m, inputs, outcome):
    _, n, eos = inputs
    rows = outcome[1]
    return any(r[-1] == eos and len(r) < n for r in rows) and any(len(r) == n and eos not in r for r in rows)


def _per_row_positions(m, inputs, outcome):
    """Rows with different pad counts, and each row's recorded positions run 0, 1, ... over its prompt and the
    tokens fed back (every generated token but the last)."""
    prompts, n, _, _ = inputs
    value = outcome[1]
    return len({len(p) for p in prompts}) >= 2 and all(
        pos == list(range(len(p) + len(toks) - 1)) and len(toks) == n
        for p, pos, toks in zip(prompts, value["positions"], value["tokens"], strict=True))


def _span(inputs):
    _, start, end, B = inputs
    return end - start, B, start


def _boundary(m, inputs, outcome):
    length, B, start = _span(inputs)
    return start == 0 and length == B + {None: 0, "-1": -1, "+1": 1}[m.group(1)]


def _finish(reason):
    return lambda m, inputs, outcome: outcome[1][-1]["finish_reason"] == reason


def _ignore_eos(m, inputs, outcome):
    trace = outcome[1]
    return checks.ToyTokenizer.eos_token_id in trace[-1]["token_ids"][2:] and trace[-1]["finish_reason"] != "stop"


def _refused(m, inputs, outcome):
    return any(step["returned"] is False for step in outcome[1])


def _filled_up(m, inputs, outcome):
    returned = [step["returned"] for step in outcome[1]]
    return returned[0] is True and returned[-1] is False and True in returned[:-1]


def _hits(m, inputs, outcome):
    return outcome[1][-1]["prefix_cache_hits"] > 0


def _no_hits(m, inputs, outcome):
    return outcome[1][-1]["prefix_cache_hits"] == 0


def _preempted(m, inputs, outcome):
    seen_running: set[str] = set()
    for step in outcome[1]:
        if seen_running & set(step.get("waiting", [])):
            return True
        seen_running |= set(step.get("running", []))
    return False


def _shared_blocks(m, inputs, outcome):
    for step in outcome[1]:
        tables = list(step.get("block_tables", {}).values())
        if any(set(a) & set(b) for i, a in enumerate(tables) for b in tables[i + 1:]):
            return True
    return False


def _nobody_overtakes(m, inputs, outcome):
    first = {}
    for step in outcome[1]:
        for rid, _ in step["batch"]:
            first.setdefault(rid, step["step"])
    return first["big"] <= first["small"]


def _empty_splits(m, inputs, outcome):
    _, mx, _ = inputs
    return bool(torch.isinf(mx).any()) and not bool(torch.isinf(mx).all())


MIN_SCALE = torch.tensor(1e-12, dtype=torch.float32)      # float32's nearest to minirt.quant.formats.MIN_SCALE


def _grid(inputs, outcome):
    """(weight in float32 as the check hands it in, weight / the reference's scale per row, the reference's q)."""
    w = inputs[0].float()
    return w, w / outcome[1]["scale"][:, None], outcome[1]["q"]


def _zero_row(m, inputs, outcome):
    w, _, q = _grid(inputs, outcome)
    rows = (w == 0).all(1).nonzero().flatten().tolist()
    return bool(rows) and all(outcome[1]["scale"][r] == MIN_SCALE and bool((q[r] == 0).all()) for r in rows)


def _tiny_row(m, inputs, outcome):
    w, _, q = _grid(inputs, outcome)
    amax, qmax = w.abs().amax(1), {"int8": 127, "fp8": 448}[inputs[1]]
    return any(abs(amax[r].item() - float(m.group(1))) <= 1e-6 * float(m.group(1)) and amax[r] / qmax < MIN_SCALE
               and outcome[1]["scale"][r] == MIN_SCALE and bool((q[r] != 0).any()) for r in range(w.shape[0]))


def _maps_to(m, inputs, outcome):
    """Every "a -> b" of the label: the weights whose value over their scale is exactly a have q exactly b."""
    _, grid, q = _grid(inputs, outcome)
    pairs = re.findall(r"(?<![\w.])(-?\d+(?:\.\d+)?) -> (-?\d+)\b", m.string)
    return bool(pairs) and all(bool((grid == float(a)).any()) and bool((q[grid == float(a)].float() == float(b)).all())
                               for a, b in pairs)


def _negative_extreme(m, inputs, outcome):
    w, _, q = _grid(inputs, outcome)
    at = w.abs().argmax(1)
    return any(w[r, at[r]] < 0 and q[r, at[r]].item() == -int(m.group(1)) for r in range(w.shape[0]))


def _outlier(m, inputs, outcome):
    """A row whose largest magnitude is the outlier and the rest within 5 of the label's typical value; int8 rounds
    the rest to 0 or +-1 (some +-1), e4m3 to zeros and subnormals (below 2^-6, some of each)."""
    w, _, q = _grid(inputs, outcome)
    for r in range(w.shape[0]):
        top = w[r].abs().sort(descending=True).values
        if top[0].item() == float(m.group(1)) and top[1].item() < 5 * float(m.group(2)):
            others = q[r][w[r].abs() < top[0]].float()
            if inputs[1] == "int8":
                return bool((others.abs() <= 1).all()) and bool((others.abs() == 1).any())
            return bool((others == 0).any()) and bool(((others != 0) & (others.abs() < 2.0 ** -6)).any())
    return False


def _unsaturated(m, inputs, outcome):
    """Beyond e4m3's 448 before scaling; after it, every weight over its scale within +-448 (a float32 rounding
    over at most), every q finite, and each row's largest magnitude at +-448."""
    w, grid, q = _grid(inputs, outcome)
    return 448 < w.abs().max().item() <= float(m.group(1)) and bool((grid.abs() <= 448 * (1 + 1e-6)).all()) and \
        bool(q.isfinite().all()) and bool((q.float().abs().amax(1) == 448).all())


def _zero_channel_gives_bias(m, inputs, outcome):
    weight, bias, _, x, _ = inputs
    rows = (weight == 0).all(1).nonzero().flatten().tolist()
    out = outcome[1]["output"]
    return bool(rows) and bias is not None and all(bool((out[..., r] == bias[r]).all()) for r in rows)


# (task prefix, label pattern, predicate(match, inputs, reference outcome))
RULES = [
    ("", r"-> (\w+Error)$", lambda m, i, o: _raised(o, m.group(1))),
    ("", r"raises (\w+Error)$", lambda m, i, o: _raised(o, m.group(1))),
    ("ex01.naive_generate", r"^EOS first produced at step (\d+)", _eos_first_at),
    ("ex01.naive_generate", r"^late EOS: first produced at step (\d+)", _late_eos),
    ("ex0", r"^EOS (?:produced )?at the first step", _eos_first_step),
    ("ex0", r"^EOS never produced", _eos_never),
    ("ex02.kv_cache_generate", r"^EOS ends one row early, others go on", _one_row_early),
    ("ex02.kv_cache_generate", r"^per-row positions: rows with different pad counts", _per_row_positions),
    ("ex03.slot_mapping", r"^block boundary B([+-]1)?$", _boundary),
    ("ex03.slot_mapping", r"^exactly one block$", lambda m, i, o: _span(i) == (i[3], i[3], 0)),
    ("ex03.slot_mapping", r"^empty range", lambda m, i, o: _span(i)[0] == 0),
    ("ex03.slot_mapping", r"^one token$", lambda m, i, o: _span(i)[0] == 1),
    ("ex04.block_hashes", r"\(B([+-]1)?\)", lambda m, i, o: len(i[0]) == i[1] + int(m.group(1) or 0)),
    ("ex04.block_hashes", r"^2B-1 tokens", lambda m, i, o: len(i[0]) == 2 * i[1] - 1),
    ("ex04.match", r"^(?:empty cache|first block differs: no hit|prefix caching disabled)",
     lambda m, i, o: o[1]["returned"] == []),
    ("ex04.match", r"^(?:shared prefix of two blocks|prompt of exactly 2B tokens: one block)",
     lambda m, i, o: len(o[1]["returned"]) == {"shared": 2, "prompt": 1}[m.group(0).split()[0]]),
    ("ex05.append_token", r"'stop'", _finish("stop")),
    ("ex05.append_token", r"'length'|^length limit", _finish("length")),
    ("ex05.append_token", r"^ignore_eos", _ignore_eos),
    ("ex05.try_allocate", r"refused", _refused),
    ("ex05.try_allocate", r"^pool filled up", _filled_up),
    ("ex05.try_allocate", r"^prefix hit", _hits),
    ("ex05.try_allocate", r"no hits", _no_hits),
    ("ex06.split_budget", r"^more decodes than budget", lambda m, i, o: i[1] > i[0]),
    ("ex06.split_budget", r"^budget of one token", lambda m, i, o: i[0] == 1),
    ("ex06.schedule", r"preemption", _preempted),
    ("ex06.schedule", r"^prefix cache hits", _shared_blocks),
    ("ex06.schedule", r"nobody overtakes", _nobody_overtakes),
    ("ex06.schedule", r"^budget of one token", lambda m, i, o: i[0]["max_num_batched_tokens"] == 1),
    ("ex07.combine_splits", r"empty splits", _empty_splits),
    ("ex07.combine_splits", r"^one split", lambda m, i, o: i[1].shape[-1] == 1),
    ("ex10.quantize", r"^(int8|fp8): ", lambda m, i, o: i[1] == m.group(1)),
    ("ex10.quantize", r"a \[(\d+), (\d+)\] weight by hand|random \[(\d+), (\d+)\]$",
     lambda m, i, o: list(i[0].shape) == [int(g) for g in m.groups() if g]),
    ("ex10.quantize", r"rows of very different magnitudes",
     lambda m, i, o: i[0].abs().amax(1).max() >= 1e5 * i[0].abs().amax(1).min()),
    ("ex10.quantize", r"the largest magnitude is negative: -amax -> -(\d+)$", _negative_extreme),
    ("ex10.quantize", r"(?<![\w.])-?\d+(?:\.\d+)? -> -?\d+\b", _maps_to),
    ("ex10.quantize", r"a zero row: scale MIN_SCALE, q all 0", _zero_row),
    ("ex10.quantize", r"tiny values \(amax ([\d.e+-]+) < 127 \* MIN_SCALE\)", _tiny_row),
    ("ex10.quantize", r"one outlier \(([\d.]+) among values ~([\d.]+)\)", _outlier),
    ("ex10.quantize", r"beyond e4m3's 448 \(\|w\| up to ([\d.e+]+)\)", _unsaturated),
    ("ex10.quantize", r"a bfloat16 weight", lambda m, i, o: i[0].dtype == torch.bfloat16),
    ("ex10.quantize", r"one input channel \(K = 1\)", lambda m, i, o: i[0].shape[1] == 1),
    ("ex10.quantize", r"a 1-D weight", lambda m, i, o: i[0].dim() == 1),
    ("ex10.quantize", r"^method 'int4'", lambda m, i, o: (i[1] if len(i) == 3 else i[2]) == "int4"),
    ("ex10.dequantize", r"^(int8|fp8): ", lambda m, i, o: i[2] == m.group(1)),
    ("ex10.dequantize", r"a \[(\d+), (\d+)\] q by hand|random \[(\d+), (\d+)\]",
     lambda m, i, o: list(i[0].shape) == [int(g) for g in m.groups() if g]),
    ("ex10.dequantize", r"the extremes \+-127", lambda m, i, o: {127, -127} <= set(i[0].flatten().tolist())),
    ("ex10.dequantize", r"\+-448 and the e4m3 subnormals \+-2\^-9",
     lambda m, i, o: {448.0, -448.0, 2.0 ** -9, -(2.0 ** -9)} <= set(i[0].flatten().tolist())),
    ("ex10.dequantize", r"a zero row with scale MIN_SCALE: exact zeros", lambda m, i, o: any(
        i[1][r] == MIN_SCALE and bool((o[1][r] == 0).all()) for r in range(i[0].shape[0]))),
    ("ex10.dequantize", r"every scale above 1", lambda m, i, o: bool((i[1] > 1).all())),
    ("ex10.dequantize", r"one input channel \(K = 1\)", lambda m, i, o: i[0].shape[1] == 1),
    ("ex10.dequantize", r"^scale of shape \[N, 1\]", lambda m, i, o: list(i[1].shape) == [i[0].shape[0], 1]),
    ("ex10.dequantize", r"^scale of shape \[N \+ 1\]", lambda m, i, o: list(i[1].shape) == [i[0].shape[0] + 1]),
    ("ex10.quantized_linear", r"^(int8|fp8), (no bias|bias)",
     lambda m, i, o: i[2] == m.group(1) and (i[1] is None) == (m.group(2) == "no bias")),
    ("ex10.quantized_linear", r"bfloat16: the output in bfloat16",
     lambda m, i, o: i[0].dtype == i[3].dtype == o[1]["output"].dtype == torch.bfloat16),
    ("ex10.quantized_linear", r"an all-zero output channel gives its bias", _zero_channel_gives_bias),
    ("ex10.quantized_linear", r"x of shape \[K\]", lambda m, i, o: list(i[3].shape) == [i[0].shape[1]]),
    ("ex10.quantized_linear", r"x \[(\d+), (\d+), K\] \(leading dims\)",
     lambda m, i, o: list(i[3].shape) == [int(m.group(1)), int(m.group(2)), i[0].shape[1]]),
    ("ex10.quantized_linear", r"random \[(\d+), (\d+)\], x \[(\d+), (\d+)\]",
     lambda m, i, o: list(i[0].shape) + list(i[3].shape) == [int(g) for g in m.groups()]),
    ("ex10", r"column-major \(non-contiguous\)", lambda m, i, o: i[-1] == "column-major"
     and not checks._column_major(i[3] if len(i) == 5 else i[0]).is_contiguous()),
    ("ex11.greedy_accept", r"^no drafts \(k = 0\)", lambda m, i, o: i[0] == [] and o[1] == i[1]),
    ("ex11.greedy_accept", r"^all (\d+) drafts accepted", lambda m, i, o: len(i[0]) == int(m.group(1))
     and o[1] == i[1]),
    ("ex11.greedy_accept", r"^the first draft rejected", lambda m, i, o: o[1] == i[1][:1] != i[0][:1]),
    ("ex11.greedy_accept", r"^the last draft rejected", lambda m, i, o: len(o[1]) == len(i[0]) and o[1][-1] != i[0][-1]),
    ("ex11.rejection_sample", r"^no drafts", lambda m, i, o: i[1][0] == [] and len(o[1]) == 1),
    ("ex11.rejection_sample", r"all accepted, then the bonus token", lambda m, i, o: o[1][:-1] == i[1][0]),
    ("ex11.rejection_sample", r"rejected at once", lambda m, i, o: len(o[1]) == 1 and o[1][0] != i[1][0][0]),
    ("ex11.rejection_sample", r"^draft_probs None", lambda m, i, o: i[1][1] is None),
    ("ex11.rejection_sample", r"\(k = (\d+), V = (\d+)\)", lambda m, i, o: i[0] == "distribution"
     and tuple(i[1][0].shape) == (int(m.group(1)) + 1, int(m.group(2)))),
    ("ex11.rollback_block_table", r"^block boundary B([+-]1)?$",
     lambda m, i, o: i[4] == i[5] + {None: 0, "-1": -1, "+1": 1}[m.group(1)]),
    ("ex11.rollback_block_table", r"^nothing rejected", lambda m, i, o: o[1]["returned"] == []),
    ("ex11.rollback_block_table", r"every block released", lambda m, i, o: o[1]["block_table"] == [] and i[1]),
    ("ex11.rollback_block_table", r"shared block \(ref_count 2\) is released, not freed",
     lambda m, i, o: any(o[1]["ref_counts"][b] == 1 for b in o[1]["returned"])),
]


def labels_against_data(rows) -> tuple[list[str], set[int]]:
    """(the cases whose data contradicts their label, the indices of the rules that matched some case)."""
    wrong, used = [], set()
    for task, name, inputs, outcome in rows:
        for k, (prefix, pattern, holds) in enumerate(RULES):
            m = re.search(pattern, name)
            if task.startswith(prefix) and m:
                used.add(k)
                try:
                    ok = holds(m, inputs, outcome)
                except (KeyError, IndexError, TypeError, AttributeError) as e:
                    ok, name = False, f"{name} ({type(e).__name__}: {e})"
                if not ok:
                    wrong.append(f"{task} '{name}': the label says {pattern!r}; the data does not")
    return wrong, used


def test_every_case_label_agrees_with_its_data(rows):
    wrong, used = labels_against_data(rows)
    assert not wrong, "\n".join(wrong)
    unused = [RULES[k][:2] for k in range(len(RULES)) if k not in used]
    assert not unused, f"rules that match no case (a label was renamed?): {unused}"


def test_the_label_rules_catch_a_false_label(rows):
    """The rules themselves: exercise 01's old case (EOS = "the token at step 3" of a prompt whose model output
    repeats one token, so the reference stops at step 0) and a refusal that admits are caught."""
    from minirt.generate import naive_generate

    model = checks.tiny_model()
    prompt = checks._prompts(11, [1, 2, 7, 20, 33])[3]
    out = naive_generate(model, prompt, 8)
    eos = out[3]
    assert eos in out[:3]                                  # the tiny model repeats itself here
    bad = [("ex01.naive_generate", "EOS first produced at step 3", (prompt, 8, eos),
            ("ok", naive_generate(model, prompt, 8, eos)))]
    admit = next(r for r in rows if r[0] == "ex05.try_allocate" and "refused" in r[1])
    trace = [dict(step, returned=True) for step in admit[3][1]]
    bad.append((admit[0], admit[1], admit[2], ("ok", trace)))
    wrong, _ = labels_against_data(bad)
    assert len(wrong) == 2, wrong


def test_the_quantization_rules_catch_false_labels(rows):
    """Exercise 10's rules: a reference that rounded a halfway value away from zero, a zero row whose scale is 0
    instead of MIN_SCALE, and a column-major case handed a contiguous weight contradict their labels."""
    def find(part):
        return next(r for r in rows if r[0] == "ex10.quantize" and part in r[1])

    task, name, inputs, (kind, value) = find("halfway values round to even")
    q = value["q"].clone()
    q[0, 1] = 1                                            # 0.5 -> 1: away from zero
    bad = [(task, name, inputs, (kind, {**value, "q": q}))]
    task, name, inputs, (kind, value) = find("int8: a zero row")
    scale = value["scale"].clone()
    scale[(inputs[0] == 0).all(1)] = 0.0
    bad.append((task, name, inputs, (kind, {**value, "scale": scale})))
    task, name, inputs, outcome = find("int8: a column-major")
    bad.append((task, name, (inputs[0], inputs[1], "row-major"), outcome))
    wrong, _ = labels_against_data(bad)
    assert len(wrong) == 3, wrong
