"""The course's multiple-choice questions cannot be answered by a rule of thumb: across all chapters, at most
40 % of the right answers are the strictly longest choice, and at most 40 % sit in one quarter of the positions
(a choice's quarter is floor(4 * index / number of choices), so for four choices it is its letter)."""

from __future__ import annotations

from collections import Counter

from minirt.course import activities

LIMIT = 0.40


def _choice_questions() -> list[dict]:
    out = []
    for path in sorted(activities.QUIZ_DIR.glob("ch[0-9][0-9].json")):
        out += [q for q in activities.load(path.stem)["quiz"] if q["kind"] == "choice"]
    return out


def bias(questions: list[dict]) -> dict:
    """How guessable `questions` are: the share whose right answer is the strictly longest choice (plain
    text length), and the share of right answers in the most frequent quarter of the positions."""
    longest, quarters = 0, Counter()
    for q in questions:
        texts = [activities._plain(c["text"]) for c in q["choices"]]
        right = next(i for i, c in enumerate(q["choices"]) if c["correct"])
        if all(len(texts[right]) > len(t) for i, t in enumerate(texts) if i != right):
            longest += 1
        quarters[4 * right // len(texts)] += 1
    n = max(1, len(questions))
    top, count = max(quarters.items(), key=lambda kv: kv[1]) if quarters else (0, 0)
    return {"questions": len(questions), "longest": longest / n, "top_quarter": top, "in_top_quarter": count / n,
            "quarters": dict(sorted(quarters.items()))}


def problems(b: dict) -> list[str]:
    found = []
    if b["longest"] > LIMIT:
        found.append(f"{b['longest']:.0%} of the {b['questions']} choice questions have the strictly longest choice "
                     f"as their right answer (limit {LIMIT:.0%}): make the distractors as long as the answer")
    if b["in_top_quarter"] > LIMIT:
        found.append(f"{b['in_top_quarter']:.0%} of the right answers sit in quarter {b['top_quarter']} of the "
                     f"positions (limit {LIMIT:.0%}; per quarter {b['quarters']}): move some right answers")
    return found


def test_right_answers_are_neither_the_longest_nor_in_one_place():
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
    always_longest = [_q(k % 4, [10 + 20 * (i == k % 4) for i in range(4)]) for k in range(8)]
    assert bias(always_longest)["longest"] == 1.0 and len(problems(bias(always_longest))) == 1
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
    assert bias([q])["longest"] == 0.0
