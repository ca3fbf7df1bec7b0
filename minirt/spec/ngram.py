"""Chapter 11: the n-gram drafter (prompt lookup) - propose the tokens that followed the last n tokens before.

No second model: if the last n tokens of the sequence occurred earlier (in the prompt or in the output), the
tokens that followed that occurrence are a good guess for what follows now - text quoted from the prompt,
code being edited, repeated names. Saxena 2023, "Prompt Lookup Decoding" (transformers'
`prompt_lookup_num_tokens`); vLLM's `NgramProposer` (vllm/v1/spec_decode/ngram_proposer.py), whose semantics
these are: the longest n in [min_n, max_n] whose n-gram occurs earlier, its EARLIEST occurrence (vLLM's
KMP scan keeps "the earliest position in the original tokens"; transformers also takes the first match), an
occurrence may overlap the suffix itself but must end before the last token, and up to k tokens that follow it.
vLLM scans in linear time (KMP over the reversed tokens); the plain search here gives the same answer.
"""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to k draft tokens: those after the earliest earlier occurrence of the longest matching suffix n-gram.

    token_ids: the sequence so far (prompt + output); k: the most tokens to propose; min_n, max_n: the n-gram
    lengths tried, longest first (vLLM's prompt_lookup_min / prompt_lookup_max). Returns [] when no n-gram of
    those lengths occurs earlier, or when k = 0. Raises ValueError for k < 0 or not 1 <= min_n <= max_n.
    """
    if k < 0:
        raise ValueError(f"num_speculative_tokens: must be >= 0, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min/max: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
    tokens = list(token_ids)
    total = len(tokens)
    if k == 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n):                      # occurrences ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []
