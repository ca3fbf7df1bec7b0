"""How far ahead, and how much, should a batch-1 GEMV ask the L2 cache for? An interleaved A/B on CUDA.

    python lab/probes/l2_prefetch.py [--rounds 8] [--out lab/results/l2-prefetch]

`EngineConfig.l2_prefetch` has each one-row GEMV of a decode step ask L2 for the weights of the GEMV right after
it (`minirt.fast.layers.bind_l2_prefetch`, ahead=1, count=1). Here each setting gets a
`minirt.LLM` built without it, whose GEMV hooks are then bound with another (ahead, count) and whose decode graphs
are captured again; the rounds run as in `ab.py` (one 512-token prompt, 256 new tokens per round and setting,
alternating order). Prints the table and writes `l2-prefetch-cuda-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]       # minirt from this tree; harness, ab
from ab import interleaved_variants, new_llm, report_tpot  # noqa: E402


#: name -> (ahead, count), or None for no prefetch. The first row is the baseline of the ratios.
SCHEMES = {"off": None, "the next GEMV (the default)": (1, 1), "the one after next": (2, 1),
           "the next two": (1, 2), "the next three": (1, 3)}


def rebind(llm, ahead: int, count: int) -> None:
    """Bind (ahead, count) into an engine built with l2_prefetch off, and capture its decode graphs again."""
    from minirt.fast.layers import bind_l2_prefetch
    from minirt.kernels.gemv_triton import l2_prefetch_table

    bind_l2_prefetch(llm.engine.model, l2_prefetch_table, ahead, count)
    graphs = llm.engine.model_runner.decode_graphs
    graphs.graphs.clear()
    graphs.outputs.clear()
    graphs.capture()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="requests per setting (default 8)")
    parser.add_argument("--out", default=str(REPO / "lab" / "results" / "l2-prefetch"))
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds: must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    from minirt.kernels import pdl_missing

    if not torch.cuda.is_available() or pdl_missing(torch.device("cuda")):
        print("error: this benchmark needs a CUDA device with the bulk prefetch into L2 (Hopper or later)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda")

    def build(scheme):
        def make(model):
            llm = new_llm(model, device, l2_prefetch=False)
            if scheme:
                rebind(llm, *scheme)
            return llm
        return make

    _, tpot = interleaved_variants({name: build(scheme) for name, scheme in SCHEMES.items()}, args.rounds, device)
    settings = {name: None if s is None else {"ahead": s[0], "count": s[1]} for name, s in SCHEMES.items()}
    report_tpot(tpot, settings, args.rounds, device, args.out, f"l2-prefetch-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
