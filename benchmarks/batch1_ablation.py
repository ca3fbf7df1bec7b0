"""What each of a batch-1 decode step's kernels costs on its critical path: the step timed without it.

    python benchmarks/batch1_ablation.py [--rounds 4] [--variants NAME ...] [--out benchmarks/results]

With programmatic dependent launch the kernels of a step overlap, so a profile's kernel times no longer add up to
the step, and a kernel's own duration is not what the step would save without it. Here every variant is a
`minirt.LLM` with the default plan whose decode graphs were captured with some kernels left out (their Python
launchers replaced by functions that launch nothing while the engine was built), all on the same random
Qwen3-0.6B-shaped checkpoint, timed in interleaved rounds as `ab.py` times settings (512-token prompt, 256 new
tokens). The tokens of a variant are garbage: only its time means anything. The variants:

* `rotary`: the q/k norm and rotation with the K/V write (`norm_rotate_and_store_triton`);
* `combine`: the split-KV combine (`_combine_splits_kernel`);
* `attention`: the attention kernel and its combine;
* `rotary+combine`: what one kernel for the rotation, the K/V write, attention and the combine could save at most;
* `rotary+attention`: the step's GEMVs, the LM head and its per-step kernels (embedding, cos and sin, the final norm,
  the sampler, the burst's input advance) alone;
* `o_proj`, `down_proj`: that GEMV left out, its input's first columns (a view, no kernel) taken for its
  output; what one kernel boundary fewer between attention and the MLP, or inside the MLP, could save at most (the
  GEMV before it still asks the L2 cache for its weights; the one left out no longer asks for the next one's).

Prints each variant's TPOT median, its ratio to the first variant's (`default` unless --variants names another
first), and the time saved per layer against it (28 layers), and
writes `batch1-ablation-cuda-<date>.json`. Needs CUDA. The figures: `lab/pages/batch1-ablation.md`.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from ab import interleaved_variants, new_llm  # noqa: E402
from minirt.bench import report_header, write_report  # noqa: E402
from harness import cuda_script_args  # noqa: E402
from minirt.fast.layers import GemvLinear  # noqa: E402
from minirt.metrics import format_table  # noqa: E402

VARIANTS = {"default": (), "rotary": ("rotary",), "combine": ("combine",), "attention": ("attention", "combine"),
            "rotary+combine": ("rotary", "combine"), "rotary+attention": ("rotary", "attention", "combine"),
            "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
LAYERS = 28


class _FirstColumns(GemvLinear):
    """Stands in for a projection: its input's first out_features columns, a view, no kernel."""

    def forward(self, x):
        return x[..., :self.out_features]


def _replacing(cls, name: str):
    """A patch of `cls.__init__` that, after it, swaps the module's projection `name` for a `_FirstColumns`."""
    init = cls.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        setattr(self, name, _FirstColumns(getattr(self, name), lambda *args, **kwargs: None))
    return mock.patch.object(cls, "__init__", patched)


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def left_out(parts: tuple[str, ...]):
    """The kernels of `parts` replaced by functions that launch nothing, while an engine is built (its decode graphs
    are captured then)."""
    from minirt.fast.attention import KernelPagedAttention
    from minirt.fast.layers import FastAttention, FastMLP

    patches = []
    if "rotary" in parts:      # the rotated q is q itself; the K/V cache is not written
        patches.append(mock.patch("minirt.kernels.rotary_triton.norm_rotate_and_store_triton",
                                  lambda q, *args, **kwargs: q))
    if "combine" in parts:
        patches.append(mock.patch("minirt.kernels.paged_attention_triton._combine_splits_kernel", _NoLaunch()))
    if "attention" in parts:
        patches.append(mock.patch.object(KernelPagedAttention, "attend", lambda self, layer_idx, q: q))
    if "o_proj" in parts:
        patches.append(_replacing(FastAttention, "o_proj"))
    if "down_proj" in parts:
        patches.append(_replacing(FastMLP, "down_proj"))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--rounds",), {"type": int, "default": 4}),
                            (("--variants",), {"nargs": "+", "choices": list(VARIANTS), "default": list(VARIANTS),
                                               "help": "which to time (default: all; the first is the baseline)"}))
    if args is None:
        return 2
    variants = {name: VARIANTS[name] for name in args.variants}
    device = torch.device("cuda")

    def build(parts):
        def make(model):
            with left_out(parts):
                return new_llm(model, device)
        return make

    llms, tpot = interleaved_variants({name: build(parts) for name, parts in variants.items()}, args.rounds, device)
    base = statistics.median(tpot[args.variants[0]])
    rows = []
    for name, runs in tpot.items():
        med = statistics.median(runs)
        rows.append([name, med * 1e3, med / base, (base - med) / LAYERS * 1e6,
                     " ".join(f"{x * 1e3:.3f}" for x in runs)])
    print(format_table(["left out", "TPOT median ms", "x first", "saved per layer us", "every run (ms)"], rows))
    report = {**report_header(device), "workload": {"prompt_len": 512, "new_tokens": 256, "rounds": args.rounds},
              "variants": {name: list(parts) for name, parts in variants.items()},
              "plan": next(iter(llms.values())).engine.plan.as_dict(), "tpot_s": tpot,
              "tpot_median_s": {name: statistics.median(v) for name, v in tpot.items()}}
    write_report(report, args.out, f"batch1-ablation-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
