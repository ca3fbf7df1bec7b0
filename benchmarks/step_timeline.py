"""The throughput workload's engine steps on one clock: what the host does when, and when the GPU runs each forward.

    PYTHONPATH=. python benchmarks/step_timeline.py [--settings field=value,...] [--tag NAME]

Needs CUDA. Builds the bench's random Qwen3-0.6B-shaped checkpoint, warms the engine up, then runs the throughput
workload once with the engine's methods wrapped: the host's start and end of every engine step, `schedule`,
`postprocess`, the runner's `prepare_lists`, `execute` / `launch_step`, `forward`, `sample`, `finish_step`, the input
copy (`InputStaging.send`) and the bursts' `start_decode_steps` / `continue_decode_steps` / `finish_decode_steps`
(`time.perf_counter`); and CUDA events before and after each step's input copy and after its forward, converted to
the host's clock through one event recorded at a known host time. Seconds from the workload's start.

Prints, for the steps with prefill chunks, the median host time of each wrapped call and when the last of them
ended; writes `step-timeline-cuda-<date>[-TAG].json` (`host`: [name, start, end]; `gpu`: [what, start, end or
null, tokens]). It showed that `sample` took the host until the end of the step's forward
(`lab/pages/async-scheduling.md`).
"""

from __future__ import annotations

import datetime
import functools
import statistics
import sys
import tempfile
import time

import torch

import minirt
from minirt.bench import WORKLOADS, build_random_qwen3, make_prompts, report_header, write_report
from harness import SETTINGS_OPTION, cuda_script_args, script_settings

WRAPPED = (("scheduler", "schedule"), ("engine", "postprocess"), ("runner", "prepare_lists"), ("runner", "forward"),
           ("runner", "sample"), ("runner", "finish_step"), ("runner", "finish_decode_steps"), ("runner", "execute"),
           ("runner", "launch_step"), ("runner", "start_decode_steps"), ("runner", "continue_decode_steps"),
           ("staging", "send"))


def wrap(obj, name: str, log: list) -> None:
    """Replace `obj.name` by a wrapper that appends (name, host start, host end) to `log` for each call."""
    f = getattr(obj, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        result = f(*args, **kwargs)
        log.append((name, t0, time.perf_counter()))
        return result

    setattr(obj, name, timed)


def main(argv: list[str] | None = None) -> int:
    args = cuda_script_args(__doc__, __file__, argv, SETTINGS_OPTION,
                            (["--tag"], {"default": "", "help": "a suffix of the JSON's name"}))
    settings = None if args is None else script_settings(args.settings)
    if settings is None:
        return 2
    device = torch.device("cuda")
    report = {**report_header(device), "settings": settings}
    n_req, lengths, n = WORKLOADS["cuda", False]["throughput"]
    log, gpu = [], []
    with tempfile.TemporaryDirectory() as tmp:
        llm = minirt.LLM(build_random_qwen3(tmp, device, 0), device=device, dtype=torch.bfloat16, **settings)
        engine = llm.engine
        vocab = engine.model.config.vocab_size
        params = minirt.SamplingParams(max_new_tokens=n, ignore_eos=True)
        llm.generate(make_prompts(8, lengths, vocab, 101), minirt.SamplingParams(max_new_tokens=8, ignore_eos=True))
        runner = engine.model_runner
        owners = {"scheduler": engine.scheduler, "engine": engine, "runner": runner, "staging": runner.staging}
        for owner, name in WRAPPED:
            if hasattr(owners[owner], name):
                wrap(owners[owner], name, log)
        send, forward = runner.staging.send, runner.forward

        def send_with_events(step):
            before = torch.cuda.Event(enable_timing=True)
            before.record()
            out = send(step)
            after = torch.cuda.Event(enable_timing=True)
            after.record()
            gpu.append(["send", before, after, len(step.input_ids)])
            return out

        def forward_with_event(step, fill=None):
            hidden = forward(step) if fill is None else forward(step, fill)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            gpu.append(["forward_end", end, None, len(step.input_ids)])
            return hidden

        runner.staging.send, runner.forward = send_with_events, forward_with_event
        engine_step = engine.step_fn          # the step the loop and LLM call (`Engine.step` stays as printed)

        def step():
            t0 = time.perf_counter()
            result = engine_step()
            log.append(("ENGINE_STEP", t0, time.perf_counter()))
            return result

        engine.step_fn = step
        prompts = make_prompts(n_req, lengths, vocab, 0)
        torch.cuda.synchronize()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        torch.cuda.synchronize()
        t_ref = start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        report["wall_s"] = time.perf_counter() - start
        on_host = lambda e: t_ref + ref.elapsed_time(e) / 1e3 - start          # noqa: E731
        report["gpu"] = [[what, on_host(a), None if b is None else on_host(b), tokens] for what, a, b, tokens in gpu]
        report["host"] = [[name, a - start, b - start] for name, a, b in log]
    first_burst = min((a for name, a, _ in report["host"] if name == "start_decode_steps"), default=report["wall_s"])
    report["prefill_phase_s"] = first_burst
    print(f"wall {report['wall_s']:.3f} s; the steps with prefill chunks end at {first_burst:.3f} s")
    for name in ("schedule", "prepare_lists", "send", "forward", "sample", "postprocess"):
        times = [(b - a) * 1e3 for what, a, b in report["host"] if what == name and b <= first_burst]
        if times:
            print(f"  {name:14s} median {statistics.median(times):6.2f} ms over {len(times)} calls")
    tag = f"-{args.tag}" if args.tag else ""
    write_report(report, args.out, f"step-timeline-cuda-{datetime.date.today()}{tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
