"""Chapter 00: minirt's decoder loaded from an HF checkpoint gives the logits of transformers."""

import pytest
import torch

import minirt
from conftest import VOCAB, hf_logits, random_prompts


def _minirt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = ids.to(device)
    positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        hidden = model(ids, positions)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    return logits.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "merged+fused"])
def test_forward_logits_equal_transformers(tiny_model_path, device, optimized):
    """Also with chapter 07's merged projections and torch.compile-fused elementwise ops."""
    model, tokenizer = minirt.load_model(tiny_model_path, device=device, dtype=torch.float32)
    if optimized:
        from minirt.fast import Plan
        from minirt.fast.layers import FusedRMSNorm, speed_up_model

        speed_up_model(model, Plan(merge_projections=True, fused_ops=True))
        assert model.model.layers[0].self_attn.q_proj is None and isinstance(model.model.norm, FusedRMSNorm)
    assert tokenizer is None  # tiny checkpoints have no tokenizer files
    assert isinstance(model, torch.nn.Module)
    assert model.config.vocab_size == VOCAB
    ids = torch.tensor(random_prompts(7, [37, 37]))  # batch of 2, same length, no padding
    got = _minirt_logits(model, ids)
    want = hf_logits(tiny_model_path, ids)
    assert got.shape == want.shape == (2, 37, VOCAB)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, scale), rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_forward_is_causal(tiny_model_path):
    """Logits at position t do not depend on tokens after t."""
    model, _ = minirt.load_model(tiny_model_path, device="cpu")
    a, b = random_prompts(11, [20, 20])
    mixed = a[:10] + b[10:]
    la = _minirt_logits(model, torch.tensor([a]))
    lm = _minirt_logits(model, torch.tensor([mixed]))
    torch.testing.assert_close(la[:, :10], lm[:, :10], atol=1e-5, rtol=1e-5)


def test_forward_positions_are_used(tiny_model_path):
    """Explicit positions feed the rotary embedding: a shifted window over a prefix reproduces its logits."""
    model, _ = minirt.load_model(tiny_model_path, device="cpu")
    (ids,) = random_prompts(3, [12])
    t = torch.tensor([ids])
    with torch.no_grad():
        ref = model.compute_logits(model(t, torch.arange(12).unsqueeze(0)))
        shifted = model.compute_logits(model(t, torch.arange(5, 17).unsqueeze(0)))
    # RoPE is relative: every score depends only on position differences, so a constant shift is invariant
    torch.testing.assert_close(ref, shifted, atol=1e-3, rtol=1e-3)
    gapped = torch.cat([torch.arange(6), torch.arange(6) + 40]).unsqueeze(0)
    with torch.no_grad():
        other = model.compute_logits(model(t, gapped))
    torch.testing.assert_close(ref[:, :6], other[:, :6], atol=1e-4, rtol=1e-4)
    assert (ref[:, 6:] - other[:, 6:]).abs().max() > 1e-2  # a gap in positions changes later tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", torch.float32, torch.bfloat16, "torch.float16"])
def test_load_model_dtype(tiny_models, dtype):
    model, _ = minirt.load_model(tiny_models["llama"], device="cpu", dtype=dtype)
    want = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype.removeprefix("torch."))
    assert {p.dtype for p in model.parameters()} == {want}
    ids = torch.tensor(random_prompts(1, [5]))
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(5).unsqueeze(0)))
    assert logits.dtype == torch.float32 and logits.shape == (1, 5, VOCAB)
    assert torch.isfinite(logits).all()


def test_load_model_default_dtype_cpu(tiny_models):
    model, _ = minirt.load_model(tiny_models["qwen3"], device="cpu")
    assert next(model.parameters()).dtype == torch.float32


def test_load_model_tied_embeddings(tiny_models):
    model, _ = minirt.load_model(tiny_models["qwen3"], device="cpu")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_load_model_bad_dtype(tiny_models):
    with pytest.raises(ValueError, match="dtype"):
        minirt.load_model(tiny_models["llama"], device="cpu", dtype="int8")


def test_missing_local_path_raises_clearly(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises((OSError, ValueError)) as e:
        minirt.load_model(str(missing))
    assert "no_such_model" in str(e.value)


def test_directory_without_config_raises_clearly(tmp_path):
    (tmp_path / "empty_ckpt").mkdir()
    with pytest.raises((OSError, ValueError)) as e:
        minirt.load_model(str(tmp_path / "empty_ckpt"))
    assert "empty_ckpt" in str(e.value)


def test_offline_hub_id_raises_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty cache: nothing to find locally
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    try:  # huggingface_hub reads these at import time
        import huggingface_hub.constants as hc
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    except (ImportError, AttributeError):
        pass
    name = "minirt-test-org/definitely-not-a-model"
    with pytest.raises((OSError, ValueError)) as e:
        minirt.load_model(name)
    msg = str(e.value)
    assert name in msg
    assert len(msg) < 2000  # one clear message, not a stack of HTTP errors


def test_unsupported_architecture_raises(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    with pytest.raises(ValueError, match="(?i)gpt2|architecture|model_type"):
        minirt.load_model(str(tmp_path / "gpt2"), device="cpu")


def test_forward_without_layers_keeps_the_batch_dimension():
    """No layers, so no residual stream: the output is the final norm of the embedding, `[B, T, hidden]`."""
    from transformers import Qwen3Config

    from minirt.model.decoder import DecoderModel

    config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=0,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = DecoderModel(config)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = model(ids, torch.arange(3)[None])
        assert out.shape == (1, 3, 16)
        torch.testing.assert_close(out, model.model.norm(model.model.embed_tokens(ids)))
