"""Run model-written Python in a sandbox, as a tool or as a reward. Linux only, needs root.

`run_python(code)` runs `code` as `main.py` in a fresh interpreter and returns a
`SandboxResult`: the exit code, stdout and stderr (each capped), the wall time, and `violation`,
the limit or rule that stopped the code. A violation is read from evidence, never from the
code's output: the signal that killed it, a fork that failed on the process limit, an uncaught
MemoryError, a denied audit event, or the supervisor's own stop (wall clock, output cap). When
there are several, the first one seen is reported.

Layers, outermost first (docs/sandbox.md has the table of what each stops and what none does):

1. A supervisor process (this file run as a script, as root) enters new mount, network, PID
   and IPC namespaces and forks the code's process, which is PID 1 of the new PID namespace:
   when it exits or is killed, the kernel kills every process it started, wherever they moved
   (new session, new process group). The supervisor reports the exit status and CPU time.
2. Network: the new network namespace has only a loopback interface, which is down. No
   address, local or public, is reachable, whatever the code calls.
3. Filesystem: the code runs as a uid of its own (`UID_BASE` + pid * 256 + slot, unique among
   the live sandboxes of the host), not root, with no capabilities and no_new_privs (an exec
   of a setuid binary gains nothing), so permissions stop writes to anything it does not own.
   /tmp, /var/tmp, /dev/shm and /run are covered by empty root-owned tmpfs mounts, private to
   the sandbox, so nothing in them can be read or written; the sandbox's own directory (a
   fresh one under the temp dir, its cwd, HOME and TMPDIR, removed afterwards) is mounted
   back at its path. If the interpreter lives under a directory others cannot enter (e.g.
   /root/.pyenv), that directory is covered too and the interpreter's prefix is mounted back
   read-only. /proc is remounted for the new PID namespace.
4. rlimits, per process: RLIMIT_CPU (SIGKILL at `cpu_s`), RLIMIT_AS (`memory_mb`, virtual
   memory), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0 and RLIMIT_NPROC (`max_processes`,
   counted over the sandbox's uid, so over this sandbox only; threads count).
5. The interpreter runs as `python -I -S -B` (no site-packages, no PYTHON* variables, no
   bytecode writes) with four environment variables: PATH, HOME, TMPDIR, LC_ALL.
6. Audit hooks (PEP 578) deny, in Python code: writes outside the sandbox directory (open in a
   write mode, mkdir, remove, rename, link, symlink, chmod, chown, utime, truncate, rmtree),
   non-Unix sockets and name lookups, subprocess/exec/spawn/system, and all of ctypes. A
   denial raises PermissionError("sandbox: <reason>") and is reported even if the code
   catches it. Audit hooks are not a security boundary: C code (`_posixsubprocess`), calls
   whose event lacks the facts (`os.open` with `dir_fd`), or Python that patches the stdlib
   functions a hook calls get around them. They are there to name the reason; the kernel
   layers above are what hold, and the tests check that they do with the hooks bypassed.
7. The supervisor in the parent: a wall-clock deadline for the whole run, stdout and stderr
   read as they come and capped (the code is stopped when it writes past the cap, so a flood
   costs neither memory nor time), stdin written without blocking. To stop the code it sends
   SIGTERM to the supervisor, which SIGKILLs the code and reaps it; after a second the whole
   process group gets SIGKILL.

Runs of one process wait for a slot, one per CPU the process may use, before they start, so
their wall clock measures their own run rather than a share of oversubscribed cores.

Not enforced: disk space in the sandbox directory (bounded only by the file size limit times
the time the code has), reading world-readable files outside the covered directories (the
repository, /etc, /home), CPU share (the code competes with the host for cores), and kernel
exploits: the sandbox shares the host kernel.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass

logger = logging.getLogger("rollover.rewards")

# --- the API ------------------------------------------------------------------------------------

MAIN = "main.py"  # the code's file in the sandbox directory
MAX_WALL_S = 1e6  # about 11 days: far past any real run, well inside what select() can wait

REASONS = {
    "cpu": "cpu time limit {cpu_s} s",
    "wall": "wall-clock timeout {wall_s:g} s",
    "memory": "memory limit {memory_mb} MB",
    "output": "output capped at {output_kib:g} KiB",
    "file_size": "file size limit {file_size_mb} MB",
    "open_files": "open file limit {open_files}",
    "process": "process limit {max_processes}",
    "network": "network is disabled",
    "write": "write outside the sandbox directory",
    "exec": "subprocess and exec are disabled",
    "ctypes": "ctypes is disabled",
}


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The rlimits apply to every process of the run separately."""

    cpu_s: int = 2  # CPU seconds per process (RLIMIT_CPU); the kernel SIGKILLs at the limit
    wall_s: float = 5.0  # wall-clock seconds for the whole run, interpreter start included
    memory_mb: int = 256  # virtual address space per process (RLIMIT_AS), not resident memory
    file_size_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_processes: int = 8  # processes and threads alive at once, the main one included
    open_files: int = 64  # file descriptors per process (RLIMIT_NOFILE)
    output_bytes: int = 64 * 1024  # cap on each of stdout and stderr; past it the code is stopped

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name == "wall_s":
                # NaN would never time out, and a wait past ~24 days overflows select()'s timeout
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WALL_S:
                    raise ValueError(f"SandboxLimits.wall_s must be a number of seconds in (0, {MAX_WALL_S:g}], "
                                     f"got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SandboxLimits.{name} must be an int, got {value!r}")
            elif value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")

    def reason(self, violation: str) -> str:
        """The text for a violation key: 'cpu' -> 'cpu time limit 2 s'."""
        return REASONS[violation].format(**asdict(self), output_kib=self.output_bytes / 1024)


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None  # negative: killed by that signal; None: stopped by the supervisor
    stdout: str  # at most `output_bytes` bytes, decoded as UTF-8 with replacement
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None  # CPU time of the main process (user + system); None if not known
    violation: str | None  # a key of REASONS: what stopped the code, or what it was denied
    reason: str | None  # the violation as text: "memory limit 256 MB"

    @property
    def ok(self) -> bool:
        """The code exited 0 and broke no limit or rule."""
        return self.exit_code == 0 and self.violation is None


