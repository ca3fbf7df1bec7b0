"""Interleaved A/B of engine settings at batch 1: small differences that separate runs cannot resolve.

    python benchmarks/ab.py [--rounds 8] [--config NAME:field=on,field=off ...] [--label LABEL]
                            [--out benchmarks/results]

Separate `bench` runs of one setting vary by a few percent (the GPU's clocks, where the KV blocks and the
weights land), as much as one kernel fewer per layer buys. Here every setting gets its own `minirt.LLM` on the
same random Qwen3-0.6B-shaped checkpoint, all built first and kept alive, then each round runs one request
(512-token prompt, 256 new tokens, a new prompt per round) on each of them in turn, alternating the order
between rounds. Prints each setting's TPOT median, minimum and every run, with the ratio of its median to the
first setting's, and writes `ab-batch1-cuda-<date>[-LABEL].json`. The default settings are two of chapter 07's
switches: the K/V write in the rotary kernel and the split-KV combine in the attention kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import tempfile

import torch

import minirt
from minirt.bench import build_random_qwen3, make_prompts, report_header, run_minirt, write_report
from harness import parse_engine_settings
from minirt.metrics import format_table

DEFAULT_CONFIGS = ["neither:kv_write_in_rotary=off,combine_in_attention=off",
                   "kv_write_in_rotary:kv_write_in_rotary=on,combine_in_attention=off",
                   "combine_in_attention:kv_write_in_rotary=off,combine_in_attention=on",
                   "both:kv_write_in_rotary=on,combine_in_attention=on"]
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", default=None, help="NAME:field=value,... (repeat; "
                        "default: the K/V-write and combine switches, each on and off)")
    parser.add_argument("--rounds", type=int, default=8, help="requests per setting (default 8)")
    parser.add_argument("--label", default="", help="appended to the JSON file's name (letters, digits, '-')")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    try:
        configs = dict(parse_engine_settings(c) for c in args.config or DEFAULT_CONFIGS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.label and not all(c.isalnum() or c == "-" for c in args.label):
        print(f"error: --label: only letters, digits and '-', got {args.label!r}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"error: --rounds: must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device (the settings it compares are GPU ones)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    llms, tpot = interleaved_variants({name: (lambda model, kw=kwargs: new_llm(model, device, **kw))
                                       for name, kwargs in configs.items()}, args.rounds, device)
    settings = {name: {"asked": kwargs, "plan": llms[name].engine.plan.as_dict()} for name, kwargs in configs.items()}
    report_tpot(tpot, settings, args.rounds, device, args.out, "-".join(filter(None, ["ab-batch1-cuda",
                                                                                      str(datetime.date.today()),
                                                                                      args.label])))
    return 0


def new_llm(model: str, device: torch.device, **kwargs) -> minirt.LLM:
    """The `minirt.LLM` every setting gets: bfloat16, up to 8 sequences, 512 KV blocks, plus the setting."""
    return minirt.LLM(model, device=device, dtype=torch.bfloat16, max_num_seqs=8, num_kv_blocks=512, **kwargs)


def interleaved_variants(build: dict, rounds: int, device: torch.device,
                         around: dict | None = None) -> tuple[dict, dict[str, list[float]]]:
    """One `minirt.LLM` per variant on one random Qwen3-0.6B-shaped checkpoint (`build[name](model_path)` builds it),
    all built first and kept alive, then `interleaved_tpot` over them. `around[name]()`, where given, is a context
    manager that variant is built and run inside (patched kernel constants, say). Returns (llms, tpot)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    around = around or {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_qwen3(tmp, device, seed=0)
        llms = {}
        for name, make in build.items():
            with around.get(name, contextlib.nullcontext)():
                llms[name] = make(model)
        return llms, interleaved_tpot(llms, rounds, device, around)


def interleaved_tpot(llms: dict, rounds: int, device: torch.device, around: dict | None = None
                     ) -> dict[str, list[float]]:
    """TPOT p50 (s) of one request per round (512-token prompt, 256 new tokens, a new prompt each round) on each
    of `llms` in turn, the order alternating between rounds, after one warm-up request each; each inside
    `around[name]()` where given."""
    around = around or {}
    tpot = {name: [] for name in llms}
    prompts = make_prompts(rounds + 1, (512, 512), next(iter(llms.values())).engine.model.config.vocab_size, seed=3)
    for name, llm in llms.items():                      # warm-up: compiled kernels, first-use allocations
        with around.get(name, contextlib.nullcontext)():
            run_minirt(llm, prompts[-1:], 16, device)
    for r in range(rounds):
        order = list(llms.items()) if r % 2 == 0 else list(llms.items())[::-1]
        for name, llm in order:
            with around.get(name, contextlib.nullcontext)():
                fig, _ = run_minirt(llm, [prompts[r]], 256, device)
            tpot[name].append(fig["tpot_p50_s"])
    return tpot


def report_tpot(tpot: dict, settings: dict, rounds: int, device: torch.device, out: str, file_name: str) -> dict:
    """Print the table (each setting's median, minimum, ratio to the first, every run) and write the JSON report."""
    first = statistics.median(tpot[next(iter(tpot))])
    rows = [[name, statistics.median(v) * 1e3, min(v) * 1e3, statistics.median(v) / first,
             " ".join(f"{x * 1e3:.3f}" for x in v)] for name, v in tpot.items()]
    print(format_table(["setting", "TPOT median ms", "min ms", "x first", "every run (ms)"], rows))
    report = {**report_header(device),
              "workload": {"prompt_len": 512, "new_tokens": 256, "rounds": rounds},
              "settings": settings, "tpot_s": tpot,
              "tpot_median_s": {name: statistics.median(v) for name, v in tpot.items()}}
    write_report(report, out, file_name)
    return report


if __name__ == "__main__":
    sys.exit(main())
