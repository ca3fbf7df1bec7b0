"""Stopping: max_new_tokens, stop strings, stop token ids and EOS; finish_reason and text."""

import dataclasses
import json
import shutil

import pytest
import torch

import minirt
from conftest import hf_greedy, random_prompts

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def reference(default_llm):
    """An unconstrained greedy run on the default model: (ids, text)."""
    out = default_llm.generate([PROMPT], minirt.SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    assert len(out.token_ids) == 48 and out.finish_reason == "length"
    return list(out.token_ids), out.text


def test_max_new_tokens_one(default_llm, reference):
    out = default_llm.generate(PROMPT, minirt.SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert list(out.token_ids) == reference[0][:1]


def test_length_finish_and_text(default_llm, reference):
    ids, text = reference
    tok = default_llm.engine.tokenizer if hasattr(default_llm.engine, "tokenizer") else None
    out = default_llm.generate([PROMPT], minirt.SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert list(out.token_ids) == ids[:10] and out.finish_reason == "length" and out.error is None
    assert text.startswith(out.text)
    if tok is not None:
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def _pick_stop_string(text: str) -> tuple[str, int]:
    """A short substring from the middle of `text` whose first occurrence is well inside the text."""
    for start in range(len(text) // 2, len(text) - 4):
        for length in (5, 4, 3):
            s = text[start:start + length]
            if not s.strip():
                continue
            idx = text.find(s)
            if idx >= 3:
                return s, idx
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string(default_llm, reference):
    ids, text = reference
    stop, idx = _pick_stop_string(text)
    out = default_llm.generate([PROMPT], minirt.SamplingParams(max_new_tokens=48, ignore_eos=True,
                                                                stop=("@@never@@", stop)))[0]
    assert out.finish_reason == "stop", (stop, out.text)
    assert stop not in out.text
    assert out.text == text[:idx], f"stop={stop!r}"
    assert list(out.token_ids) == ids[:len(out.token_ids)]
    assert len(out.token_ids) < 48


def test_stop_string_in_batch_with_others(default_llm, reference):
    ids, text = reference
    stop, idx = _pick_stop_string(text)
    outs = default_llm.generate([PROMPT, "JULIET:", PROMPT], [
        minirt.SamplingParams(max_new_tokens=48, ignore_eos=True, stop=(stop,)),
        minirt.SamplingParams(max_new_tokens=12, ignore_eos=True),
        minirt.SamplingParams(max_new_tokens=48, ignore_eos=True)])
    assert outs[0].text == text[:idx] and outs[0].finish_reason == "stop"
    assert len(outs[1].token_ids) == 12 and outs[1].finish_reason == "length"
    assert list(outs[2].token_ids) == ids and outs[2].text == text


def test_stop_token_ids(default_llm, reference):
    ids, _ = reference
    tok = ids[len(ids) // 2]
    want = ids[:ids.index(tok) + 1]
    out = default_llm.generate([PROMPT], minirt.SamplingParams(max_new_tokens=48, ignore_eos=True,
                                                                stop_token_ids=(tok,)))[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == want
    assert out.token_ids[-1] == tok


# ---------------------------------------------------------------------------------------------------------
# EOS, on a tiny model whose config names as EOS a token it is known to emit
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eos_model(tiny_models, tmp_path_factory):
    src = tiny_models["llama"]
    (prompt,) = random_prompts(800, [8])
    ref = hf_greedy(src, prompt, 12)
    eos = ref[2]
    dst = tmp_path_factory.mktemp("eos_model") / "llama_eos"
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        f = dst / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    return str(dst), prompt, ref, eos


def test_eos_stops(eos_model):
    path, prompt, ref, eos = eos_model
    llm = minirt.LLM(model=path, device="cpu", dtype=torch.float32, block_size=4)
    out = llm.generate([prompt], minirt.SamplingParams(max_new_tokens=12))[0]
    assert out.finish_reason == "stop"
    cut = ref.index(eos)
    # the EOS token itself may or may not be reported; nothing after it is
    assert list(out.token_ids) in (ref[:cut], ref[:cut + 1]), (list(out.token_ids), ref, eos)


def test_ignore_eos_continues(eos_model):
    path, prompt, ref, eos = eos_model
    llm = minirt.LLM(model=path, device="cpu", dtype=torch.float32, block_size=4)
    out = llm.generate([prompt], minirt.SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert list(out.token_ids) == ref


def test_eos_from_config_in_kv_cache_generate(eos_model):
    from minirt.generate import kv_cache_generate

    path, prompt, ref, eos = eos_model
    model, _ = minirt.load_model(path, device="cpu")
    assert kv_cache_generate(model, [prompt], 12, eos_token_id=eos)[0] == ref[:ref.index(eos) + 1]


# A stop id that also completes a stop string: "ROMEO:" continues "\nBut I have heard that, ..." and " heard" is one
# token, so stop=["e "] ends inside the token that is also the stop id. The text is cut at the stop string anyway.
def _stop_id_completes_stop_string(default_llm, reference):
    tok = default_llm.engine.tokenizer
    heard = tok.encode(" heard", add_special_tokens=False)
    ids, text = reference
    if len(heard) == 1 and heard[0] in ids and "e " in tok.decode(ids[:ids.index(heard[0]) + 1]):
        stop_id, stop = heard[0], "e "
    else:   # the same situation built from the model's own output: a string ending inside a stop id's text
        k = next(k for k in range(1, len(ids)) if len(tok.decode(ids[k:k + 1])) >= 2 and ids[k] not in ids[:k])
        before = tok.decode(ids[:k])
        stop_id, stop = ids[k], before[-1] + tok.decode(ids[:k + 1])[len(before)]
    k = ids.index(stop_id)
    prefix = tok.decode(ids[:k + 1])
    cut = prefix.find(stop)
    assert 0 <= cut and cut + len(stop) > len(tok.decode(ids[:k])), "the stop string must end inside the stop id"
    params = minirt.SamplingParams(max_new_tokens=48, ignore_eos=True, stop=[stop], stop_token_ids=[stop_id])
    return params, ids[:k + 1], prefix[:cut], stop


@pytest.mark.parametrize("max_new_tokens", [48, "at the stop id"])
def test_stop_string_completed_by_a_stop_id(default_llm, reference, max_new_tokens):
    params, ids, text, stop = _stop_id_completes_stop_string(default_llm, reference)
    if max_new_tokens != 48:     # the stop id is also the last allowed token: still "stop", text still cut
        params = dataclasses.replace(params, max_new_tokens=len(ids))
    out = default_llm.generate(PROMPT, params)[0]
    assert out.finish_reason == "stop" and list(out.token_ids) == ids
    assert out.text == text and stop not in out.text


def test_stop_string_completed_by_a_stop_id_streamed(default_model, default_llm, reference):
    import asyncio

    params, ids, text, stop = _stop_id_completes_stop_string(default_llm, reference)

    async def main():
        async with minirt.Engine(default_model, dtype="float32", device="cpu") as engine:
            return [d async for d in engine.stream(PROMPT, params)]

    deltas = asyncio.run(main())
    final = deltas[-1]
    assert final.finished and final.finish_reason == "stop" and final.output.text == text
    assert "".join(d.text for d in deltas) == text and stop not in text
    assert [t for d in deltas for t in d.token_ids] == ids