class SandboxError(RuntimeError):
    """The sandbox itself failed (not root, setup refused by the kernel, a run that would not
    stop). Never raised for what the code does: that is a result with a violation."""


def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    files: dict[str, str] | None = None,
) -> SandboxResult:
    """Run `code` in the sandbox; `files` (relative path -> text) are written next to it."""
    if os.geteuid() != 0:
        raise SandboxError(
            "the sandbox needs root: it creates namespaces and runs the code as a uid of its own"
        )
    # A run waits for a core before anything of it starts, so its wall clock measures its own
    # run, not the queue: more runs than cores would share them and time out on correct code.
    with _CORES, _sandbox_uid() as uid, _sandbox_dir(code, files or {}, uid) as root:
        return _run(root, uid, stdin.encode(), limits)


def python_tool(code: str, *, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run `code` in the sandbox and return what a tool message shows the model."""
    return format_result(run_python(code, limits=limits))


def format_result(result: SandboxResult, stderr_tail: int = 2000) -> str:
    """stdout, the tail of stderr, the exit code if not 0, and the sandbox's reason if any."""
    parts = []
    if result.stdout:
        parts.append(result.stdout.rstrip("\n"))
    if result.stdout_truncated:
        parts.append("[stdout truncated]")
    if result.stderr:
        tail = result.stderr[-stderr_tail:]
        cut = "...\n" if len(tail) < len(result.stderr) or result.stderr_truncated else ""
        parts.append(f"[stderr]\n{cut}{tail.rstrip()}")
    if result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    if result.reason is not None:
        parts.append(f"[sandbox: {result.reason}]")
    return "\n".join(parts) or "[no output]"


# --- the parent: uid, directory, supervision ----------------------------------------------------

UID_BASE = 1 << 30  # sandbox uids are UID_BASE + pid * _UID_SLOTS + slot, below 2**31
_UID_SLOTS = 256
_free_slots = collections.deque(range(_UID_SLOTS))  # round robin, so a uid rests between runs

# Runs at once in this process: one per CPU it may use (other processes have their own count).
# The reward runner starts no more `code` calls than this at once (`code_reward`'s
# `_rollover_max_concurrency`), so they queue before their timeout starts, not inside it.
CPU_SLOTS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_CORES = threading.BoundedSemaphore(CPU_SLOTS)  # (not Linux: run_python refuses anyway)
_KILL_AFTER_S = 1.0  # after asking the supervisor to stop, SIGKILL its process group
_GIVE_UP_S = 5.0  # past the deadline by this much, the run is a SandboxError
_REPORT_BYTES = 64 * 1024  # cap on the supervisor's and the code's reports
_SETUP_FAILED = 120  # exit code of a sandbox process whose setup failed


@contextlib.contextmanager
def _sandbox_uid() -> Iterator[int]:
    """A uid no other live sandbox uses: a live pid is unique on the host, a slot in-process.

    Its own uid gives a run its own RLIMIT_NPROC count (which is per uid) and owns nothing
    outside the sandbox directory."""
    try:
        slot = _free_slots.popleft()
    except IndexError:
        raise SandboxError(f"more than {_UID_SLOTS} sandboxes at once in one process") from None
    try:
        yield UID_BASE + os.getpid() * _UID_SLOTS + slot
    finally:
        _free_slots.append(slot)


@contextlib.contextmanager
def _sandbox_dir(code: str, files: dict[str, str], uid: int) -> Iterator[str]:
    """A fresh directory holding main.py and `files`, owned by `uid`, removed afterwards."""
    for name in files:
        if os.path.isabs(name) or os.path.normpath(name) != name or name.startswith(".."):
            raise ValueError(f"sandbox file names must be plain relative paths, got {name!r}")
        if name == MAIN:
            raise ValueError(f"{MAIN!r} is the code's own file")
    root = os.path.realpath(tempfile.mkdtemp(prefix="rollover-sandbox-"))
    try:
        for name, text in {**files, MAIN: code}.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        for dirpath, _, filenames in os.walk(root):
            for path in [dirpath, *(os.path.join(dirpath, name) for name in filenames)]:
                os.chown(path, uid, uid)
        yield root
    finally:
        _remove(root)


def _remove(root: str) -> None:
    """Remove the sandbox directory, and never raise: the code decides its shape. shutil.rmtree
    recurses once per level (RecursionError on a chain of a few thousand directories, which
    renames build in no time); `rm -rf` walks it without recursing. What even that cannot remove
    is logged, since the run's result is still good."""
    try:
        shutil.rmtree(root)
        return
    except (OSError, RecursionError):
        pass
    rm = subprocess.run(["rm", "-rf", "--", root], capture_output=True, text=True)
    if rm.returncode != 0 or os.path.lexists(root):
        logger.warning("could not remove the sandbox directory %s: %s", root, rm.stderr.strip()[-500:])


def _run(root: str, uid: int, stdin: bytes, limits: SandboxLimits) -> SandboxResult:
    events_r, events_w = os.pipe()  # the code's processes -> parent: violation keys
    status_r, status_w = os.pipe()  # supervisor -> parent: setup error, exit status
    config = {
        "root": root,
        "uid": uid,
        "parent_pid": os.getpid(),
        "events_fd": events_w,
        "status_fd": status_w,
        "limits": asdict(limits),
    }
    env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LC_ALL": "C.UTF-8"}
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=root,
                env=env,
                start_new_session=True,
                pass_fds=(events_w, status_w),
            )
        finally:
            os.close(events_w)
            os.close(status_w)
        with proc:
            run = _Supervision(proc, events_r, status_r, stdin, limits, start)
            run.wait()
    finally:
        os.close(events_r)
        os.close(status_r)
    wall_s = time.monotonic() - start

    status = {}
    for line in run.status.data.decode(errors="replace").splitlines():
        status.update(json.loads(line))
    if "setup_error" in status:
        raise SandboxError(f"sandbox setup failed: {status['setup_error']}")
    if "exit_code" not in status and not run.stopped:  # stopped: may have been SIGKILLed
        stderr = run.stderr.data.decode(errors="replace")
        raise SandboxError(
            f"the sandbox supervisor exited {proc.returncode} without a status:\n{stderr}"
        )
    evidence = list(run.evidence)
    exit_code = None if run.stopped else status["exit_code"]
    cpu_s = status.get("cpu_s")
    # The code is its namespace's PID 1, for which the kernel drops SIGXCPU: the CPU limit
    # shows as a SIGKILL nobody here sent, from a process that used its CPU time.
    if exit_code == -signal.SIGKILL and cpu_s >= 0.95 * limits.cpu_s:
        evidence.append("cpu")
    violation = evidence[0] if evidence else None
    return SandboxResult(
        exit_code=exit_code,
        stdout=run.stdout.data.decode(errors="replace"),
        stderr=run.stderr.data.decode(errors="replace"),
        stdout_truncated=run.stdout.truncated,
        stderr_truncated=run.stderr.truncated,
        wall_s=wall_s,
        cpu_s=cpu_s,
        violation=violation,
        reason=None if violation is None else limits.reason(violation),
    )


