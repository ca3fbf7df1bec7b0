"""Chapter 00: minirt's decoder loaded from an HF checkpoint gives the logits of transformers."""

import pytest
import torch

import minirt
from conftest import TRITON_DEVICE, VOCAB, hf_logits, random_prompts


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
        model.merge_projections()
        model.set_fused_ops(True)
        assert model.model.layers[0].self_attn.q_proj is None and model.model.layers[0].mlp.fuse
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


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton GEMV kernel needs CUDA or Triton's interpreter")
def test_one_token_forward_with_gemv_equals_transformers(tiny_model_path):
    """Chapter 07's `gemv` switch: a one-token forward sends every projection and the LM head to the Triton
    matrix-vector kernel (counted), and the logits stay those of transformers (float32)."""
    from minirt.kernels.gemv_triton import linear_gemv

    model, _ = minirt.load_model(tiny_model_path, device=TRITON_DEVICE, dtype=torch.float32)
    calls = []
    model.set_gemv(lambda x, w, b, **kw: calls.append(w.shape) or linear_gemv(x, w, b, **kw))
    ids = torch.tensor(random_prompts(3, [1]))                      # one token: every matmul has one row
    got = _minirt_logits(model, ids)
    want = hf_logits(tiny_model_path, ids)
    num_layers = model.config.num_hidden_layers
    assert len(calls) == 7 * num_layers + 1                        # q, k, v, o, gate, up, down per layer; LM head
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    model.merge_projections()                                      # qkv, o, gate_up (with SiLU-and-mul), down
    calls.clear()
    torch.testing.assert_close(_minirt_logits(model, ids), want, atol=1e-4 * max(1.0, want.abs().max().item()),
                               rtol=1e-4)
    assert len(calls) == 4 * num_layers + 1
    model.set_norm_in_gemv(True)                                   # both norms in the GEMV kernel's prologue
    calls.clear()
    torch.testing.assert_close(_minirt_logits(model, ids), want, atol=1e-4 * max(1.0, want.abs().max().item()),
                               rtol=1e-4)
    assert len(calls) == 4 * num_layers + 1
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    model.set_rotary_kernel(norm_and_rotate_triton)                # and q/k norm + rotation in one kernel
    torch.testing.assert_close(_minirt_logits(model, ids), want, atol=1e-4 * max(1.0, want.abs().max().item()),
                               rtol=1e-4)
    long_ids = torch.tensor(random_prompts(3, [9]))                # a longer input takes the same rotary kernel
    torch.testing.assert_close(_minirt_logits(model, long_ids), hf_logits(tiny_model_path, long_ids),
                               atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)
    model.set_rotary_kernel(None)
    model.set_norm_in_gemv(False)
    model.set_gemv(None)
    calls.clear()
    _minirt_logits(model, ids)
    assert not calls


