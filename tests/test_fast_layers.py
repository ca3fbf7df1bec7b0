"""Chapter 07's model pieces (`minirt.fast.layers`), swapped into a loaded reference model by `speed_up_model`:
the logits stay those of transformers (the oracle), with torch references or the Triton kernels as the kernels,
and each kernel is called exactly where the plan says (counted)."""

import dataclasses

import pytest
import torch

import minirt
from conftest import TRITON_DEVICE, hf_logits, random_prompts
from minirt.fast import Plan
from minirt.fast.layers import (CachedRotaryEmbedding, FastAttention, GemvLinear, GreedyGemvHead, NormInGemvLayer,
                                bind_l2_prefetch, speed_up_model)
from minirt.fast.ops import ModelKernels, gemv_reference, norm_rotate_and_store
from test_model import _minirt_logits

GEMV = Plan(gemv=True)
MERGED_GEMV = Plan(gemv=True, merge_projections=True)
NORM_IN_GEMV = Plan(gemv=True, merge_projections=True, norm_in_gemv=True)


def close(got, want):
    torch.testing.assert_close(got, want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)


def counting(fn, calls):
    """`fn` that records each call's weight shape and keywords in `calls`."""
    return lambda x, w, b, **kw: calls.append((x.shape, w.shape, kw)) or fn(x, w, b, **kw)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton GEMV kernel needs CUDA or Triton's interpreter")
@pytest.mark.parametrize("plan", [GEMV, MERGED_GEMV, NORM_IN_GEMV, dataclasses.replace(NORM_IN_GEMV, rotary_kernel=True)],
                         ids=["gemv", "merged", "norm-in-gemv", "rotary-kernel"])
def test_one_token_forward_with_the_triton_kernels_equals_transformers(tiny_model_path, plan):
    """A one-token forward sends every projection and the LM head to the Triton matrix-vector kernel (counted:
    q, k, v, o, gate, up, down per layer, or qkv, o, gate_up, down merged; and the LM head), and the logits stay
    those of transformers (float32); with the rotary kernel, longer inputs too."""
    from minirt.kernels.gemv_triton import linear_gemv
    from minirt.kernels.rotary_triton import norm_and_rotate_triton

    model, _ = minirt.load_model(tiny_model_path, device=TRITON_DEVICE, dtype=torch.float32)
    calls = []
    kernels = ModelKernels(gemv=counting(linear_gemv, calls),
                           **({"rotate": norm_and_rotate_triton} if plan.rotary_kernel else {}))
    speed_up_model(model, plan, kernels)
    ids = torch.tensor(random_prompts(3, [1]))                      # one token: every matmul has one row
    close(_minirt_logits(model, ids), hf_logits(tiny_model_path, ids))
    per_layer = 4 if plan.merge_projections else 7
    assert len(calls) == per_layer * model.config.num_hidden_layers + 1
    calls.clear()
    long_ids = torch.tensor(random_prompts(3, [9]))                 # longer inputs: cuBLAS, never the GEMV
    close(_minirt_logits(model, long_ids), hf_logits(tiny_model_path, long_ids))
    assert not calls