class _Capped:
    """Bytes read from a pipe, kept up to `cap`."""

    def __init__(self, cap: int):
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> bytes:
        """Keep what fits; return what was kept."""
        kept = chunk[: self.cap - len(self.data)]
        self.data += kept
        self.truncated = self.truncated or len(kept) < len(chunk)
        return kept


class _Supervision:
    """One run seen from the parent: feed stdin, read the pipes, enforce wall time and output."""

    def __init__(self, proc, events_r, status_r, stdin: bytes, limits: SandboxLimits, start):
        self.proc = proc
        self.stdout = _Capped(limits.output_bytes)
        self.stderr = _Capped(limits.output_bytes)
        self.status = _Capped(_REPORT_BYTES)
        self.events = _Capped(_REPORT_BYTES)
        self.evidence: list[str] = []  # violation keys in the order they were seen
        self.stopped: str | None = None  # "wall" or "output" once the parent stopped the code
        self.stop_time = 0.0
        self.killed = False
        self.deadline = start + limits.wall_s
        self.stdin = stdin
        self.stdin_pos = 0
        self.sinks = {
            proc.stdout.fileno(): self.stdout,
            proc.stderr.fileno(): self.stderr,
            events_r: self.events,
            status_r: self.status,
        }

    def wait(self) -> None:
        """Return once the supervisor has exited and every pipe is closed."""
        selector = selectors.DefaultSelector()
        pidfd = os.pidfd_open(self.proc.pid)
        try:
            self._loop(selector, pidfd)
        finally:
            selector.close()
            os.close(pidfd)
            if self.proc.poll() is None:  # leaving on an exception: leave nothing running
                self._kill()
                self.proc.wait()

    def _loop(self, selector, pidfd: int) -> None:
        for fd in self.sinks:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(pidfd, selectors.EVENT_READ)
        stdin_fd = self.proc.stdin.fileno()
        if self.stdin:
            os.set_blocking(stdin_fd, False)
            selector.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            self.proc.stdin.close()
        exited = False
        while self.sinks or not exited:
            # Timers act on the supervisor only while it is unreaped, so its pid (and process
            # group id) cannot belong to anyone else.
            now = time.monotonic()
            wake = [self.deadline + _GIVE_UP_S]
            if not exited and self.stopped is None:
                if now >= self.deadline:
                    self._stop("wall")
                else:
                    wake.append(self.deadline)
            if not exited and self.stopped and not self.killed:
                if now >= self.stop_time + _KILL_AFTER_S:
                    self._kill()
                else:
                    wake.append(self.stop_time + _KILL_AFTER_S)
            if now >= self.deadline + _GIVE_UP_S:
                raise SandboxError(f"the sandbox did not stop {_GIVE_UP_S} s after its deadline")
            for key, _ in selector.select(max(0.0, min(wake) - now)):
                if key.fd == pidfd:
                    selector.unregister(pidfd)
                    self.proc.wait()
                    exited = True
                elif key.fd == stdin_fd:
                    if self._feed_stdin(stdin_fd):
                        selector.unregister(stdin_fd)
                        self.proc.stdin.close()
                else:
                    self._read(selector, key.fd)

    def _feed_stdin(self, fd: int) -> bool:
        """Write what the pipe takes; True once all is written or the code closed stdin."""
        try:
            self.stdin_pos += os.write(fd, self.stdin[self.stdin_pos : self.stdin_pos + 65536])
        except BrokenPipeError:
            return True
        return self.stdin_pos == len(self.stdin)

    def _read(self, selector, fd: int) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            selector.unregister(fd)
            del self.sinks[fd]
            return
        sink = self.sinks[fd]
        kept = sink.add(chunk)
        if sink is self.events:
            self.evidence += [k for k in kept.decode(errors="replace").split() if k in REASONS]
        if sink.truncated and sink in (self.stdout, self.stderr) and self.stopped is None:
            self._stop("output")

    def _stop(self, why: str) -> None:
        """Ask the supervisor to SIGKILL the code (it then reaps it and exits)."""
        self.stopped = why
        self.stop_time = time.monotonic()
        self.evidence.append(why)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)

    def _kill(self) -> None:
        """SIGKILL the supervisor and the code, in case either left the process group; the
        code gets SIGKILL from the kernel when the supervisor dies (PR_SET_PDEATHSIG)."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


# --- the child: runs as `python -I -S -B sandbox.py CONFIG`, as root until it drops to the uid --

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
# World-writable on most hosts; /run also holds sockets (D-Bus) and secrets (/run/secrets).
_COVERED = ("/tmp", "/var/tmp", "/dev/shm", "/run")

_child_pid = 0  # the code's process, once forked; the SIGTERM handler kills it


def _supervisor_main(config: dict) -> None:
    """Enter the namespaces, fork the code's process, wait, report its status."""
    global _child_pid
    signal.signal(signal.SIGTERM, _on_stop)
    libc = ctypes.CDLL(None, use_errno=True)
    status_fd = config["status_fd"]
    try:
        # The signal fires when the parent *thread* exits; run_python blocks that thread until
        # the run is over, so in practice it fires only if the parent process dies.
        _set_parent_death_signal(libc)
        if os.getppid() != config["parent_pid"]:
            os._exit(_SETUP_FAILED)  # the parent died before we could follow it
        namespaces = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC
        _call(libc.unshare(namespaces), "unshare")
        _private_mounts(libc, config["root"])
    except OSError as e:
        _send(status_fd, {"setup_error": str(e)})
        os._exit(_SETUP_FAILED)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no stop between fork and pid
    pid = os.fork()
    if pid == 0:
        _code_main(libc, config)
        sys.exit(0)
    _child_pid = pid
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _, wait_status, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    _send(status_fd, {"exit_code": os.waitstatus_to_exitcode(wait_status), "cpu_s": cpu_s})


