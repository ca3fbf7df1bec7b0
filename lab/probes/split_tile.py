"""The split-KV attention launch's tile at small decode batches: TPOT per tile, interleaved.

    python lab/probes/split_tile.py [--rounds 6] [--out lab/results/kernel-choices-and-tiles]

`paged_attention_triton` splits a decode's keys over several programs when a decode batch has fewer (sequence, KV
head) pairs than twice the SMs (`choose_num_splits`): batch 1 to 32 of Qwen3-0.6B. Those launches take
`SPLIT_TILE` (keys per tile, warps, pipeline stages); the decode and chunk tiles were swept at 256 sequences and on
prefill chunks (`lab/pages/throughput-ceiling.md`), the split tile's warps were not. Here every tile gets a
`minirt.LLM` on the same random Qwen3-0.6B-shaped checkpoint, built with `SPLIT_TILE` set to it while its decode
graphs are captured, and each round runs, on each in turn (the order alternating), one request and then a batch of
8 (512-token prompts, 256 new tokens each), as `ab.py` does. Prints TPOT medians and their ratio to the first tile's,
and writes `split-tile-cuda-<date>.json`. Needs CUDA. The figures: `lab/pages/kernel-choices-and-tiles.md`.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from ab import new_llm  # noqa: E402
from harness import cuda_script_args  # noqa: E402
from minirt.bench import build_random_qwen3, make_prompts, report_header, run_minirt, write_report  # noqa: E402
from minirt.metrics import format_table  # noqa: E402

TILES = [(64, 4, 3), (64, 8, 3), (64, 8, 2), (64, 8, 4)]     # (keys per tile, warps, stages); the first: the baseline
BATCHES = (1, 8)


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--rounds",), {"type": int, "default": 6}),
                            out_dir=str(REPO / "lab" / "results" / "kernel-choices-and-tiles"))
    if args is None:
        return 2
    from minirt.kernels import paged_attention_triton

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = torch.device("cuda")
    default = paged_attention_triton.SPLIT_TILE
    with tempfile.TemporaryDirectory() as tmp:
        model = build_random_qwen3(tmp, device, seed=0)
        llms = {}
        for tile in TILES:
            with mock.patch.object(paged_attention_triton, "SPLIT_TILE", tile):
                llms[tile] = new_llm(model, device)
        vocab = next(iter(llms.values())).engine.model.config.vocab_size
        prompts = make_prompts(args.rounds * sum(BATCHES) + max(BATCHES), (512, 512), vocab, seed=3)
        for llm in llms.values():                                   # warm-up: first-use compiles at each size
            for b in BATCHES:
                run_minirt(llm, prompts[-b:], 16, device)
        tpot = {(tile, b): [] for tile in TILES for b in BATCHES}
        at = 0
        for r in range(args.rounds):
            for b in BATCHES:
                batch, at = prompts[at:at + b], at + b
                for tile in (TILES if r % 2 == 0 else TILES[::-1]):
                    with mock.patch.object(paged_attention_triton, "SPLIT_TILE", tile):   # eager steps too
                        fig, _ = run_minirt(llms[tile], batch, 256, device)
                    tpot[tile, b].append(fig["tpot_p50_s"])
    rows = []
    for b in BATCHES:
        first = statistics.median(tpot[TILES[0], b])
        for tile in TILES:
            runs = tpot[tile, b]
            rows.append([b, str(tile), statistics.median(runs) * 1e3, statistics.median(runs) / first,
                         " ".join(f"{x * 1e3:.3f}" for x in runs)])
    print(format_table(["batch", "split tile", "TPOT median ms", "x first", "every run (ms)"], rows))
    report = {**report_header(device), "default_split_tile": list(default),
              "workload": {"prompt_len": 512, "new_tokens": 256, "rounds": args.rounds, "batches": list(BATCHES)},
              "tpot_s": {f"batch {b}, tile {tile}": tpot[tile, b] for tile in TILES for b in BATCHES},
              "tpot_median_s": {f"batch {b}, tile {tile}": statistics.median(tpot[tile, b])
                                for tile in TILES for b in BATCHES}}
    write_report(report, args.out, f"split-tile-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