def test_gemv_linear_sends_only_one_row_inputs_to_gemv(tiny_model_path):
    """With `F.linear` (`gemv_reference`) standing in for the Triton kernel: a one-token forward calls it for every
    projection and the LM head (the merged gate/up with SiLU-and-multiply in its epilogue), a longer one never does,
    and the logits do not change. With norm_in_gemv, each layer's two norms go into the prologue of qkv's and
    gate_up's GEMV, with the residual addition (none before the first layer's, where the stream is the embedding)."""
    from minirt.model.layers import RMSNorm

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    for module in model.modules():     # an eps that matters (the stream's mean square is ~1e-3): a kernel must use it
        if isinstance(module, RMSNorm):
            module.eps = 0.05
    one, two = torch.tensor(random_prompts(5, [1])), torch.tensor(random_prompts(5, [2]))
    plain, plain_two = _minirt_logits(model, one), _minirt_logits(model, two)
    for plan in (MERGED_GEMV, NORM_IN_GEMV):
        fast, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
        for module in fast.modules():
            if isinstance(module, RMSNorm):
                module.eps = 0.05
        calls = []
        speed_up_model(fast, plan, ModelKernels(gemv=counting(gemv_reference, calls)))
        assert torch.allclose(_minirt_logits(fast, one), plain, atol=1e-5)
        num_layers = fast.config.num_hidden_layers
        assert len(calls) == 4 * num_layers + 1                     # qkv, o, gate_up, down per layer; LM head
        assert all(shape[:-1].numel() == 1 for shape, _, _ in calls)
        assert sum(kw.get("silu_and_mul", False) for _, _, kw in calls) == num_layers     # gate_up's epilogue
        normed = [kw for _, _, kw in calls if kw.get("norm_weight") is not None]
        assert len(normed) == (2 * num_layers if plan.norm_in_gemv else 0)
        assert sum(kw.get("residual") is not None for kw in normed) == (2 * num_layers - 1 if plan.norm_in_gemv else 0)
        assert all(kw["eps"] == 0.05 for kw in normed)
        assert isinstance(fast.model.layers[0], NormInGemvLayer) == plan.norm_in_gemv
        calls.clear()
        assert torch.allclose(_minirt_logits(fast, two), plain_two, atol=1e-5)
        assert not calls                                            # longer inputs keep cuBLAS and the norms' own


@pytest.mark.parametrize("kernel", ["reference"] + (["triton"] if TRITON_DEVICE else []))
def test_rotate_and_store_writes_the_cache_the_backend_would(tiny_model_path, kernel):
    """`kv_write_in_rotary`: with `ModelKernels.rotate_and_store`, each layer's rotation also writes K/V into the
    paged cache and the backend only attends. A prefill chunk then a decode step through a `KernelPagedAttention`
    give the same hidden states and leave the same cache as the backend's own write (and, for the reference,
    transformers' logits); the store is counted, and the backend's `store` is never called."""
    from minirt.attention import PagedAttentionMetadata, paged_attention_reference, store_kv
    from minirt.fast.attention import KernelPagedAttention
    from minirt.kv.paged_cache import allocate_kv_cache

    device = TRITON_DEVICE if kernel == "triton" else "cpu"
    if kernel == "triton":
        from minirt.kernels.rotary_triton import norm_rotate_and_store_triton as store_fn
    else:
        store_fn = norm_rotate_and_store
    ids = torch.tensor(random_prompts(5, [7]), device=device)                 # 6 prompt tokens, then 1 decode
    block_size, table = 4, torch.tensor([[3, 0, 2]], device=device)

    def run(use_store_kernel):
        model, _ = minirt.load_model(tiny_model_path, device=device, dtype=torch.float32)
        calls = []
        store = (lambda *a: calls.append(1) or store_fn(*a)) if use_store_kernel else None
        speed_up_model(model, Plan(), ModelKernels(rotate_and_store=store))
        cache = allocate_kv_cache(model.config, 5, block_size, torch.float32, torch.device(device))
        outs = []
        for lo, hi in ((0, 6), (6, 7)):
            pos = torch.arange(lo, hi, device=device)
            meta = PagedAttentionMetadata(
                slot_mapping=table[0, pos // block_size] * block_size + pos % block_size,
                query_start_loc=torch.tensor([0, hi - lo], device=device), context_lens=torch.tensor([hi], device=device),
                block_tables=table, max_query_len=hi - lo, max_context_len=hi)
            backend_store = (lambda *a: pytest.fail("the backend wrote K/V")) if use_store_kernel else store_kv
            attn = KernelPagedAttention(cache, meta, paged_attention_reference, backend_store)
            outs.append(model(ids[:, lo:hi], pos[None], attn=attn))
        return model, torch.cat(outs, 1), cache, len(calls)

    _, want, want_cache, _ = run(False)
    model, got, got_cache, calls = run(True)
    assert calls == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)
    assert got_cache.abs().sum() > 0
    if kernel == "reference":
        close(model.compute_logits(got), hf_logits(tiny_model_path, ids.cpu()))


