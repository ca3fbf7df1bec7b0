"""Chapter 01: the naive generation loop.

Every step feeds the *whole* sequence so far through the model and keeps only the last position's
logits. Step t costs a forward over `prompt_len + t` tokens, so generating n tokens costs
O(n * (prompt_len + n)) token-forwards and O((prompt_len + n)^2) attention work per step: the
quadratic cost that the KV cache (chapter 02) removes.
"""

from __future__ import annotations

import torch

from minirt.model.decoder import DecoderModel


@torch.inference_mode()
def naive_generate(model: DecoderModel, prompt_ids: list[int], max_new_tokens: int,
                   eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding by re-running the full prefix each step.

    prompt_ids: the prompt's token ids (non-empty). Returns the generated ids only (at most
    `max_new_tokens`; the EOS token, when produced, is included and ends generation).
    Raises ValueError on an empty prompt or `max_new_tokens < 1`.
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids: must hold at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    tokens = list(prompt_ids)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        input_ids = torch.tensor([tokens], device=model.device)                 # [1, T]
        positions = torch.arange(len(tokens), device=model.device)[None]        # [1, T]
        hidden = model(input_ids, positions)                                      # [1, T, hidden]
        next_id = int(model.compute_logits(hidden[:, -1]).argmax(-1))            # only the last row is used
        generated.append(next_id)
        tokens.append(next_id)
        if next_id == eos_token_id:
            break
    return generated
