"""The embedded default checkpoint: loads in minirt and in transformers, agrees with transformers, is small."""

from pathlib import Path

import pytest
import torch

import minirt

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "Of Man's first disobedience", "To be, or not"]


@pytest.fixture(scope="module")
def hf_pair(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model)
    return model, tok


def test_default_model_path_is_in_package():
    path = Path(minirt.DEFAULT_MODEL)
    assert path.is_absolute()
    assert Path(minirt.__file__).parent in path.parents


def test_default_model_files(default_model):
    path = Path(default_model)
    names = {p.name for p in path.iterdir()}
    assert "config.json" in names
    assert any(n.endswith(".safetensors") for n in names)
    assert "tokenizer.json" in names or "tokenizer_config.json" in names
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 20 * 2**20, f"default model folder is {size / 2**20:.1f} MB"


def test_default_model_config(default_model):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(default_model)
    assert cfg.model_type == "qwen3"


def test_default_model_loads_in_minirt(default_model):
    model, tok = minirt.load_model(default_model, device="cpu")
    assert tok is not None
    assert next(model.parameters()).dtype == torch.float32
    ids = tok.encode("ROMEO:")
    assert tok.decode(ids, skip_special_tokens=True) == "ROMEO:"


def test_default_model_logits_equal_transformers(default_model, hf_pair):
    hf, tok = hf_pair
    model, _ = minirt.load_model(default_model, device="cpu", dtype="float32")
    ids = torch.tensor([tok("ROMEO: What say you?")["input_ids"]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
        got = model.compute_logits(model(ids, torch.arange(ids.shape[1]).unsqueeze(0)))
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)


def test_default_model_greedy_equals_transformers(default_llm, hf_pair):
    hf, tok = hf_pair
    n = 24
    outs = default_llm.generate(PROMPTS, minirt.SamplingParams(max_new_tokens=n, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt == prompt
        enc = tok(prompt)["input_ids"]
        assert list(out.prompt_token_ids) == list(enc), "minirt tokenizes differently from AutoTokenizer"
        inp = torch.tensor([enc])
        with torch.no_grad():
            ref = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=n,
                              eos_token_id=None, pad_token_id=tok.pad_token_id or 0)
        want = ref[0, inp.shape[1]:].tolist()
        assert list(out.token_ids) == want, prompt
        assert out.text == tok.decode(want, skip_special_tokens=True)


def test_default_model_generates_text_with_eos_allowed(default_llm):
    out = default_llm.generate("ROMEO:", minirt.SamplingParams(max_new_tokens=64))[0]
    assert out.finish_reason in ("stop", "length")
    assert len(out.token_ids) >= 1 and isinstance(out.text, str)
    if out.finish_reason == "length":
        assert len(out.token_ids) == 64
