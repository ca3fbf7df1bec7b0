"""benchmarks/quant_quality.py (chapter 10's quality study) on tiny models. Oracles: transformers' own model scored by
the training script's `evaluate` (the held-out loss through minirt's model must equal it), loops written out here
for the outlier statistics (a hand-built weight with planted maxima), a model with a planted outlier feature (one
channel of every norm scaled up), hand-built token lists and logits, and the formats' known order of error on
Gaussian weights (int8 per channel about 0.7 %, FP8 about 2.6 %)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import minirt
from conftest import VOCAB, random_prompts

QUALITY = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_quality.py"


@pytest.fixture(scope="module")
def qq():
    spec = importlib.util.spec_from_file_location("quant_quality", QUALITY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script(qq):
    return qq.import_training_script()


def test_cpu_figures_float32_equals_transformers_and_the_quantized_rows_move(qq, script, tiny_models):
    from transformers import AutoModelForCausalLM

    path, ctx = tiny_models["qwen3"], 32
    stream = torch.tensor(random_prompts(7, [3 * ctx + 5])[0])
    prompts = random_prompts(8, [9, 14, 6])
    results = qq.measure_cpu(path, stream, prompts, 8, ctx, script)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    oracle = script.evaluate(hf, stream, ctx, torch.device("cpu"))

    base = results["float32"]
    assert list(results) == ["float32"] + [name for name, _, _ in qq.QUANTIZED]
    assert base["heldout_loss"] == pytest.approx(oracle, abs=1e-5)
    assert base["argmax_agreement"] == 1.0 and base["greedy"]["exact_match"] == 1.0
    for name, _, _ in qq.QUANTIZED:
        r = results[name]
        assert math.isfinite(r["heldout_loss"]) and r["heldout_loss"] != base["heldout_loss"], name
        assert r["heldout_loss_delta"] == r["heldout_loss"] - base["heldout_loss"]
        assert r["weight_bytes"] < base["weight_bytes"] and 0 < r["weight_error"]["all"] < 0.05, name
        assert set(r["weight_error"]) == {*qq.LAYER_TYPES, "all"}
    assert results["int8-channel"]["weight_error"]["all"] < results["fp8-channel"]["weight_error"]["all"]


def test_outlier_statistics_equal_loops_on_a_hand_built_weight(qq):
    g = torch.Generator().manual_seed(0)
    n, k = 40, 300
    w = torch.randn(n, k, generator=g)
    w[:20, 7] = 50.0                 # the maxima of rows 0-19 sit in input channel 7, of rows 20-29 in channel 11
    w[20:30, 11] = -40.0
    counts = [0] * k
    for row in range(n):
        counts[max(range(k), key=lambda c: abs(w[row, c].item()))] += 1
    top = math.ceil(k / 100)
    share, channels = qq.max_channel_share(w)
    assert share == pytest.approx(sum(sorted(counts, reverse=True)[:top]) / n)
    assert channels[:2] == [7, 11] and len(channels) == top and share >= 30 / n

    for row in (0, 25, 39):
        values = [abs(v) for v in w[row].tolist()]
        rms = math.sqrt(sum(v * v for v in values) / k)
        assert qq.crest(w)[row].item() == pytest.approx(max(values) / rms, rel=1e-5)

    def level(block_size):                       # mean |round(w / (amax / 127))| over each scale's group
        total = 0.0
        size_r, size_c = (1, k) if block_size is None else (block_size, block_size)
        for r0 in range(0, n, size_r):
            for c0 in range(0, k, size_c):
                tile = w[r0:r0 + size_r, c0:c0 + size_c]
                scale = tile.abs().max().item() / 127
                total += sum(abs(round(v / scale)) for v in tile.flatten().tolist())
        return total / (n * k)
    assert qq.mean_level(w, None) == pytest.approx(level(None), abs=0.02)
    assert qq.mean_level(w, 128) == pytest.approx(level(128), abs=0.02)


def test_activation_outliers_find_a_planted_feature(qq, tiny_models):
    model, _ = minirt.load_model(tiny_models["qwen3"], device="cpu", dtype="float32")
    feature = 5
    with torch.no_grad():
        for layer in model.model.layers:      # an outlier feature: channel 5 of the normed residual stream, x100
            layer.input_layernorm.weight[feature] *= 100
            layer.post_attention_layernorm.weight[feature] *= 100
            layer.self_attn.q_proj.weight[:, feature] = 10.0     # and every q_proj row's largest weight there
    acts = qq.activation_outliers(model, random_prompts(3, [12, 20]))
    for t in ("q_proj", "gate_proj"):
        assert feature in acts[t]["recurring"], t
        assert all(r > 20 for r in acts[t]["max_over_median"]), t
        assert all(top[0] == feature for top in acts[t]["top_channels"]), t
    assert len(acts["q_proj"]["channel_amax"]) == len(model.model.layers)
    overlap = qq.outlier_overlap(model, [feature])
    assert overlap["q_proj"] == {"share": 1.0, "chance": 1 / model.config.hidden_size}
    assert overlap["k_proj"]["share"] < 0.5


def test_greedy_agreement_counts_the_first_divergence(qq):
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    tokens = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    g = qq.greedy_agreement(tokens, reference)
    assert g["first_divergence"] == [None, 2, 0] and g["num_diverged"] == 2
    assert g["mean_first_divergence"] == 1.0 and g["exact_match"] == pytest.approx(1 / 3)
    assert g["prefix_agreement"] == pytest.approx((4 + 2 + 0) / 12)
    assert qq.first_divergence([1, 2], [1, 2, 3]) == 2 and qq.greedy_agreement(reference, reference)[
        "mean_first_divergence"] is None


def test_logits_error_against_hand_computed_values(qq):
    reference = torch.tensor([[[1.0, 3.0, 0.0], [2.0, 0.0, 1.0], [0.0, 1.0, 5.0]]])
    logits = torch.tensor([[[1.0, 2.0, 2.5], [2.0, 0.5, 1.0], [0.0, 1.0, 4.0]]])
    e = qq.logits_error(reference, logits)
    assert e["rel_frobenius"] == pytest.approx(math.sqrt(1 + 6.25 + 0.25 + 1) / math.sqrt(1 + 9 + 4 + 1 + 1 + 25))
    assert e["max_abs"] == 2.5 and e["mean_abs"] == pytest.approx(5.0 / 9)
    assert e["top1_agreement"] == pytest.approx(2 / 3)             # argmax 1, 0, 2 against 2, 0, 2
    assert qq.top1_margin(reference)["max"] == 4.0 and qq.top1_margin(reference)["p50"] == 2.0


def test_the_gpu_mode_runs_on_the_cpu_with_the_small_shape(qq, tmp_path, capsys):
    assert qq.main(["--device", "cpu", "--shape", "small", "--prompt-len", "16", "--gpu-new-tokens", "6",
                    "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "quant-quality-small.json").read_text())
    r = report["results"]
    assert list(r) == ["bfloat16", "float32-compute"] + [name for name, _, _ in qq.QUANTIZED]
    assert r["bfloat16"]["rel_frobenius"] == 0 and r["bfloat16"]["top1_agreement"] == 1
    assert 0 < r["float32-compute"]["rel_frobenius"] < r["int8-channel"]["rel_frobenius"]
    assert r["int8-channel"]["rel_frobenius"] < r["fp8-channel"]["rel_frobenius"]      # 2^-8 grid vs 3 mantissa bits
    assert r["int8-channel"]["weight_error"] < r["fp8-channel"]["weight_error"]
    assert report["workload"]["positions"] == 4 * 16 and "commit" in report and report["device"]["type"] == "cpu"
    assert "int8-block128" in capsys.readouterr().out