def _on_stop(signum, frame) -> None:
    if _child_pid:
        os.kill(_child_pid, signal.SIGKILL)  # not reaped yet: wait4 is where we are
    else:
        os._exit(_SETUP_FAILED)


def _code_main(libc, config: dict) -> None:
    """In the forked process (PID 1 of the new namespace): limits, drop to the uid, run."""
    root, uid, status_fd = config["root"], config["uid"], config["status_fd"]
    try:
        _set_parent_death_signal(libc)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _call(libc.mount(b"proc", b"/proc", b"proc", flags, None), "mount /proc")
        os.chdir(root)  # the bind mount, not the directory it covers
        _set_rlimits(SandboxLimits(**config["limits"]))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        _set_parent_death_signal(libc)  # setuid clears it
        # exec (if the code gets past the audit hook) never gains privileges: setuid-root
        # binaries and file capabilities are ignored.
        _call(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.umask(0o077)
    except OSError as e:
        _send(status_fd, {"setup_error": str(e)})
        os._exit(_SETUP_FAILED)
    os.close(status_fd)
    report = _reporter(config["events_fd"])
    _guard_fork(report)
    _deny_memfd(report)
    sys.addaudithook(_audit_hook(root, report))
    sys.path.insert(0, root)
    _run_code(report)


def _private_mounts(libc, root: str) -> None:
    """Make every mount private to the new namespace, then cover the world-writable
    directories and any unreadable ancestor of the interpreter with empty tmpfs mounts,
    mounting back the sandbox directory (read-write) and the interpreter (read-only)."""
    _call(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    prefix = os.path.realpath(sys.base_prefix)
    keep = {root: False, prefix: True}  # path -> read-only
    covered = [p for p in _COVERED if os.path.isdir(p) and not os.path.islink(p)]
    closed = _closed_ancestor(prefix)
    for top in covered + ([closed] if closed else []):
        _cover(libc, top, {p: ro for p, ro in keep.items() if p.startswith(top + "/")})


def _closed_ancestor(path: str) -> str | None:
    """The outermost directory above `path` that others may not enter, if any."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def _cover(libc, top: str, keep: dict[str, bool]) -> None:
    fds = {path: os.open(path, os.O_PATH) for path in keep}  # reachable once `top` is covered
    options = b"mode=0755,size=64k"
    flags = _MS_NOSUID | _MS_NODEV
    _call(libc.mount(b"tmpfs", top.encode(), b"tmpfs", flags, options), f"cover {top}")
    for path, read_only in keep.items():
        os.makedirs(path, exist_ok=True)
        source = f"/proc/self/fd/{fds[path]}".encode()
        _call(libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None), f"mount {path}")
        if read_only:  # MS_BIND with MS_REMOUNT changes this mount's flags, not the filesystem's
            flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
            _call(libc.mount(None, path.encode(), None, flags, None), f"read-only {path}")
        os.close(fds[path])


def _set_rlimits(limits: SandboxLimits) -> None:
    mb = 1 << 20
    for which, value in [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * mb),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_NPROC, limits.max_processes),
    ]:
        resource.setrlimit(which, (value, value))


def _set_parent_death_signal(libc) -> None:
    _call(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _send(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _reporter(events_fd: int):
    def report(violation: str) -> None:
        os.write(events_fd, f"{violation}\n".encode())

    return report


def _guard_fork(report) -> None:
    """Report a fork refused by RLIMIT_NPROC (EAGAIN) before the code sees the error."""
    fork = os.fork

    def guarded_fork():
        try:
            return fork()
        except BlockingIOError:
            report("process")
            raise

    os.fork = guarded_fork


def _deny_memfd(report) -> None:
    """Refuse `memfd_create`: its pages are shared memory, which the address-space limit does not
    count, so files of them (each under file_size_mb, as many as open_files) would pass memory_mb."""
    import posix

    def memfd_create(*args, **kwargs):
        report("memory")
        raise PermissionError("sandbox: memfd_create is disabled (its memory would pass the memory limit)")

    for module in (os, posix):
        if hasattr(module, "memfd_create"):
            module.memfd_create = memfd_create


_ALWAYS_DENIED = {
    "os.exec": "exec",
    "os.posix_spawn": "exec",
    "os.spawn": "exec",
    "os.system": "exec",
    "subprocess.Popen": "exec",
    "pty.spawn": "exec",
    "socket.getaddrinfo": "network",
    "socket.gethostbyname": "network",
    "socket.gethostbyaddr": "network",
    "socket.getnameinfo": "network",
}
# event -> (path argument, its dir_fd argument or None) for each path the event writes
_WRITE_EVENTS = {
    "os.mkdir": ((0, 2),),
    "os.rmdir": ((0, 1),),
    "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_DEVICES = {"/dev/null", "/dev/stdout", "/dev/stderr"}
_AF_UNIX = 1  # socket.AF_UNIX, without importing socket into every run


def _audit_hook(root: str, report):
    # Bound now, so code that rebinds os.path.realpath & co. does not change the hook (code that
    # patches what they call inside posixpath still can: see the module docstring).
    realpath, join, getcwd, readlink, fsdecode = (
        os.path.realpath, os.path.join, os.getcwd, os.readlink, os.fsdecode
    )

    def inside(path, dir_fd) -> bool:
        if isinstance(path, int):  # an open file descriptor
            return True
        path = fsdecode(path)
        if path in _WRITABLE_DEVICES:
            return True
        relative_to_fd = dir_fd is not None and dir_fd >= 0
        base = readlink(f"/proc/self/fd/{dir_fd}") if relative_to_fd else getcwd()
        real = realpath(join(base, path))
        return real == root or real.startswith(root + "/")

    def deny(violation: str):
        report(violation)
        raise PermissionError(f"sandbox: {REASONS[violation]}")

    def hook(event: str, args: tuple) -> None:
        if event in _ALWAYS_DENIED:
            deny(_ALWAYS_DENIED[event])
        elif event.startswith("ctypes."):
            deny("ctypes")
        elif event == "open":
            path, _, flags = args
            if flags & _WRITE_FLAGS and not inside(path, None):
                deny("write")
        elif event in _WRITE_EVENTS:
            for path_arg, dir_fd_arg in _WRITE_EVENTS[event]:
                dir_fd = None if dir_fd_arg is None else args[dir_fd_arg]
                if not inside(args[path_arg], dir_fd):
                    deny("write")
        elif event == "socket.__new__" and args[1] != _AF_UNIX:
            deny("network")

    return hook


def _run_code(report) -> None:
    """Run main.py as __main__; an uncaught exception that is a limit is reported."""
    main = type(sys)("__main__")
    main.__file__ = MAIN
    sys.modules["__main__"] = main
    sys.argv = [MAIN]
    try:
        with open(MAIN, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, MAIN, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        code = getattr(e, "errno", None)
        if isinstance(e, MemoryError):
            report("memory")
        elif code == errno.EFBIG:
            report("file_size")
        elif code == errno.EMFILE:
            report("open_files")
        shown = traceback.TracebackException(type(e), e, e.__traceback__)
        shown.stack = traceback.StackSummary.from_list(  # without this file's frames
            [frame for frame in shown.stack if frame.filename != __file__]
        )
        sys.stderr.write("".join(shown.format()))
        sys.exit(1)


if __name__ == "__main__":
    _supervisor_main(json.loads(sys.argv[1]))
