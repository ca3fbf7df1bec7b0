"""Chapter 05: incremental detokenization - the text of a growing output, one token at a time, in linear time.

Decoding the whole output again after every token costs O(n) per token, O(n^2) per request. Decoding each
token alone is wrong twice over: a token's text can depend on the one before it (SentencePiece drops the
leading space of the first piece only), and one character can span several tokens (the 4 bytes of an emoji in
byte-level BPE, or Llama-2's byte-fallback tokens `<0xF0><0x9F><0x98><0x80>`), so a single token may decode
to U+FFFD, the replacement character, until the rest of its character arrives.

The scheme is vLLM's `detokenize_incrementally` (its detokenizer_utils.py), which
`tokenizers`' `DecodeStream` also implements in Rust: keep two offsets into the token ids. Tokens before
`read_offset` are already text; the tokens from `prefix_offset` to `read_offset` (the last chunk that became
text) are decoded again together with the new ones, as context, and the new text is what the longer decode adds
to the shorter one. Both decodes are a few tokens long, so the work per token does not grow with the output.
The decoding itself is the tokenizer's own `decode(ids, skip_special_tokens=True)`, the same call whose result
on the whole output is the answer, so any tokenizer with a `decode` works (fast, slow, or a toy).

Text becomes final ("settled") only where no later token can change it, which needs two rules:
- it must not end in U+FFFD: an unfinished UTF-8 character decodes to one (a genuine U+FFFD is held back
  until the next token shows it stays);
- its last token must not be a byte-fallback token: the `ByteFallback` decoder of `tokenizers` turns a run of
  byte tokens into text only if the whole run is valid UTF-8, and otherwise into one U+FFFD per byte, so
  `<0xC3><0xA9>` reads "é" until a following `<0x80>` turns all three into "\ufffd\ufffd\ufffd".
`DecodeStream` lacks the second rule (it raises "Invalid prefix" on exactly that sequence), so minirt does
not use it. For the second rule to see the last byte, the special tokens that decode skips are dropped before
decoding (`<0xC3>`, `</s>`, `<0xA9>` decodes to "é"). Text that is not settled yet is still available (`text`
is always what the whole output decodes to now: stop strings are matched on it), it is just not final.
"""

from __future__ import annotations

import functools

REPLACEMENT_CHAR = "\ufffd"


def is_byte_token(token: str | None) -> bool:
    """Whether `token` is a byte-fallback token such as `<0xE2>`: the test `tokenizers`' ByteFallback decoder uses."""
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def skipped_token_ids(tokenizer) -> frozenset[int]:
    """The special token ids that `decode(..., skip_special_tokens=True)` drops, checked one by one (a token
    listed as special that still decodes to text is kept). Dropping them before decoding changes nothing.
    Cached per tokenizer (an unhashable one is checked again each time)."""
    try:
        return _skipped_token_ids(tokenizer)
    except TypeError:
        return _skipped_token_ids.__wrapped__(tokenizer)


@functools.lru_cache(maxsize=16)
def _skipped_token_ids(tokenizer) -> frozenset[int]:
    ids = getattr(tokenizer, "all_special_ids", None) or ()
    return frozenset(i for i in ids if tokenizer.decode([i], skip_special_tokens=True) == "")


class IncrementalDetokenizer:
    """The text of a list of token ids that grows by one id at a time (vLLM's prefix/read offsets).

    After each `append`, `text == tokenizer.decode(ids, skip_special_tokens=True)` of all the ids appended so
    far, and `text[:num_settled_chars]` is final: no later token changes it. Each append decodes the last two
    chunks of text, a few tokens; only a run of tokens with no settling point (byte-fallback tokens in a row,
    or text that still ends in U+FFFD token after token) is decoded again whole at each token of the run.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []      # as appended, less the special tokens that decode drops anyway
        self.prefix_offset = 0              # start of the context decoded again with the new tokens
        self.read_offset = 0                # tokens before this are in settled_text
        self.settled_text = ""              # the text no later token can change
        self.tail = ""                      # the rest of the text so far; may still change
        self._prefix_text = ""              # decode(token_ids[prefix_offset:read_offset])
        self._skipped = skipped_token_ids(tokenizer)
        self._to_token = getattr(tokenizer, "convert_ids_to_tokens", None)

    @property
    def text(self) -> str:
        """What all the ids appended so far decode to."""
        return self.settled_text + self.tail

    @property
    def num_settled_chars(self) -> int:
        return len(self.settled_text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, token_id: int) -> None:
        """Add one token id; updates `text` (and `settled_text` where the text became final)."""
        if token_id in self._skipped:
            return
        ids = self.token_ids
        ids.append(token_id)
        window = self._decode(ids[self.prefix_offset:])
        if not window.startswith(self._prefix_text):
            # The decoder is not local here (transformers' clean_up_tokenization_spaces can do this: "a " then
            # "," reads "a,"): decode from the start instead; text is right again, settled text was not final.
            self.prefix_offset = self.read_offset = 0
            self.settled_text = self._prefix_text = ""
            window = self._decode(ids)
        self.tail = window[len(self._prefix_text):]
        byte_token = self._to_token is not None and is_byte_token(self._to_token(token_id))
        if self.tail and not self.tail.endswith(REPLACEMENT_CHAR) and not byte_token:
            self.settled_text += self.tail
            self.tail = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self._prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
