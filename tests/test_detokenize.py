"""Incremental detokenization (`minirt.detokenize`) and the text a `Request` streams and stops on.

Two tokenizer families, both built offline: the embedded model's byte-level BPE (GPT-2/Qwen style: a character
of several bytes spans several tokens) and a tiny Llama-2-style BPE built here with `tokenizers` (byte-fallback
tokens `<0x00>`..`<0xFF>`, Metaspace pre-tokenizer, Llama-2's and Gemma's decoder sequences). The oracle is
always the tokenizer's own `decode(ids, skip_special_tokens=True)` of the whole sequence.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import minirt
from minirt.detokenize import IncrementalDetokenizer
from minirt.request import Request

FFFD = "\ufffd"
SPECIALS = ["<unk>", "<s>", "</s>"]
TRAINING_TEXT = ["the quick brown fox jumps over the lazy dog", "cafe au lait, s'il vous plait",
                 "hello world, hello there", "ROMEO: what light through yonder window breaks"] * 3


def byte_fallback_tokenizer(decoder: str):
    """A tiny Llama-2-style tokenizer: BPE trained here with byte_fallback, ids 3..258 the ordinary tokens
    `<0x00>`..`<0xFF>` (as in Llama-2's vocabulary), Metaspace pre-tokenizer, and the decoder sequence
    transformers gives Llama (Replace, ByteFallback, Fuse, Strip) or Gemma (no Strip)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace = dict(replacement="\u2581", prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    trained.train_from_iterator(TRAINING_TEXT, trainers.BpeTrainer(vocab_size=90, special_tokens=SPECIALS,
                                                                   show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for t in sorted(model["vocab"], key=model["vocab"].get) + ["\u2581hello", "\u2581caf", "\u2581the"]:
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if decoder == "llama" else []))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": None, "llama": None, "gemma": None}


def get_tokenizer(name: str):
    """One tokenizer per family for the whole module (hypothesis tests cannot take function fixtures)."""
    if TOKENIZERS[name] is None:
        if name == "byte_level":
            from transformers import AutoTokenizer

            TOKENIZERS[name] = AutoTokenizer.from_pretrained(minirt.DEFAULT_MODEL)
        else:
            TOKENIZERS[name] = byte_fallback_tokenizer(name)
    return TOKENIZERS[name]


@pytest.fixture(scope="module")
def byte_level():
    return get_tokenizer("byte_level")


def ids_of(tok, *pieces) -> list[int]:
    """Token ids of token strings (for example "\u2581caf", "<0xC3>")."""
    ids = [tok.convert_tokens_to_ids(p) for p in pieces]
    assert tok.unk_token_id not in ids, pieces
    return ids


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def run_request(tok, ids, stop=(), max_new_tokens=None):
    """Append `ids` one by one to a streaming Request as the engine does (append, then finish or a delta).
    Returns (the request, the streamed texts, the text after each token)."""
    params = minirt.SamplingParams(max_new_tokens=max_new_tokens or max(len(ids), 1), stop=stop, ignore_eos=True)
    r = Request("r", None, [1], params, frozenset(), tok)
    r.stream = asyncio.Queue()
    chunks, texts = [], []
    for t, token in enumerate(ids):
        r.append_token(token, float(t))
        texts.append(r.text)
        if r.finish_reason is not None:
            r.finish(r.finish_reason)
        delta = r.stream_delta()
        if delta is not None:
            chunks.append(delta.text)
        if r.is_finished:
            break
    if not r.is_finished:
        r.finish("length")
        chunks.append(r.stream_delta().text)
    return r, chunks, texts


def assert_adds_up(chunks, final):
    """Every prefix of the stream is a prefix of the final text, and the whole stream is that text."""
    streamed = ""
    for chunk in chunks:
        streamed += chunk
        assert final.startswith(streamed), (streamed, final)
    assert streamed == final


def check_stream(tok, ids):
    """The stream's pieces add up to the oracle, and no piece is ever taken back (so no U+FFFD is streamed
    that the final text does not hold at that place); the request's text is the oracle after every token."""
    r, chunks, texts = run_request(tok, ids)
    assert r.text == decode(tok, ids)
    assert_adds_up(chunks, r.text)
    assert texts == [decode(tok, ids[:k]) for k in range(1, len(ids) + 1)]
    return chunks


# ---------------------------------------------------------------------------------------------------------
# characters split across tokens
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["a\U0001F600b", "caf\u00e9 au lait", "\u4e2d\u6587 ok", "na\u00efve \u20ac5"])
def test_byte_level_split_character_arrives_whole(byte_level, text):
    ids = byte_level.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()) + 1, "the test needs characters split across tokens"
    chunks = check_stream(byte_level, ids)
    assert all(FFFD not in c for c in chunks)
    assert "".join(chunks) == text


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_byte_fallback_character_streams_once_the_byte_run_ends(name):
    tok = get_tokenizer(name)
    ids = ids_of(tok, "\u2581hello", "\u2581caf", "<0xC3>", "<0xA9>", "\u2581", "<0xF0>", "<0x9F>", "<0x98>",
                 "<0x80>", "\u2581", "<0xE4>", "<0xB8>", "<0xAD>", "<0xE6>", "<0x96>", "<0x87>", "\u2581the")
    chunks = check_stream(tok, ids)
    assert all(FFFD not in c for c in chunks)
    assert "\u00e9" in chunks[4] and "\u4e2d\u6587" in chunks[-1]   # the run's text comes when a non-byte token follows


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_byte_fallback_run_spoiled_by_a_later_byte_is_never_streamed(name):
    """ByteFallback decodes a byte run as a whole: "<0xC3><0xA9>" reads "\u00e9" until "<0x80>" turns the three
    bytes into three U+FFFD. The stream must not have sent the "\u00e9" (nor did DecodeStream survive this)."""
    tok = get_tokenizer(name)
    ids = ids_of(tok, "\u2581caf", "<0xC3>", "<0xA9>", "<0x80>", "\u2581the")
    assert decode(tok, ids[:3]).endswith("\u00e9") and FFFD * 3 in decode(tok, ids)
    chunks = check_stream(tok, ids)
    assert not any("\u00e9" in c for c in chunks)


