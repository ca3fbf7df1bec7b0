"""Chapter 11: which drafted tokens the target keeps - greedy acceptance and rejection sampling.

A drafter proposes k tokens `x_0 .. x_{k-1}`; the target model scores the k+1 positions that follow the
context in one forward pass, giving k+1 next-token distributions `p_0 .. p_k` (after the request's own
temperature, top-k and top-p: `minirt.sampling.probs_after_filters`). Each function below returns the tokens
the request emits this step: the accepted prefix of the draft, then one token from the target itself (the
correction at the first rejection, or the bonus token after k acceptances), so 1 .. k+1 tokens.

* Greedy (`greedy_accept`): keep the draft while it equals the target's argmax; the output is exactly what
  decoding one token at a time would have produced.
* Sampling (`rejection_sample`): accept `x_i` with probability `min(1, p_i(x_i) / q_i(x_i))`; at the first
  rejection draw from the residual `norm(max(0, p_i - q_i))`. Every emitted token is then distributed
  exactly as if sampled from the target alone (Leviathan et al. 2023, "Fast Inference from Transformers via
  Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023, "Accelerating Large Language Model
  Decoding with Speculative Sampling", Algorithm 2). vLLM's `RejectionSampler` does the same on the GPU.
"""

from __future__ import annotations

import torch


def _ids(tokens) -> list[int]:
    """A list of Python ints from a list, tuple or 1-D tensor of token ids."""
    return [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]


def greedy_accept(draft, target_argmax) -> list[int]:
    """The tokens a greedy request emits: the longest prefix of `draft` matching the target, then its next.

    draft: `[k]` token ids proposed; target_argmax: `[k+1]` the target's argmax at each drafted position and
    the one after. Returns 1 .. k+1 token ids (lists or 1-D tensors in, a list out).
    Raises ValueError unless len(target_argmax) == len(draft) + 1.
    """
    draft, target = _ids(draft), _ids(target_argmax)
    if len(target) != len(draft) + 1:
        raise ValueError(f"target_argmax: needs len(draft) + 1 = {len(draft) + 1} tokens, got {len(target)}")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def rejection_sample(draft, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled request emits: accepted drafts, then a correction or a bonus token (1 .. k+1).

    draft: `[k]` token ids; draft_probs: `[k, V]` the drafter's distributions q_i each `x_i` was drawn from,
    or None for a deterministic drafter (n-gram lookup: q_i is one-hot at `x_i`); target_probs: `[k+1, V]`
    the target's distributions p_0 .. p_k. generator: the request's own (its seed), or None for torch's
    global one. The draws, in this order: `torch.rand(k)` (none if k = 0), then one `torch.multinomial` -
    from the residual at the first i with `u_i * q_i(x_i) >= p_i(x_i)` (a rejection; u_i < 1, so this is
    u_i >= min(1, p/q)), else from p_k (the bonus token).
    Raises ValueError for mismatched shapes.
    """
    draft = _ids(draft)
    k = len(draft)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs: needs shape [len(draft) + 1 = {k + 1}, V], got {list(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs: needs shape [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}")
    p = target_probs.float()
    rows = torch.arange(k, device=p.device)
    x = torch.tensor(draft, dtype=torch.long, device=p.device)
    p_x = p[rows, x]                                          # p_i(x_i)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.float()[rows, x]
    if k:
        u = torch.rand(k, generator=generator, device=p.device)
        rejected = (u * q_x >= p_x).tolist()                  # accept iff u < p/q: probability min(1, p/q)
    else:
        rejected = []
    n = rejected.index(True) if True in rejected else k      # drafts accepted
    if n == k:
        weights = p[k]                                        # all accepted: the bonus token from p_k
    else:
        q = torch.nn.functional.one_hot(x[n], p.shape[1]).float() if draft_probs is None else draft_probs[n].float()
        weights = (p[n] - q).clamp(min=0)                     # the residual max(0, p - q)
        if not bool(weights.sum() > 0):                       # p == q up to rounding: nothing left but p
            weights = p[n]
    token = int(torch.multinomial(weights / weights.sum(), 1, generator=generator)[0])
    return draft[:n] + [token]
