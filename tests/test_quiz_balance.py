"""The course's multiple-choice questions cannot be answered by a rule of thumb: across all chapters, at most
40 % of the right answers are the strictly longest choice, at most 40 % sit in one quarter of the positions
(a choice's quarter is floor(4 * index / number of choices), so for four choices it is its letter), at most 40 %
sit at any one length rank, and at least 15 % at length rank 0 (a right answer that is never the longest is as
much a tell as one that always is).

A choice's length rank is its place when the choices are sorted by plain-text length, longest first: rank 0 is
the longest. Ties are broken at random, so a right answer tied with k distractors counts 1 / (k + 1) at each of
the k + 1 ranks the tied group spans; a rank's share is then exactly how often a student who always picks the
choice of that rank (and tosses a coin between equal lengths) is right."""

from __future__ import annotations

from collections import Counter

from minirt.course import activities

LIMIT = 0.40
LONGEST_AT_LEAST = 0.15


def _choice_questions() -> list[dict]:
    out = []
    for path in sorted(activities.QUIZ_DIR.glob("ch[0-9][0-9].json")):
        out += [q for q in activities.load(path.stem)["quiz"] if q["kind"] == "choice"]
    return out


def bias(questions: list[dict]) -> dict:
    """How guessable `questions` are: the share whose right answer is the strictly longest choice (plain
    text length), the share of right answers in the most frequent quarter of the positions, and the share of
    right answers at each length rank (0 = longest; ties broken at random, see the module docstring)."""
    longest, quarters, ranks = 0, Counter(), Counter()
    for q in questions:
        texts = [activities._plain(c["text"]) for c in q["choices"]]
        right = next(i for i, c in enumerate(q["choices"]) if c["correct"])
        others = [len(t) for i, t in enumerate(texts) if i != right]
        if all(len(texts[right]) > n for n in others):
            longest += 1
        quarters[4 * right // len(texts)] += 1
        above = sum(n > len(texts[right]) for n in others)
        tied = sum(n == len(texts[right]) for n in others)
        for r in range(above, above + tied + 1):
            ranks[r] += 1 / (tied + 1)
    n = max(1, len(questions))
    top, count = max(quarters.items(), key=lambda kv: kv[1]) if quarters else (0, 0)
    return {"questions": len(questions), "longest": longest / n, "top_quarter": top, "in_top_quarter": count / n,
            "quarters": dict(sorted(quarters.items())),
            "ranks": {r: ranks[r] / n for r in sorted(ranks)}}


def problems(b: dict) -> list[str]:
    found = []
    if b["longest"] > LIMIT:
        found.append(f"{b['longest']:.0%} of the {b['questions']} choice questions have the strictly longest choice "
                     f"as their right answer (limit {LIMIT:.0%}): make the distractors as long as the answer")
    if b["in_top_quarter"] > LIMIT:
        found.append(f"{b['in_top_quarter']:.0%} of the right answers sit in quarter {b['top_quarter']} of the "
                     f"positions (limit {LIMIT:.0%}; per quarter {b['quarters']}): move some right answers")
    shares = ", ".join(f"{r}: {v:.0%}" for r, v in b["ranks"].items())
    for r, share in b["ranks"].items():
        if share > LIMIT + 1e-9:
            found.append(f"{share:.0%} of the right answers are the choice of length rank {r} (0 = longest; limit "
                         f"{LIMIT:.0%}; per rank {shares}): lengthen or shorten some right answers")
    if b["questions"] and b["ranks"].get(0, 0.0) < LONGEST_AT_LEAST - 1e-9:
        found.append(f"only {b['ranks'].get(0, 0.0):.0%} of the right answers are the longest choice (at least "
                     f"{LONGEST_AT_LEAST:.0%}; per rank {shares}): 'never pick the longest' must not work either")
    return found


def test_right_answers_are_neither_the_longest_nor_in_one_place_nor_at_one_length_rank():
    qs = _choice_questions()
    assert len(qs) >= 20, f"only {len(qs)} choice questions found"
    found = problems(bias(qs))
    assert not found, "\n".join(found)


def _q(right: int, lengths: list[int]) -> dict:
    return {"kind": "choice", "choices": [{"text": "x" * n + str(i), "correct": i == right}
                                          for i, n in enumerate(lengths)]}


def test_the_balance_rule_on_synthetic_quizzes():
    """The rule itself: guessable sets fail, balanced ones pass, the 40 % line is where it says."""
    balanced = [_q(k % 4, [10, 10, 10, 10]) for k in range(8)]
    assert problems(bias(balanced)) == []
    assert bias(balanced)["quarters"] == {0: 2, 1: 2, 2: 2, 3: 2}
    assert bias(balanced)["ranks"] == {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}    # four-way ties: a quarter each
    always_longest = [_q(k % 4, [10 + 20 * (i == k % 4) for i in range(4)]) for k in range(8)]
    found = problems(bias(always_longest))
    assert bias(always_longest)["longest"] == 1.0 and bias(always_longest)["ranks"] == {0: 1.0} and len(found) == 2
    assert "strictly longest" in found[0] and "length rank 0" in found[1]
    never_d = [_q(k % 3, [10, 10, 10, 10]) for k in range(9)]          # right answers only in A, B, C
    assert problems(bias(never_d)) == []                                # 33 % each: allowed
    mostly_b = [_q(1, [10, 10, 10, 10])] * 5 + [_q(k, [10, 10, 10, 10]) for k in (0, 2, 3, 0, 2, 3, 0)]
    assert bias(mostly_b)["in_top_quarter"] == 5 / 12 and len(problems(bias(mostly_b))) == 1
    at_limit = [_q(1, [10] * 4)] * 2 + [_q(k, [10] * 4) for k in (0, 2)] + [_q(3, [10] * 4)]   # 40 % in B
    assert problems(bias(at_limit)) == []
    # quarters for other sizes: 3 choices -> 0, 1, 2; 2 choices -> 0, 2; ties for longest do not count
    assert bias([_q(2, [5, 5, 5])])["quarters"] == {2: 1} and bias([_q(1, [5, 5])])["quarters"] == {2: 1}
    assert bias([_q(0, [9, 9, 3])])["longest"] == 0.0
    # markup does not count towards a choice's length
    q = {"kind": "choice", "choices": [{"text": "`ab`", "correct": True}, {"text": "abc", "correct": False}]}
    assert bias([q])["longest"] == 0.0 and bias([q])["ranks"] == {1: 1.0}


def _at_rank(position: int, rank: int) -> dict:
    """A four-choice question whose right answer sits at `position` and is the choice of length `rank`."""
    lengths = [40, 30, 20, 10]
    lengths[position], lengths[rank] = lengths[rank], lengths[position]
    return _q(position, lengths)


def test_the_length_rank_rule_on_synthetic_quizzes():
    """Length ranks: a set where one rank holds over 40 %, or where the longest choice is right under 15 % of
    the time, fails; ties split a question between the ranks they span; the 40 % and 15 % lines are where they say."""
    spread = [_at_rank(k % 4, (k + 1) % 4) for k in range(8)]              # positions and ranks both even
    assert bias(spread)["ranks"] == {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25} and problems(bias(spread)) == []
    second_longest = [_at_rank(k % 4, 1) for k in range(8)]                # "pick the second longest" works
    found = problems(bias(second_longest))
    assert len(found) == 2 and "length rank 1" in found[0] and "longest choice" in found[1]
    never_longest = [_at_rank(k % 4, 1 + k % 3) for k in range(12)]        # 33 % at ranks 1, 2, 3; none at 0
    found = problems(bias(never_longest))
    assert len(found) == 1 and found[0].startswith("only 0%")
    at_limits = [_at_rank(k % 4, r) for k, r in enumerate([1, 1, 0, 2, 3] * 4)]   # 40 % at rank 1, 20 % at 0
    assert bias(at_limits)["ranks"][1] == 0.4 and problems(bias(at_limits)) == []
    over = at_limits + [_at_rank(1, 1)]                                    # 9 of 21 at rank 1: 43 %
    assert [f for f in problems(bias(over)) if "length rank 1" in f]
    low = [_at_rank(k % 4, r) for k, r in enumerate([0, 1, 1, 2, 2, 2, 3, 3, 3, 1, 2, 3, 1])]   # 1 of 13: 8 %
    assert bias(low)["ranks"][0] == 1 / 13 and [f for f in problems(bias(low)) if f.startswith("only 8%")]
    # ties: a right answer tied with one distractor for longest counts half at rank 0 and half at rank 1
    assert bias([_q(0, [9, 9, 3, 2])])["ranks"] == {0: 0.5, 1: 0.5}
    assert bias([_q(2, [9, 5, 5, 5])])["ranks"] == {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}
    assert bias([_q(3, [9, 5, 7, 1])])["ranks"] == {3: 1.0}