def test_bind_l2_prefetch_binds_each_gemv_to_the_weights_after_it(tiny_model_path):
    """q/k/v -> o_proj -> gate/up -> down -> the next layer's q/k/v, in the order a decode step runs them (checked
    against that order as the forward pass records it), and (ahead=2, count=2) the two from the one after next;
    the last ones ask for nothing; refused by name without merged GEMV projections, and for ahead/count below 1."""
    table = lambda weights: [w.data_ptr() for w in weights]                            # noqa: E731
    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^l2_prefetch: needs merged projections through the GEMV kernel"):
        bind_l2_prefetch(speed_up_model(model, Plan(merge_projections=True)), table)
    calls = []

    def gemv(x, w, b, l2_prefetch=None, **kw):
        calls.append((w.data_ptr(), l2_prefetch))
        return gemv_reference(x, w, b, **kw)

    def fresh():
        model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
        return speed_up_model(model, NORM_IN_GEMV, ModelKernels(gemv=gemv))

    model = fresh()
    for name, value in (("ahead", 0), ("count", -1), ("count", 1.5)):
        with pytest.raises(ValueError, match=rf"^{name}: must be an integer >= 1, got {value}"):
            bind_l2_prefetch(model, table, **{name: value})
    one = torch.tensor([[5]])
    model(one, one)
    assert all(asked is None for _, asked in calls)                    # not bound: nothing asked
    bind_l2_prefetch(model, table)
    calls.clear()
    model(one, one)
    layer_calls = calls[:4 * len(model.model.layers)]
    assert len(layer_calls) == 4 * len(model.model.layers) >= 8
    for (_, asked), (after, _) in zip(layer_calls, layer_calls[1:]):
        assert asked == [after]
    assert layer_calls[-1][1] is None
    model = fresh()
    bind_l2_prefetch(model, table, ahead=2, count=2)
    calls.clear()
    model(one, one)
    weights = [w for w, _ in calls[:len(layer_calls)]]                 # the call order of this model
    assert [asked for _, asked in calls] == [weights[i + 2:i + 4] or None for i in range(len(weights))]


