"""The online benchmark's client (`minirt.serve.bench`): streamed completions over raw HTTP/1.1, nothing else.

One connection per request over asyncio streams; the body's `data:` lines are parsed with `json.loads` and no SDK
object is built, so a client process can keep up with a server many times faster than itself (vLLM's serving
benchmark reads its SSE lines with aiohttp for the same reason). The module imports only the standard library:
run as a script (`python -P bench_client.py`) it is one client process of the benchmark, reading one job per line on
stdin (JSON: url, model, jobs, output_len, start_at on the `time.monotonic` clock) and answering one line each.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit


async def sse_data(host: str, port: int, path: str, body: dict):
    """POST `body` as JSON over one HTTP/1.1 connection and yield the payload of every `data:` line of the
    server-sent event stream (bytes, without the field name). Reads chunked and plain bodies. Raises
    RuntimeError with the status and the start of the body on any status but 200."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Accept: text/event-stream\r\nConnection: close\r\n\r\n%s"
                     % (path.encode(), host.encode(), port, len(raw), raw))
        status = await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        code = int(status.split()[1]) if len(status.split()) > 1 else 0
        if code != 200:
            raise RuntimeError(f"HTTP {code}: {(await reader.read(300)).decode(errors='replace')}")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
        pending = b""
        while True:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    break
                data = (await reader.readexactly(size + 2))[:-2]
            else:
                data = await reader.read(65536)
                if not data:
                    break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if pending.startswith(b"data:"):
            yield pending[5:].strip()
    finally:
        writer.close()


async def stream_one(url: str, model: str, prompt: list[int], output_len: int) -> dict:
    """One streamed greedy completion of `output_len` tokens (EOS ignored); returns its client-side timings
    (seconds from its send), the streamed text and the server's `usage.completion_tokens`."""
    parts = urlsplit(url)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    chunk_times, texts, tokens, error, finish = [], [], None, None, None
    try:
        async for data in sse_data(parts.hostname, parts.port or 80, parts.path.rstrip("/") + "/v1/completions",
                                   body):
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            choices = chunk.get("choices")
            if choices:
                if choices[0].get("text"):
                    chunk_times.append(time.perf_counter() - start)
                    texts.append(choices[0]["text"])
                finish = choices[0].get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:                    # noqa: BLE001 - a failed request is a result, counted as such
        error = f"{type(e).__name__}: {e}"
    e2e = time.perf_counter() - start
    ok = error is None and bool(chunk_times) and tokens is not None
    if error is None and not ok:
        error = "the stream ended without text or without usage"
    return {"ok": ok, "error": error, "e2e_s": e2e, "output_tokens": tokens or 0, "text": "".join(texts),
            "finish_reason": finish, "ttft_s": chunk_times[0] if ok else None,
            "tpot_s": (chunk_times[-1] - chunk_times[0]) / (tokens - 1) if ok and tokens > 1 else None,
            "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])]}


async def send_all(url: str, model: str, jobs: list[tuple[int, float, list[int]]], output_len: int,
                   cpu_clock=time.thread_time) -> dict:
    """Send each job `(index, send time s, prompt)` at its time from now; returns {"results": [[index, result], ...],
    "wall_s", "cpu_s", "started_at"}: the span from now to the last answer, the CPU seconds `cpu_clock` counted in
    it, and now on the `time.monotonic` clock."""
    start, started_at, cpu0 = time.perf_counter(), time.monotonic(), cpu_clock()

    async def at(t, prompt):
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await stream_one(url, model, prompt, output_len)

    results = await asyncio.gather(*(at(t, p) for _, t, p in jobs))
    return {"results": [[i, r] for (i, _, _), r in zip(jobs, results)], "wall_s": time.perf_counter() - start,
            "cpu_s": cpu_clock() - cpu0, "started_at": started_at}


def main() -> None:
    """A client process: for each job line on stdin, wait until its start time, send, answer one JSON line."""
    for line in sys.stdin:
        job = json.loads(line)
        time.sleep(max(0.0, job["start_at"] - time.monotonic()))
        answer = asyncio.run(send_all(job["url"], job["model"], [tuple(j) for j in job["jobs"]], job["output_len"],
                                      time.process_time))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