def test_genuine_replacement_characters_stay(byte_level):
    lone = byte_level.convert_tokens_to_ids("\u00a9")          # the byte 0xA9 alone: not a character
    for ids in ([65, lone], [65, lone, lone, 66], [lone]):
        assert FFFD in decode(byte_level, ids)
        check_stream(byte_level, ids)


@pytest.mark.parametrize("name", ["byte_level", "llama"])
def test_skipped_special_tokens_inside_a_character(name):
    tok = get_tokenizer(name)
    eos = tok.eos_token_id
    pieces = tok.encode("x\u00e9\U0001F600y", add_special_tokens=False)
    ids = [eos] + [i for p in pieces for i in (p, eos)]
    assert decode(tok, ids) == decode(tok, pieces)
    check_stream(tok, ids)


# ---------------------------------------------------------------------------------------------------------
# property tests over random token ids
# ---------------------------------------------------------------------------------------------------------
def _interesting_ids(name: str) -> list[int]:
    """Ids that split characters: byte tokens, the pieces of multi-byte text, and special tokens."""
    tok = get_tokenizer(name)
    if name == "byte_level":
        byte_ids = sorted(i for t, i in tok.get_vocab().items() if len(t) == 1)
    else:
        byte_ids = list(range(3, 259))
    pieces = tok.encode(" caf\u00e9 \U0001F600 \u4e2d\u6587 hello the", add_special_tokens=False)
    return byte_ids + pieces + sorted(tok.all_special_ids)


def token_ids(name: str, max_size: int = 40):
    vocab = len(get_tokenizer(name))
    interesting = _interesting_ids(name)
    return st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(interesting)), max_size=max_size)


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", list(TOKENIZERS))
@SETTINGS
@given(data=st.data())
def test_stream_property(name, data):
    check_stream(get_tokenizer(name), data.draw(token_ids(name)))


@pytest.mark.parametrize("name", list(TOKENIZERS))
@SETTINGS
@given(data=st.data())
def test_detokenizer_property(name, data):
    """The detokenizer alone: `text` is the oracle after every token and settled text is never changed."""
    tok = get_tokenizer(name)
    ids = data.draw(token_ids(name))
    d = IncrementalDetokenizer(tok)
    settled = ""
    for k, token in enumerate(ids, 1):
        d.append(token)
        assert d.text == decode(tok, ids[:k])
        assert d.settled_text.startswith(settled)
        settled = d.settled_text
    assert decode(tok, ids).startswith(settled)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@SETTINGS
