"""Where a submission's worker runs: a bubblewrap sandbox, else an unprivileged user, with resource limits.

`bwrap` (Debian's `bubblewrap`): the grader, as root, starts bwrap, which builds a mount namespace holding only
    /usr /etc /bin /lib* (read-only), the Python install and its site-packages (read-only, at their own
    paths), the installed `minirt` package alone (read-only, at /opt/minirt/minirt, first on PYTHONPATH;
    not the checkout around it, so neither solutions/ nor the grader's files), a fresh /proc and /dev,
    its plan read-only at /grading, and a fresh tmpfs of `Limits.tmp_bytes` as /tmp, the one writable place (also
    HOME and the cwd): a submission that fills it gets ENOSPC there, and the host's disk is never touched.
    It unshares the network (only a loopback of its own), PID, IPC, UTS and cgroup namespaces, starts a
    new session and dies with the grader. Inside, `setpriv` drops to the slot's own unprivileged uid and
    gid (`slot_uid`) with no capabilities before Python starts.
    Why not bwrap's own `--unshare-user`: run as root that maps the sandbox to uid 0 of the host's user
    count, and the kernel does not apply RLIMIT_NPROC to root, so a fork bomb went unbounded here; run as
    the unprivileged uid, bwrap cannot reach the Python install under /root (mode 700). Root outside, a
    real unprivileged uid inside, works here and in CI (root on a machine like this one).
`user`: where bwrap is missing or cannot start, the same uid drop and limits, plus a network namespace of
    its own when the grader is root (unshare(2) before the uid drop). The file system is NOT hidden: the
    worker reads whatever that uid may read (solutions/ too, if it is world-readable).
`none`: the grader's own user and file system; the limits only. For trusted notebooks.

Limits (setrlimit, inherited by everything the worker starts): CPU seconds, address space, processes per
uid, file size, core dumps off. The grader adds a cap on the output it reads and the wall clock.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BASE_UID = 100_000
MAX_SLOTS = 32


def slot_uid(slot: int) -> int:
    """The unprivileged uid of a job slot: one per slot and per grader process (two graders on one machine,
    or one grader's two slots, never share a process limit or kill each other's workers)."""
    if not 0 <= slot < MAX_SLOTS:
        raise ValueError(f"jobs: at most {MAX_SLOTS} at a time")
    return BASE_UID + (os.getpid() % 100_000) * MAX_SLOTS + slot
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 900            # CPU time of the worker (all threads)
    memory_bytes: int = 6 * 2**30     # address space of each process
    processes: int = 64               # processes and threads of the slot's uid
    file_bytes: int = 64 * 2**20      # size of any one file it writes
    tmp_bytes: int = 256 * 2**20      # size of the tmpfs mounted as its /tmp (bwrap)

    def apply(self) -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_seconds, self.cpu_seconds + 5))
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (self.processes, self.processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_bytes, self.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def works(kind: str) -> bool:
    """Whether a worker of this kind can start Python here (probed once per kind, with `python -c pass`)."""
    if kind not in _WORKS:
        ok = False
        if kind == "none":
            ok = True
        elif os.geteuid() == 0 and (kind == "user" or (shutil.which("bwrap") and shutil.which("setpriv"))):
            try:
                w = Worker(kind, 0, Limits(), b"{}", argv=[sys.executable, "-s", "-c", "pass"])
                try:
                    ok = w.proc.wait(timeout=60) == 0
                finally:
                    w.cleanup()
            except (OSError, subprocess.SubprocessError):
                ok = False
        _WORKS[kind] = ok
    return _WORKS[kind]


_WORKS: dict[str, bool] = {}
_BWRAP_FLAGS = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
                "--cap-add", "CAP_SETGID"]


def resolve(kind: str) -> str:
    """`auto` -> the first of bwrap, user, none that works here; an explicit kind that cannot run raises."""
    if kind not in ("auto", "bwrap", "user", "none"):
        raise ValueError(f"sandbox: expected auto, bwrap, user or none, got {kind!r}")
    if kind == "auto":
        return next(k for k in ("bwrap", "user", "none") if works(k))
    if not works(kind):
        raise RuntimeError(f"sandbox: {kind} cannot run here " + (
            "(needs bubblewrap, setpriv and a grader running as root): install bubblewrap, or pass --sandbox user"
            if kind == "bwrap" else "(needs a grader running as root and a Python install that an "
            "unprivileged uid can read)"))
    return kind


def _package_dir() -> Path:
    import minirt

    return Path(minirt.__file__).resolve().parent


def _python_dirs() -> list[str]:
    """The Python install and the environment's packages, without anything under minirt's checkout."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), os.path.realpath(sys.exec_prefix)}
    checkout = str(_package_dir().parent)
    for p in sys.path:
        rp = os.path.realpath(p) if p else ""
        if rp and os.path.isdir(rp) and not any(rp == d or rp.startswith(d + "/") for d in dirs) \
                and not (rp == checkout or rp.startswith(checkout + "/")) and rp.startswith(("/usr", "/opt")):
            dirs.add(rp)
    return sorted(d for d in dirs if d not in ("/usr", "/"))


