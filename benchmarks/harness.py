"""Timing and argument helpers the benchmark scripts share (`python benchmarks/X.py`, `python lab/probes/X.py`).

A script in `benchmarks/` imports them as `from harness import ...` (its folder is on `sys.path`); a lab probe puts
`benchmarks/` on `sys.path` first. What `python -m minirt bench` itself needs (the workloads, `run_minirt`,
`report_header`, `write_report`) stays in `minirt/bench.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from minirt.config import EngineConfig


def cuda_seconds(fn, iters: int = 10) -> float:
    """Median seconds of `fn()` on the current CUDA stream over `iters` calls (after one untimed call), by CUDA
    events around each."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cuda_graph_seconds(fn, iters: int = 15) -> float:
    """Median seconds of one replay of `fn` captured in a CUDA graph (`fn` run once before, to compile and warm up;
    `cuda_seconds` over `iters` replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_seconds(graph.replay, iters)


def cuda_script_args(doc: str, script: str, argv: list[str] | None, *extra: tuple,
                     out_dir: str | None = None) -> argparse.Namespace | None:
    """The arguments of a CUDA-only benchmark script: `--out` (default: `out_dir`, else `results/` beside the script)
    and `extra`, each `(flags, keyword arguments)` of `add_argument`; None, with a line on stderr, where there is no
    CUDA device (the script then exits with 2)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flags, kwargs in extra:
        parser.add_argument(*flags, **kwargs)
    parser.add_argument("--out", default=out_dir or os.path.join(os.path.dirname(os.path.abspath(script)), "results"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{os.path.basename(script)} needs CUDA", file=sys.stderr)
        return None
    return args


_SETTING_VALUES = {"on": True, "off": False, "auto": None}


def parse_engine_settings(text: str, flag: str = "--config") -> tuple[str, dict]:
    """"NAME:field=value,field=value" -> (NAME, {field: value}) for `minirt.LLM`; values on/off/auto or an integer.
    Raises ValueError naming the text, or the field (checked by `minirt.config.EngineConfig`), for anything else."""
    name, sep, fields = text.partition(":")
    if not name or not sep:
        raise ValueError(f"{flag}: expected NAME:field=value,..., got {text!r}")
    kwargs = {}
    for item in filter(None, fields.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{flag}: expected field=value in {text!r}, got {item!r}")
        if value in _SETTING_VALUES:
            kwargs[key] = _SETTING_VALUES[value]
        elif value.lstrip("-").isdigit():
            kwargs[key] = int(value)
        else:
            raise ValueError(f"{flag}: {key}'s value must be on, off, auto or an integer, got {value!r}")
    unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{flag}: unknown engine fields {sorted(unknown)} in {text!r}")
    EngineConfig(**kwargs)                 # the values: raises ValueError naming the field
    return name, kwargs


#: A CUDA script's `--settings field=value,...` (`cuda_script_args`' extra): engine settings instead of the defaults.
SETTINGS_OPTION = (["--settings"], {"default": "", "metavar": "field=value,...",
                                    "help": "engine settings instead of the defaults (ab.py's syntax)"})


def script_settings(text: str) -> dict | None:
    """The engine settings of a script's `--settings` text (`parse_engine_settings`' syntax, no NAME), or None once
    the error is printed to stderr (the script then exits with 2)."""
    try:
        return parse_engine_settings("script:" + text, "--settings")[1]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return None
