"""Probe: a batch-1 step with the split-KV combine and o_proj in one kernel, timed against the default step
(lab/pages/combine-o-proj.md).

    python lab/probes/combine_o_proj_probe.py [--rounds 6] [--block-n 64 32] [--out lab/results/combine-o-proj]

`lab.kernels.combine_o_proj_triton` does a one-token step's combine and o_proj in one launch: one kernel boundary
fewer per layer. Before it is a switch of the plan, this times it in the engine: each variant is a `minirt.LLM` with
the default plan built (and its decode graphs captured) while `FastAttention` is patched to run one-row steps that
way, the attention kernel returning its splits' partial results (`paged_attention_partials`) and the
new kernel taking o_proj's weight and its L2 prefetch of gate/up's weights; one variant per row tile (`--block-n`).
Interleaved rounds as `ab.py`'s; `batch1_ablation.py`'s `o_proj` variant gives what leaving o_proj out saves, the most
this can (a loose bound: it also drops o_proj's weight reads; its `combine` ablation, measured at 0.79 µs a layer, is
the tight one). Prints each variant's TPOT median and ratio to the default's and writes
`combine-o-proj-probe-cuda-<date>.json`. Needs CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
from ab import interleaved_variants, new_llm  # noqa: E402
from harness import cuda_script_args  # noqa: E402
from minirt.bench import make_prompts, report_header, run_minirt, write_report  # noqa: E402
from minirt.fast.attention import KernelPagedAttention  # noqa: E402
from minirt.fast.layers import FastAttention, GemvLinear, one_row  # noqa: E402
from lab.kernels.combine_o_proj_triton import combine_o_proj, counters_for, paged_attention_partials  # noqa: E402
from minirt.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402
from minirt.metrics import format_table  # noqa: E402


def o_proj_in_combine(block_n: int):
    """A context manager factory: inside, `FastAttention` modules built get counters, and their one-row steps (with the
    K/V write in the rotary kernel and a paged Triton backend) end in `combine_o_proj`."""
    init, attend = FastAttention.__init__, FastAttention.attend

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.o_counters = counters_for(self.o_proj.out_features, self.o_proj.weight.device, block_n)

    def patched_attend(self, q, k, v, cos, sin, attn):
        kernel = getattr(attn, "kernel", None)
        if not (one_row(q) and self.rotate_and_store is not None and isinstance(attn, KernelPagedAttention)
                and getattr(kernel, "func", None) is paged_attention_triton
                and kernel.keywords.get("split_counters") is None
                and isinstance(self.o_proj, GemvLinear) and hasattr(self, "o_counters")):
            return attend(self, q, k, v, cos, sin, attn)
        B, T, _ = q.shape
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        k_cache, v_cache = attn.kv_cache[self.layer_idx]
        q = self.rotate_and_store(q, k, v, cos, sin, *norm, k_cache, v_cache, attn.meta.slot_mapping)
        parts = paged_attention_partials(q[0], k_cache, v_cache, attn.meta, **attn.kernel.keywords)
        if not isinstance(parts, tuple):                  # no split-KV: the usual o_proj
            return self.o_proj(parts.reshape(B, T, -1))
        gemv = self.o_proj.gemv
        l2 = gemv.keywords.get("l2_prefetch") if isinstance(gemv, functools.partial) else None
        out = combine_o_proj(*parts, self.o_proj.weight, self.o_proj.bias, self.o_counters, q.dtype,
                             pdl=attn.kernel.keywords.get("pdl", False), l2_prefetch=l2, block_n=block_n)
        return out.view(B, T, -1)

    @contextlib.contextmanager
    def patched():
        with mock.patch.object(FastAttention, "__init__", patched_init), \
                mock.patch.object(FastAttention, "attend", patched_attend):
            yield
    return patched


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, (("--rounds",), {"type": int, "default": 6}),
                            (("--block-n",), {"type": int, "nargs": "+", "default": [64, 32]}),
                            out_dir=str(REPO / "lab" / "results" / "combine-o-proj"))
    if args is None:
        return 2
    if bad := [n for n in args.block_n if n < 1 or n & (n - 1)]:
        print(f"--block-n: each must be a power of two, got {bad}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    around = {f"combine_o_proj-{n}": o_proj_in_combine(n) for n in args.block_n}
    build = {name: (lambda model: new_llm(model, device)) for name in ["default", *around]}
    llms, tpot = interleaved_variants(build, args.rounds, device, around)
    prompt = make_prompts(1, (512, 512), llms["default"].engine.model.config.vocab_size, seed=11)
    tokens = {}
    for name, llm in llms.items():                        # bf16 greedy tokens of one prompt, against the default's
        with around.get(name, contextlib.nullcontext)():
            tokens[name] = run_minirt(llm, prompt, 128, device)[1][0]
    agree = {name: next((i for i, (a, b) in enumerate(zip(t, tokens["default"])) if a != b), len(t))
             for name, t in tokens.items()}
    print("greedy tokens equal to the default's before the first difference (of 128):", agree)
    base = statistics.median(tpot["default"])
    rows = [[name, statistics.median(runs) * 1e3, statistics.median(runs) / base,
             (base - statistics.median(runs)) / 28 * 1e6, " ".join(f"{x * 1e3:.3f}" for x in runs)]
            for name, runs in tpot.items()]
    print(format_table(["variant", "TPOT median ms", "x default", "saved per layer us", "every run (ms)"], rows))
    report = {**report_header(device), "workload": {"prompt_len": 512, "new_tokens": 256, "rounds": args.rounds},
              "plan": llms["default"].engine.plan.as_dict(), "tpot_s": tpot,
              "tpot_median_s": {name: statistics.median(v) for name, v in tpot.items()},
              "tokens_equal_before_first_difference_of_128": agree}
    write_report(report, args.out, f"combine-o-proj-probe-cuda-{datetime.date.today()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