def test_speed_up_model_keeps_the_weights_and_swaps_what_the_plan_says(tiny_model_path):
    """The fast modules share the loaded tensors (tied LM head included) and the reference classes stay where the
    plan does not ask for a fast one; the reference model knows none of the switches."""
    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    before = {n: p.data_ptr() for n, p in model.named_parameters() if "proj" not in n}
    speed_up_model(model, MERGED_GEMV, ModelKernels(gemv=gemv_reference))
    after = {n: p.data_ptr() for n, p in model.named_parameters() if "proj" not in n}
    assert before == after
    assert isinstance(model.model.layers[0].self_attn, FastAttention) and isinstance(model.lm_head, GemvLinear)
    assert not isinstance(model.model.layers[0], NormInGemvLayer)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gemv_linear_one_row_test_counts_rows_not_elements():
    """`[5, 0]` has as many elements as one row of width 0, but five rows: it must stay with `F.linear`."""
    calls = []
    layer = GemvLinear(torch.nn.Linear(0, 4), lambda x, w, b: calls.append(x.shape) or torch.nn.functional.linear(x, w, b))
    assert layer(torch.zeros(5, 0)).shape == (5, 4) and not calls
    assert layer(torch.zeros(1, 1, 0)).shape == (1, 1, 4) and calls == [(1, 1, 0)]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("fuse", [False, True], ids=["indexed", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_rotary_embedding_gives_the_reference_cos_and_sin(tiny_model_path, dtype, fuse, device):
    """The table's rows are exactly what `RotaryEmbedding` computes for each position (the first and the last one
    included), for a decode batch `[B, 1]` and a prompt `[1, T]`; another dtype takes the reference's way."""
    from minirt.model.layers import RotaryEmbedding

    config = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)[0].config
    rotary = RotaryEmbedding(config).to(device)
    cached = CachedRotaryEmbedding(rotary, config.max_position_embeddings, dtype, fuse=fuse)
    last = config.max_position_embeddings - 1
    gen = torch.Generator().manual_seed(0)
    for positions in (torch.tensor([[0], [last], [7]]), torch.randint(0, last + 1, (1, 33), generator=gen)):
        positions = positions.to(device)
        for d in (dtype, torch.float16):
            got, want = cached(positions, d), rotary(positions, d)
            for g, w in zip(got, want):
                assert g.dtype == d and g.shape == w.shape == (*positions.shape, w.shape[-1])
                assert torch.equal(g, w)


@pytest.mark.skipif(TRITON_DEVICE is None, reason="the Triton GEMV kernel needs CUDA or Triton's interpreter")
def test_greedy_head_and_rotary_cache_with_the_triton_kernels_equal_transformers(tiny_model_path):
    """With the cos/sin table and the LM head's argmax in the Triton GEMV's epilogue: a prompt's logits stay those of
    transformers, a one-token forward's greedy token is transformers' argmax, and two rows are refused."""
    from minirt.kernels.gemv_triton import linear_gemv

    model, _ = minirt.load_model(tiny_model_path, device=TRITON_DEVICE, dtype=torch.float32)
    speed_up_model(model, Plan(gemv=True, merge_projections=True, rotary_cache=True, argmax_in_gemv=True),
                   ModelKernels(gemv=linear_gemv))
    assert isinstance(model.lm_head, GreedyGemvHead) and isinstance(model.model.rotary_emb, CachedRotaryEmbedding)
    long_ids = torch.tensor(random_prompts(3, [9]))                 # positions 0-8 from the tables
    close(_minirt_logits(model, long_ids), hf_logits(tiny_model_path, long_ids))
    for seed in range(3):
        ids = torch.tensor(random_prompts(seed, [1]))
        with torch.no_grad():
            hidden = model(ids.to(TRITON_DEVICE), torch.zeros_like(ids).to(TRITON_DEVICE))[0]
            token = model.lm_head.greedy(hidden)
        assert token.shape == (1,) and token.item() == hf_logits(tiny_model_path, ids)[0, -1].argmax().item()
        with pytest.raises(ValueError, match=r"^x: greedy takes one row"):
            model.lm_head.greedy(hidden.expand(2, -1))


def test_fast_runner_samples_greedy_one_row_steps_with_the_greedy_head(tiny_model_path):
    """The runner's greedy sampler sends a one-row step to `GreedyGemvHead.greedy` (its argmax is that of the
    logits) and a two-row step to the LM head and argmax; sampling requests never go to it."""
    from minirt.fast.runner import build_model_runner
    from minirt.request import Request
    from minirt.sampling import SamplingParams

    model, _ = minirt.load_model(tiny_model_path, device="cpu", dtype=torch.float32)
    plan = Plan(gemv=True, merge_projections=True, argmax_in_gemv=True)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("minirt.fast.layers.model_kernels", lambda plan: ModelKernels(gemv=gemv_reference))
        runner = build_model_runner(plan, model, num_kv_blocks=8, block_size=4, max_num_seqs=2, max_model_len=32)
    assert runner.greedy_head is model.lm_head
    greedy = runner.greedy_head.greedy
    runner.greedy_head.greedy = lambda x: calls.append(x.shape) or greedy(x)
    hidden = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = torch.nn.functional.linear(hidden, model.lm_head.weight)
    greedy_request = Request("g", None, [1, 2], SamplingParams(), frozenset())
    sampling_request = Request("s", None, [1, 2], SamplingParams(temperature=0.8, seed=1), frozenset())
    assert runner.sample(hidden[:1], [greedy_request]).tolist() == [logits[0].argmax().item()]
    assert calls == [(1, model.config.hidden_size)]
    assert runner.sample(hidden, [greedy_request] * 2).tolist() == logits.argmax(-1).tolist()
    runner.sample(hidden[:1], [sampling_request])
    assert len(calls) == 1