@pytest.mark.parametrize("kernel", ["reference"] + (["triton"] if TRITON_DEVICE else []))
def test_rotary_store_hook_writes_the_cache_the_backend_would(tiny_model_path, kernel):
    """Chapter 07's `kv_write_in_rotary`: with `set_rotary_store`, each layer's rotation also writes K/V into the
    paged cache and the backend only attends. A prefill chunk then a decode step through a `PagedAttention` backend
    give the same hidden states and leave the same cache as the backend's own write (and, for the reference,
    transformers' logits); the store is counted, and the backend's `store` is never called."""
    from minirt.attention import PagedAttention, PagedAttentionMetadata, paged_attention_reference, store_kv
    from minirt.kv.paged_cache import allocate_kv_cache
    from minirt.model.layers import norm_rotate_and_store

    device = TRITON_DEVICE if kernel == "triton" else "cpu"
    if kernel == "triton":
        from minirt.kernels.rotary_triton import norm_rotate_and_store_triton as store_fn
    else:
        store_fn = norm_rotate_and_store
    model, _ = minirt.load_model(tiny_model_path, device=device, dtype=torch.float32)
    cfg = model.config
    ids = torch.tensor(random_prompts(5, [7]), device=device)                 # 6 prompt tokens, then 1 decode
    block_size, table = 4, torch.tensor([[3, 0, 2]], device=device)

    def run(use_store_hook):
        cache = allocate_kv_cache(cfg, 5, block_size, torch.float32, torch.device(device))
        calls = []
        model.set_rotary_store((lambda *a: calls.append(1) or store_fn(*a)) if use_store_hook else None)
        outs = []
        for lo, hi in ((0, 6), (6, 7)):
            pos = torch.arange(lo, hi, device=device)
            meta = PagedAttentionMetadata(
                slot_mapping=table[0, pos // block_size] * block_size + pos % block_size,
                query_start_loc=torch.tensor([0, hi - lo], device=device), context_lens=torch.tensor([hi], device=device),
                block_tables=table, max_query_len=hi - lo, max_context_len=hi)
            backend_store = (lambda *a: pytest.fail("the backend wrote K/V")) if use_store_hook else store_kv
            attn = PagedAttention(cache, meta, paged_attention_reference, backend_store)
            outs.append(model(ids[:, lo:hi], pos[None], attn=attn))
        model.set_rotary_store(None)
        return torch.cat(outs, 1), cache, len(calls)

    want, want_cache, _ = run(False)
    got, got_cache, calls = run(True)
    assert calls == 2 * cfg.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    assert got_cache.abs().sum() > 0
    if kernel == "reference":
        logits = model.compute_logits(got)
        hf = hf_logits(tiny_model_path, ids.cpu())
        torch.testing.assert_close(logits, hf, atol=1e-4 * max(1.0, hf.abs().max().item()), rtol=1e-4)


def test_linear_sends_only_one_row_inputs_to_gemv(tiny_model_path):
    """The `gemv` hook of `minirt.model.layers.Linear`, with `F.linear` standing in for the Triton kernel:
    a one-token forward calls it for every projection and the LM head (also after merging, which keeps the
    hook; the merged gate/up with SiLU-and-multiply in its epilogue), a longer one never does, and the logits do
    not change."""
    from minirt.model.layers import gemv_reference

    from minirt.model.layers import RMSNorm

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    for module in model.modules():     # an eps that matters (the stream's mean square is ~1e-3): a hook must use it
        if isinstance(module, RMSNorm):
            module.eps = 0.05
    one, two = torch.tensor(random_prompts(5, [1])), torch.tensor(random_prompts(5, [2]))
    plain = _minirt_logits(model, one)
    calls = []
    model.set_gemv(lambda x, w, b, **kw: calls.append((x.shape, kw)) or gemv_reference(x, w, b, **kw))
    model.merge_projections()                                      # after set_gemv: the merged layers keep it
    assert torch.allclose(_minirt_logits(model, one), plain, atol=1e-5)
    num_layers = model.config.num_hidden_layers
    assert len(calls) == 4 * num_layers + 1                        # qkv, o, gate_up, down per layer; LM head
    assert all(shape[:-1].numel() == 1 for shape, _ in calls)
    assert sum(kw.get("silu_and_mul", False) for _, kw in calls) == num_layers     # gate_up, with its epilogue
    calls.clear()
    _minirt_logits(model, two)
    assert not calls
    # Chapter 07's norm_in_gemv: each layer's two norms go into the prologue of qkv's and gate_up's GEMV, with
    # the residual addition (none before the first layer's, where the stream is the embedding).
    model.set_norm_in_gemv(True)
    assert torch.allclose(_minirt_logits(model, one), plain, atol=1e-5)
    assert len(calls) == 4 * num_layers + 1
    normed = [kw for _, kw in calls if kw.get("norm_weight") is not None]
    assert len(normed) == 2 * num_layers
    assert sum(kw.get("residual") is not None for kw in normed) == 2 * num_layers - 1
    calls.clear()
    _minirt_logits(model, two)                                     # longer inputs keep the norms' own kernels
    assert not calls
    model.set_gemv(None)                                           # the prologue lives in the GEMV: off with it
    assert not any(layer.norm_in_gemv for layer in model.model.layers)
    assert torch.allclose(_minirt_logits(model, one), plain, atol=1e-5)


def test_norm_in_gemv_needs_merged_projections_and_a_gemv(tiny_model_path):
    from minirt.model.layers import gemv_reference

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^norm_in_gemv: needs merged projections and a gemv kernel"):
        model.set_norm_in_gemv(True)
    model.set_gemv(gemv_reference)
    with pytest.raises(ValueError, match=r"^norm_in_gemv: needs merged projections and a gemv kernel"):
        model.set_norm_in_gemv(True)
    assert not model.model.layers[0].norm_in_gemv                  # refused: nothing changed
    model.merge_projections()
    model.set_norm_in_gemv(True)
    assert all(layer.norm_in_gemv for layer in model.model.layers)


def test_prefetch_next_weights_binds_each_gemv_to_the_weights_after_it(tiny_model_path):
    """q/k/v -> o_proj -> gate/up -> down -> the next layer's q/k/v, in the order a decode step runs them (checked
    against that order as the forward pass records it), and (ahead=2, count=2) the two from the one after next;
    the last ones ask for nothing; refused by name without merged projections and gemv hooks; set_gemv undoes it."""
    from minirt.model.layers import gemv_reference

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    table = lambda weights: [w.data_ptr() for w in weights]                            # noqa: E731
    with pytest.raises(ValueError, match=r"^l2_prefetch: needs merged projections and a gemv kernel"):
        model.prefetch_next_weights(table)
    model.merge_projections()
    with pytest.raises(ValueError, match=r"^l2_prefetch: needs merged projections and a gemv kernel"):
        model.prefetch_next_weights(table)
    calls = []

    def gemv(x, w, b, l2_prefetch=None, **kw):
        calls.append((w.data_ptr(), l2_prefetch))
        return gemv_reference(x, w, b, **kw)

    model.set_gemv(gemv)
    model.set_norm_in_gemv(True)
    for name, value in (("ahead", 0), ("count", -1), ("count", 1.5)):
        with pytest.raises(ValueError, match=rf"^{name}: must be an integer >= 1, got {value}"):
            model.prefetch_next_weights(table, **{name: value})
    model.prefetch_next_weights(table)
    with pytest.raises(ValueError, match=r"^l2_prefetch: the gemv hooks already ask for a prefetch; set_gemv undoes"):
        model.prefetch_next_weights(table, ahead=2)
    one = torch.tensor([[5]])
    model(one, one)
    layer_calls = calls[:4 * len(model.model.layers)]                  # then the LM head, run by compute_logits
    assert len(layer_calls) == 4 * len(model.model.layers) >= 8
    for (_, asked), (after, _) in zip(layer_calls, layer_calls[1:]):
        assert asked == [after]
    assert layer_calls[-1][1] is None
    model.set_gemv(gemv)
    calls.clear()
    model(one, one)
    assert all(asked is None for _, asked in calls)
    weights = [w for w, _ in calls]
    model.prefetch_next_weights(table, ahead=2, count=2)
    calls.clear()
    model(one, one)
    assert [asked for _, asked in calls] == [weights[i + 2:i + 4] or None for i in range(len(weights))]


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


def test_linear_one_row_test_counts_rows_not_elements():
    """`[5, 0]` has as many elements as one row of width 0, but five rows: it must stay with `F.linear`."""
    from minirt.model.layers import Linear

    calls = []
    layer = Linear(0, 4)
    layer.gemv = lambda x, w, b: calls.append(x.shape) or torch.nn.functional.linear(x, w, b)
    assert layer(torch.zeros(5, 0)).shape == (5, 4) and not calls
    assert layer(torch.zeros(1, 1, 0)).shape == (1, 1, 4) and calls == [(1, 1, 0)]
