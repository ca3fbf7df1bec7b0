"""Command line: `python -m minirt demo` runs the asyncio engine on a batch of corpus prompts;
`python -m minirt generate "PROMPT"` streams one completion; `python -m minirt exercise start ex03` copies an
exercise into a work folder; `python -m minirt course release DIR` writes a student copy of the course without
solutions or answers; `python -m minirt serve` is the OpenAI-compatible server; `grade`, `bench` and
`bench-serve` as their modules say."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

DEMO_PROMPTS = os.path.join(os.path.dirname(__file__), "demo_prompts.json")
#: Printed once, where TTFT and TPOT first appear (the definitions of `minirt.request.RequestMetrics`).
LEGEND = ("TTFT = time to first token (request arrival to its first generated token: queueing and prefill); "
          "TPOT = time per output token (the mean gap between its later tokens: one decode step)")
#: `demo` and `generate` default to one CPU thread for checkpoints whose weights are smaller than this. Measured on
#: the embedded model (11 MB; benchmarks/cpu_threads.py): on a 2-core machine shared with other work, one thread
#: was 3.6x (generate's TPOT) to 24x (demo's) faster than two (benchmarks/results/cpu/threads.json); on idle cores
#: more threads win, but by 1.4x to 1.7x, about a second of generation in commands that take longer to start
#: (benchmarks/results/cpu/threads-idle.json). One thread is the safe default; `--threads` takes the rest. Larger
#: checkpoints keep torch's default, one thread per core.
SMALL_MODEL_BYTES = 256 * 2**20


def _engine_args(p: argparse.ArgumentParser, temperature: float = 0.0, top_k: int = 0, seed: int | None = None) -> None:
    from minirt.engine import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="local HF-format checkpoint or hub id (default: embedded)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes the model is sharded over (chapter 09; gloo on the CPU, NCCL on GPUs)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default {temperature})")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=top_k, help=f"0 = no limit (default {top_k})")
    p.add_argument("--seed", type=int, default=seed, help="seed of the sampler (request i uses seed + i)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op CPU threads (default: OMP_NUM_THREADS when set; else 1 for a model under "
                        "256 MB of weights, such as the embedded one, where one thread is fastest; else one per core)")


def _weight_bytes(model: str) -> int | None:
    """Bytes of the checkpoint's weight files, or None when `model` is not a local folder (a hub id)."""
    if not os.path.isdir(model):
        return None
    return sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
               if f.endswith((".safetensors", ".bin", ".pt")))


def default_threads(model: str) -> int | None:
    """The CPU thread count `demo` and `generate` use without `--threads`: None (torch's default) when the
    environment sets OMP_NUM_THREADS, else 1 for a local checkpoint under `SMALL_MODEL_BYTES`, else None (torch's
    default, one thread per core)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    size = _weight_bytes(model)
    return 1 if size is not None and size < SMALL_MODEL_BYTES else None


def _threads_text(n: int) -> str:
    return f"{n} CPU thread" + ("s" if n != 1 else "")


def set_threads(args) -> int:
    """Apply `--threads` (or `default_threads`) to torch before the engine is built, so tensor-parallel ranks
    inherit it too; returns the thread count in force. Raises ValueError for a count below 1."""
    import torch

    threads = args.threads if args.threads is not None else default_threads(args.model)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads: must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _params(args, index: int = 0):
    from minirt.sampling import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=None if args.seed is None else args.seed + index)


async def _demo(args) -> int:
    from tqdm.auto import tqdm

    from minirt import Engine
    from minirt.metrics import format_table, summarize

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    with open(DEMO_PROMPTS) as f:
        prompts = json.load(f)[: args.num_prompts]
    params = [_params(args, i) for i in range(len(prompts))]
    threads = set_threads(args)
    engine = Engine(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    for prompt, p in zip(prompts, params):
        engine.validate(prompt, p)          # refuse bad settings before anything is shown
    print(f"minirt demo: {len(prompts)} prompts on {engine.device} ({engine.model.dtype}), "
          f"{engine.pool.num_blocks} KV blocks of {engine.config.block_size} tokens, {_threads_text(threads)}", flush=True)
    async with engine:
        bar = tqdm(total=len(prompts) * args.max_new_tokens, desc="tokens", unit="tok", file=sys.stderr)

        async def one(prompt, p):
            async for delta in engine.stream(prompt, p):
                bar.update(len(delta.token_ids))
                if delta.finished:
                    return delta.output

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params)))
        wall = time.perf_counter() - start
        bar.close()
    for o in outputs:
        print("=" * 72)
        print(o.prompt + o.text)
    print("=" * 72)
    rows = [[o.request_id, len(o.prompt_token_ids), len(o.token_ids), o.finish_reason, o.metrics.queue_s,
             o.metrics.ttft_s, o.metrics.tpot_s, o.metrics.e2e_s] for o in outputs]
    print(LEGEND)
    print(format_table(["request", "prompt tok", "output tok", "finish", "queue s", "TTFT s", "TPOT s", "e2e s"], rows))
    s = summarize(outputs, wall)
    print(f"\n{s['output_tokens']} output tokens in {wall:.2f} s = {s['output_tokens_per_s']:.1f} tok/s; "
          f"TTFT p50 {s['ttft_p50_s']:.4f} s, TPOT p50 {s['tpot_p50_s'] or 0:.4f} s")
    return 0


async def _generate(args) -> int:
    import torch

    from minirt import Engine

    params = _params(args)
    set_threads(args)
    engine = Engine(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    engine.validate(args.prompt, params)    # refuse bad input before echoing the prompt
    async with engine:
        sys.stdout.write(args.prompt)
        async for delta in engine.stream(args.prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.finished:
                out = delta.output
    m = out.metrics
    print()
    print(LEGEND, file=sys.stderr)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, {_threads_text(torch.get_num_threads())}, TTFT {m.ttft_s:.4f} s"
          + (f", TPOT {m.tpot_s:.4f} s]" if m.tpot_s is not None else "]"), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minirt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the asyncio engine on a batch of Shakespeare/Milton prompts")
    _engine_args(demo, temperature=0.8, top_k=40, seed=0)   # greedy loops on a model this small
    demo.add_argument("--num-prompts", type=int, default=None, help="use only the first N demo prompts")
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    gen.add_argument("prompt")
    _engine_args(gen)
    from minirt import bench
    from minirt.course import grading, release, work
    from minirt.serve import bench as serve_bench, server

    grading.add_parser(sub)
    bench.add_parser(sub)
    work.add_parser(sub)
    release.add_parser(sub)
    server.add_parser(sub)
    serve_bench.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return server.run(args)
    if args.command == "bench-serve":
        return serve_bench.run(args)
    if args.command == "grade":
        return grading.run(args)
    if args.command == "exercise":
        return work.run(args)
    if args.command == "course":
        return release.run(args)
    if args.command == "bench":
        return bench.run(args)
    try:
        return asyncio.run(_demo(args) if args.command == "demo" else _generate(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