SANDBOX_LIB = "/opt/minirt"
GRADING_DIR = "/grading"


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[:i + 1]) for i in range(len(parts))]


def bwrap_command(argv: list[str], folder: Path, uid: int, tmp_bytes: int = Limits.tmp_bytes) -> list[str]:
    """bwrap + setpriv around `argv` (whose paths are the sandbox's)."""
    cmd = ["bwrap", *_BWRAP_FLAGS]
    for d in ("/usr", "/etc"):
        cmd += ["--ro-bind", d, d]
    for link in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
        if target is not None:
            cmd += ["--symlink", target, f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            cmd += ["--ro-bind", f"/{link}", f"/{link}"]
    # /tmp first, a tmpfs of its own: the Python dirs bound after it stay visible even where they live under /tmp
    # (a venv in a checkout there). The plan sits read-only beside it.
    cmd += ["--perms", "01777", "--size", str(int(tmp_bytes)), "--tmpfs", "/tmp", "--ro-bind", str(folder), GRADING_DIR]
    binds = [(d, d) for d in _python_dirs()] + [(str(_package_dir()), f"{SANDBOX_LIB}/minirt")]
    made: set[str] = {"/usr", "/etc"}
    for _, dest in binds:
        for parent in _parents(dest):
            if parent not in made:
                made.add(parent)
                cmd += ["--perms", "0755", "--dir", parent]
    for src, dest in binds:
        cmd += ["--ro-bind", src, dest]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp",
            "--", shutil.which("setpriv") or "/usr/bin/setpriv", "--reuid", str(uid), "--regid", str(uid),
            "--clear-groups", "--inh-caps=-all", "--", *argv]
    return cmd


def _unshare_net() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")


class Worker:
    """One sandboxed worker process: `python -m minirt.course.worker PLAN` with the protocol on stdin/stdout."""

    def __init__(self, kind: str, slot: int, limits: Limits, plan: bytes, argv: list[str] | None = None):
        self.kind, self.uid, self.limits = kind, slot_uid(slot), limits
        self.folder = Path(tempfile.mkdtemp(prefix="minirt-grade-sub-"))
        (self.folder / "plan.json").write_bytes(plan)
        if kind in ("bwrap", "user"):
            os.chown(self.folder, self.uid, self.uid)
            os.chown(self.folder / "plan.json", self.uid, self.uid)
        os.chmod(self.folder, 0o711)          # bwrap (root without capabilities) must enter it
        lib = SANDBOX_LIB if kind == "bwrap" else str(_package_dir().parent)
        inside = "/tmp" if kind == "bwrap" else str(self.folder)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": inside, "TMPDIR": inside, "PYTHONPATH": lib,
               "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg", "IPYTHONDIR": f"{inside}/.ipython",
               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
        plan_dir = GRADING_DIR if kind == "bwrap" else inside
        argv = argv or [sys.executable, "-s", "-m", "minirt.course.worker", f"{plan_dir}/plan.json"]
        if kind == "bwrap":
            argv = bwrap_command(argv, self.folder, self.uid, limits.tmp_bytes)
        preexec = self._preexec
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         cwd=str(self.folder), env=env, preexec_fn=preexec, start_new_session=True)
        except BaseException:                 # no worker to clean up later: its folder goes now
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def _preexec(self) -> None:              # in the child, before exec
        if self.kind == "user":
            if os.geteuid() == 0:
                try:
                    _unshare_net()
                except OSError:
                    pass
        self.limits.apply()
        if self.kind == "user":
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)

    def kill(self) -> None:
        """Kill the worker and everything it started: its session, and for `user` every process of its uid."""
        import signal

        for target in (self.proc.pid,):
            try:
                os.killpg(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.kind in ("user", "bwrap"):
            _kill_uid(self.uid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is this slot's (what escaped the session: double forks)."""
    import signal

    for _ in range(3):
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            line = next((ln for ln in status.splitlines() if ln.startswith("Uid:")), "")
            if line.split()[1:2] == [str(uid)]:
                found = True
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not found:
            return
