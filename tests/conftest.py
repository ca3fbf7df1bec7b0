"""Shared fixtures: tiny random checkpoints built by `transformers` itself, and a transformers greedy oracle.

The oracle is always `transformers` (batch 1, no padding, float32, CPU); expected tokens are never
hard-coded. Tiny models are random but with a scaled-up init so that logits are far from ties.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import random
from pathlib import Path

import pytest
import torch

FAMILIES = ("qwen3", "qwen2", "llama")
VOCAB = 512
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Without a GPU, Triton's interpreter runs the Triton kernels on CPU tensors (slowly: the tests keep to small
# shapes), so their tests still run. It must be set before the kernels are defined, hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: The Triton kernels can run here: on CUDA, or in the interpreter on CPU tensors (device "cpu").
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else (
    "cpu" if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") else None)

# Tiny models: one intra-op thread is as fast as several and robust when the CPU is shared
# (thread spin-waits under contention slow small ops down tenfold). Override with MINIRT_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("MINIRT_TEST_THREADS", "1")))


def _make_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "qwen3":
        # qk-norm; head_dim != hidden/heads (as in real Qwen3 checkpoints); tied embeddings
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    if family == "qwen2":
        # q/k/v bias (made nonzero below); untied
        return Qwen2Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    if family == "llama":
        return LlamaConfig(**common, head_dim=16, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    raise ValueError(family)


def build_tiny_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """Random tiny HF checkpoint (float32 safetensors) with a scaled-up init; returns `path`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _make_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights (incl. q_norm/k_norm): around 1, not exactly 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # projections: std ~ 2/sqrt(fan_in) -> sharp attention, well separated logits
                p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[1] ** 0.5))
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = GenerationConfig(eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                               do_sample=False)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {f: str(build_tiny_checkpoint(f, root / f, seed=i)) for i, f in enumerate(FAMILIES)}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def tiny_model_path(tiny_models, family) -> str:
    return tiny_models[family]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


# ---------------------------------------------------------------------------------------------------------
# transformers oracle
# ---------------------------------------------------------------------------------------------------------
_HF_MODELS: dict[str, torch.nn.Module] = {}
_HF_GREEDY: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    path = str(path)
    if path not in _HF_MODELS:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        m.eval()
        _HF_MODELS[path] = m
    return _HF_MODELS[path]


@torch.no_grad()
def hf_greedy(path, prompt_ids, n: int) -> list[int]:
    """`n` greedy tokens from transformers' generate (batch 1, no padding), generated ids only.

    Results are cached per (path, prompt); a shorter request reuses the prefix of a longer one
    (greedy decoding is deterministic, so the first n tokens of a longer run are the n-token run).
    """
    key = (str(path), tuple(int(t) for t in prompt_ids))
    cached = _HF_GREEDY.get(key)
    if cached is not None and len(cached) >= n:
        return cached[:n]
    model = hf_model(path)
    inp = torch.tensor([list(key[1])], dtype=torch.long)
    out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    ids = out[0, inp.shape[1]:].tolist()
    assert len(ids) == n, f"transformers stopped early ({len(ids)} < {n})"
    _HF_GREEDY[key] = ids
    return ids


@torch.no_grad()
def hf_logits(path, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence float32 logits [B, T, V] from transformers (no padding)."""
    return hf_model(path)(input_ids=input_ids).logits.float()


@pytest.fixture(scope="session")
def hf_greedy_fn():
    return hf_greedy


def hold_the_gpu_after(runner, launch: str, take: str, when=lambda *args: True) -> list:
    """Wrap `runner.<launch>` and `runner.<take>` (CUDA only): after the first launch for which `when(*args)` holds,
    keep the GPU busy for about a second (`torch.cuda._sleep`); the first take after it records whether the sleep
    had finished by the time it returned. Returns that record: `[False]` means the take did not wait for the work
    launched after the step it read (overlap works), `[True]` that it did, `[]` that nothing was held."""
    launch_fn, take_fn = getattr(runner, launch), getattr(runner, take)
    held, seen = [], []

    def launching(*args, **kw):
        out = launch_fn(*args, **kw)
        if not held and when(*args, **kw):
            torch.cuda._sleep(2_000_000_000)                      # ~1 s of GPU cycles behind what was launched
            held.append(torch.cuda.Event())
            held[0].record()
        return out

    def taking(*args):
        out = take_fn(*args)
        if held and not seen:
            seen.append(held[0].query())
        return out

    setattr(runner, launch, launching)
    setattr(runner, take, taking)
    return seen


def random_prompts(seed: int, lengths, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------------------------------------------------
# embedded default model
# ---------------------------------------------------------------------------------------------------------
def default_model_path() -> str:
    import minirt

    return str(minirt.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_model() -> str:
    """Path of the embedded checkpoint (it ships in the package)."""
    path = default_model_path()
    assert (Path(path) / "config.json").is_file(), f"embedded default model missing at {path}"
    return path


@pytest.fixture(scope="session")
def default_llm(default_model):
    import minirt

    llm = minirt.LLM(model=default_model, dtype="float32", device="cpu")
    yield llm
    del llm
    gc.collect()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs (also) on CUDA when present")