@given(data=st.data())
def test_stop_string_property(name, data):
    """A stop string ends the request at the first token after which the text (the oracle's decode of the
    tokens so far) holds it; the text is cut before it; the stream never shows more than that text."""
    tok = get_tokenizer(name)
    ids = data.draw(token_ids(name, 30))
    texts = [decode(tok, ids[:k]) for k in range(1, len(ids) + 1)]
    source = data.draw(st.sampled_from([t for t in texts if t] or ["xyz"]))
    start = data.draw(st.integers(0, len(source) - 1))
    stop = source[start:start + data.draw(st.integers(1, 4))]
    r, chunks, _ = run_request(tok, ids, stop=(stop,))
    hit = next((k for k, t in enumerate(texts) if stop in t), None)
    if hit is None:
        assert r.finish_reason == "length" and r.text == decode(tok, ids)
    else:
        assert r.finish_reason == "stop" and r.num_output_tokens == hit + 1, (stop, texts)
        assert r.text == texts[hit][:texts[hit].find(stop)]
    assert stop not in r.text
    assert_adds_up(chunks, r.text)


# ---------------------------------------------------------------------------------------------------------
# stop strings with multi-byte characters
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stop", ["\u00e9", "f\u00e9", "\u00e9 au", "\U0001F600", "\u4e2d"])
def test_byte_level_stop_string_with_multibyte_character(byte_level, stop):
    text = "caf\u00e9 au lait \U0001F600 \u4e2d\u6587"
    ids = byte_level.encode(text, add_special_tokens=False)
    complete = next(k for k in range(1, len(ids) + 1) if stop in decode(byte_level, ids[:k]))
    r, chunks, _ = run_request(byte_level, ids, stop=(stop,))
    assert r.finish_reason == "stop" and r.num_output_tokens == complete
    assert r.text == text[:text.find(stop)] == "".join(chunks)


def test_stop_string_ending_in_multibyte_character_is_not_streamed(byte_level):
    """"f\u00e9": the "f" is settled while "\u00e9" is still one byte short; it must be held back with it."""
    ids = byte_level.encode("caf\u00e9 au lait", add_special_tokens=False)
    r, chunks, _ = run_request(byte_level, ids, stop=("f\u00e9",))
    assert r.text == "ca" and "".join(chunks) == "ca"


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_byte_fallback_stop_string_found_at_the_completing_token(name):
    tok = get_tokenizer(name)
    ids = ids_of(tok, "\u2581caf", "<0xC3>", "<0xA9>", "\u2581the", "\u2581", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>")
    for stop, at in (("\u00e9", 3), ("f\u00e9", 3), ("\U0001F600", 9)):
        r, chunks, _ = run_request(tok, ids, stop=(stop,))
        assert r.finish_reason == "stop" and r.num_output_tokens == at, stop
        assert stop not in r.text and r.text == "".join(chunks)


# ---------------------------------------------------------------------------------------------------------
# linear time: decode work per token does not grow with the output
# ---------------------------------------------------------------------------------------------------------
class CountingTokenizer:
    """Forwards to a tokenizer and counts the token ids `decode` is given."""

    def __init__(self, tok):
        self.tok, self.ids_decoded, self.calls = tok, 0, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.ids_decoded += len(ids)
        return self.tok.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("eos_every", [0, 2, 100])
def test_decode_work_is_linear(name, eos_every):
    """Text with split characters; with EOS (ignored) after every token or as long runs."""
    tok = get_tokenizer(name)
    sentence = " ROMEO: caf\u00e9, \U0001F600 \u4e2d\u6587 the quick brown fox."
    per_token = []
    for n in (400, 1600):
        ids = []
        while len(ids) < n:
            for i in tok.encode(sentence, add_special_tokens=False):
                ids += [i] if not eos_every else [i] + [tok.eos_token_id] * (eos_every - 1)
        ids = ids[:n]
        counting = CountingTokenizer(tok)
        r, chunks, _ = run_request(counting, ids, stop=("@@never@@",))
        assert "".join(chunks) == r.text == decode(tok, ids)
        per_token.append(counting.ids_decoded / n)
    assert per_token[1] < 20 and per_token[1] < 1.2 * per_token[0] + 0.5, per_token


# ---------------------------------------------------------------------------------------------------------
# a decoder that is not local: the text is still the oracle
# ---------------------------------------------------------------------------------------------------------
class CleanupTokenizer:
    """Joins pieces and then removes a space before a comma, like transformers' clean_up_tokenization."""

    VOCAB = ["a", " ", ",", "b"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.VOCAB[i] for i in ids).replace(" ,", ",")


def test_non_local_decoder_falls_back_to_whole_decode():
    tok = CleanupTokenizer()
    ids = [0, 1, 2, 3, 1, 0, 1, 1, 2]
    d = IncrementalDetokenizer(tok)
    for k, token in enumerate(ids, 1):
        d.append(token)
        assert d.text == tok.decode(ids[:k])
