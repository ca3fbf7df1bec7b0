"""The sandbox a submission's worker runs in, probed directly with small scripts (no notebook, no torch):
the file system it sees, the network, its limits, and that nothing it starts outlives it."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from minirt.course import sandbox
from minirt.course.sandbox import Limits, Worker

ROOT = Path(__file__).resolve().parent.parent
KINDS = [k for k in ("bwrap", "user") if sandbox.works(k)]
needs_bwrap = pytest.mark.skipif(not sandbox.works("bwrap"), reason="bwrap cannot run here (see .ci/run)")


def _run(kind: str, code: str, limits: Limits = Limits(), timeout: float = 60) -> dict:
    """Run `code` in a worker of this kind; it prints one JSON line, returned as a dict."""
    w = Worker(kind, 3, limits, b"{}", argv=[sys.executable, "-s", "-c", code])
    try:
        out, err = w.proc.communicate(timeout=timeout)
    finally:
        w.cleanup()
    lines = out.decode().strip().splitlines()
    assert lines, err.decode()[-2000:]
    return json.loads(lines[-1])


def test_bwrap_runs_here():
    """CI installs bubblewrap (.ci/run) and runs as root: the real sandbox must be what `auto` picks there."""
    if os.geteuid() != 0:
        pytest.skip("the grader's sandbox needs root")
    assert sandbox.resolve("auto") == "bwrap"


@needs_bwrap
def test_bwrap_hides_the_checkout_and_only_tmp_is_writable(tmp_path):
    """No file of the checkout is visible (a venv inside it is bound alone, so its parent folders exist, empty)."""
    other = tmp_path / "other_submission.ipynb"
    other.write_text("secret")
    code = f"""
import json, os, minirt
seen = {{p: os.path.exists(p) for p in [{str(ROOT / 'solutions')!r}, {str(ROOT / 'README.md')!r},
                                       {str(ROOT / 'minirt')!r}, {str(ROOT / '.git')!r}, {str(other)!r},
                                       {str(tmp_path)!r}, "/work/main/README.md", "/home"]}}
writes = {{}}
for p in [os.path.join(os.path.dirname(minirt.__file__), "x"), "/usr/x", "/etc/x", "/opt/x", "/tmp/x"]:
    try:
        open(p, "w").write("x")
        writes[p] = True
    except OSError:
        writes[p] = False
print(json.dumps({{"seen": seen, "writes": writes, "uid": os.getuid(), "pid": os.getpid(),
                  "minirt": minirt.__file__, "solutions_near_minirt":
                  os.path.exists(os.path.join(os.path.dirname(minirt.__file__), "..", "solutions"))}}))
"""
    r = _run("bwrap", code)
    assert not any(r["seen"].values()), r["seen"]
    assert not r["solutions_near_minirt"]
    assert r["writes"] == {p: p == "/tmp/x" for p in r["writes"]}, r["writes"]
    assert r["uid"] == sandbox.slot_uid(3) and r["pid"] < 10          # an unprivileged uid, its own PID namespace
    assert r["minirt"].startswith(sandbox.SANDBOX_LIB)
    assert not (ROOT / "minirt" / "x").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_no_network_to_a_listener_on_localhost(kind):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept())
        except OSError:
            pass
    try:
        code = f"""
import json, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    r = "connected"
except OSError as e:
    r = type(e).__name__
print(json.dumps({{"result": r}}))
"""
        r = _run(kind, code)
        accept()
        assert r["result"] != "connected" and not accepted
    finally:
        listener.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fork_without_end_is_bounded_and_nothing_outlives_the_worker(kind):
    limits = Limits(processes=24)
    code = """
import json, os, time
n = 0
try:
    while n < 400:
        if os.fork() == 0:
            time.sleep(120)          # children stay: each holds a process slot
            os._exit(0)
        n += 1
except OSError as e:
    print(json.dumps({"forks": n, "error": type(e).__name__}))
else:
    print(json.dumps({"forks": n, "error": None}))
"""
    r = _run(kind, code, limits)
    assert r["error"] == "BlockingIOError" and r["forks"] < limits.processes, r
    uid = str(sandbox.slot_uid(3))
    left = [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]
    assert left == [], left


def _uid_of(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(ln.split()[1] for ln in f if ln.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("kind", KINDS)
def test_memory_cpu_and_file_size_limits(kind):
    limits = Limits(memory_bytes=1 * 2**30, file_bytes=2**20, cpu_seconds=2)
    code = """
import json, resource, signal
out = {}
try:
    x = bytearray(2 * 2**30)
    out["alloc"] = "ok"
except MemoryError:
    out["alloc"] = "MemoryError"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
try:
    with open("/tmp/big" if %r == "bwrap" else "big", "wb") as f:
        f.write(b"x" * (4 * 2**20))
    out["file"] = "ok"
except OSError as e:
    out["file"] = e.errno
out["cpu"] = resource.getrlimit(resource.RLIMIT_CPU)[0]
print(json.dumps(out))
""" % kind
    r = _run(kind, code, limits)
    assert r["alloc"] == "MemoryError" and r["file"] == 27 and r["cpu"] == 2, r     # 27: EFBIG
