"""Source trees of minirt, one run: the bench's two workloads with each tree's defaults, in alternating rounds.

    python benchmarks/ab_commits.py --tree before=.ab/before --tree after=. --note "8a63ee6 against 11a82f3"

Each tree is a folder holding a `minirt/` package (a checkout, or `git archive REV minirt | tar -x -C DIR`); two or
more. Every round runs each tree once, in its own process (so that each imports its own minirt), in the order
A B ... then ... B A (ABBA cancels a slow drift of the machine): the random Qwen3-0.6B-shaped checkpoint of
`python -m minirt bench` (built once, the same weights for all), minirt's engine with its default settings, a
warm-up, then the throughput and the batch-1 latency workloads of `minirt.bench.WORKLOADS` (`--workload`: one of
them; `--repeats R`: each R times per process, the medians kept, since a batch-1 run takes a fraction of a second
and a process half a minute to start). `--settings NAME:field=value,...` gives the tree NAME engine settings
(`ab.py`'s syntax), so that one tree named twice compares a switch on and off on both workloads:
`--tree off=. --tree on=. --settings on:async_scheduling=on`. Prints each run, the median of each figure per tree
and its ratio to the first tree's, and writes `ab-commits-<device>[-quick]-<date>.json` with the note.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

FIGURES = (("throughput", "output_tokens_per_s"), ("throughput", "tpot_p50_s"), ("throughput", "ttft_p50_s"),
           ("latency", "tpot_p50_s"))


def worker(model: str, quick: bool, workloads: list[str], repeats: int = 1, settings: dict | None = None) -> dict:
    """One tree's run (the minirt on sys.path): {workload: minirt's figures}, and what the engine resolved. With
    repeats > 1 each workload runs that many times on the same prompts; its figures are the medians, every run's
    under `<workload>_runs`. `settings`: engine settings for `minirt.LLM` (the tree's defaults otherwise)."""
    import torch

    import minirt
    from minirt.bench import WARMUP_REQUESTS, WARMUP_TOKENS, WORKLOADS, make_prompts, run_minirt

    device = torch.device("cuda")
    llm = minirt.LLM(model, device=device, dtype=torch.bfloat16, **(settings or {}))
    vocab = llm.engine.model.config.vocab_size
    out = {"minirt": os.path.dirname(os.path.abspath(minirt.__file__))}
    plan = getattr(llm.engine, "plan", None)
    out["plan"] = plan.as_dict() if plan is not None else None
    for i, (name, (num, lengths, new_tokens)) in enumerate(WORKLOADS["cuda", quick].items()):
        if name not in workloads:
            continue
        run_minirt(llm, make_prompts(min(num, WARMUP_REQUESTS), lengths, vocab, 100 + i),
                   min(WARMUP_TOKENS, new_tokens), device)
        runs = [run_minirt(llm, make_prompts(num, lengths, vocab, i), new_tokens, device)[0] for _ in range(repeats)]
        out[name] = {key: statistics.median(r[key] for r in runs) if isinstance(runs[0][key], (int, float))
                     else runs[0][key] for key in runs[0]}
        if repeats > 1:
            out[name + "_runs"] = runs
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a folder with minirt/ (2 or more)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each running every tree once (default 2)")
    parser.add_argument("--quick", action="store_true", help="the bench's quick workloads")
    parser.add_argument("--workload", choices=["all", "throughput", "latency"], default="all",
                        help="which of the bench's workloads each run times (default both)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each workload per process, their medians reported (default 1)")
    parser.add_argument("--settings", action="append", default=[], metavar="NAME:field=value,...",
                        help="engine settings for the tree NAME (repeat; e.g. one tree twice, a switch on and off)")
    parser.add_argument("--note", default="", help="what the trees are (commits), stored in the JSON")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "OUT", "SETTINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workloads = ["throughput", "latency"] if args.workload == "all" else [args.workload]
    figures = [(w, k) for w, k in FIGURES if w in workloads]
    if args.worker:
        with open(args.worker[1], "w") as f:
            json.dump(worker(args.worker[0], args.quick, workloads, args.repeats, json.loads(args.worker[2])), f)
        return 0
    trees = dict(t.split("=", 1) for t in args.tree if "=" in t)
    if len(trees) < 2 or len(trees) != len(args.tree) or args.rounds < 1 or args.repeats < 1:
        print("error: --tree NAME=PATH at least twice (distinct names), --rounds >= 1, --repeats >= 1",
              file=sys.stderr)
        return 2
    for name, path in trees.items():
        if not os.path.isdir(os.path.join(path, "minirt")):
            print(f"error: --tree {name}: {path!r} has no minirt/ folder", file=sys.stderr)
            return 2
    from harness import parse_engine_settings

    settings = {}
    try:
        for text in args.settings:
            name, kwargs = parse_engine_settings(text, "--settings")
            if name not in trees:
                raise ValueError(f"--settings: {name!r} is not a --tree name ({', '.join(trees)})")
            settings[name] = kwargs
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch

    from minirt.bench import build_random_qwen3, report_header, write_report

    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    names = list(trees)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_qwen3(os.path.join(tmp, "model"), torch.device("cuda"), seed=0)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                result = os.path.join(tmp, f"{name}-{r}.json")
                env = dict(os.environ, PYTHONPATH=os.path.abspath(trees[name]))
                cmd = [sys.executable, os.path.abspath(__file__), "--tree", "x=.", "--tree", "y=.", "--worker", model,
                       result, json.dumps(settings.get(name, {})), "--workload", args.workload, "--repeats", str(args.repeats)] + (
                           ["--quick"] if args.quick else [])
                subprocess.run(cmd, env=env, check=True)
                with open(result) as f:
                    runs[name].append(json.load(f))
                figs = runs[name][-1]
                print(f"round {r} {name:8s} " + "  ".join(f"{w} {k} {figs[w][k]:.4g}" for w, k in figures), flush=True)
    medians = {n: {f"{w}.{k}": statistics.median(run[w][k] for run in runs[n]) for w, k in figures} for n in names}
    base = medians[names[0]]
    ratios = {n: {key: value / base[key] for key, value in medians[n].items()} for n in names}
    print(f"\n{'figure':32s} " + " ".join(f"{n:>12s}" for n in names) + "  " +
          " ".join(f"{n} / {names[0]}" for n in names[1:]))
    for key in base:
        print(f"{key:32s} " + " ".join(f"{medians[n][key]:12.5g}" for n in names) + "  " +
              " ".join(f"{ratios[n][key]:{len(n) + len(names[0]) + 3}.3f}" for n in names[1:]))
    report = {"note": args.note, **report_header(torch.device("cuda")), "trees": trees, "settings": settings,
              "rounds": args.rounds,
              "quick": args.quick, "workloads": workloads, "repeats": args.repeats, "order": "ABBA...", "runs": runs,
              "medians": medians, "ratios": ratios}
    write_report(report, args.out, "-".join(p for p in ("ab-commits", "cuda", "quick" if args.quick else "",
                                                        str(datetime.date.today())) if p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
