"""The sandbox: code runs, and every escape the issue lists fails with the right reason.

Each test also checks, through an autouse fixture, that nothing outlives the run: no process
of a sandbox uid, no new child of this process, no sandbox directory. Limits are small (1 s, a
few processes) so no test can load the machine."""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time

import pytest

from rollover.rewards import RewardRunner, build_rewards, sandbox
from rollover.rewards.code import code_reward, extract_code
from rollover.rewards.sandbox import (
    UID_BASE,
    SandboxLimits,
    format_result,
    python_tool,
    run_python,
)
from rollover.types import Prompt

needs_root = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0, reason="the sandbox needs root on Linux"
)
FAST = SandboxLimits(cpu_s=1, wall_s=3.0, max_processes=8, output_bytes=8192)


def sandbox_processes() -> list[int]:
    """Pids of live processes whose uid is a sandbox uid."""
    pids = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited while we looked
        if UID_BASE <= uid < 2 * UID_BASE:
            pids.append(int(status.split("/")[2]))
    return pids


def children() -> list[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return [int(pid) for pid in f.read().split()]


@pytest.fixture(autouse=True)
def nothing_left_behind():
    dirs_before = set(glob.glob("/tmp/rollover-sandbox-*"))
    children_before = set(children())  # earlier tests of the session may own live children
    yield
    if os.geteuid() == 0:
        assert sandbox_processes() == []
        assert set(children()) <= children_before
    assert set(glob.glob("/tmp/rollover-sandbox-*")) <= dirs_before


# --- code that behaves ---------------------------------------------------------------------------


@needs_root
def test_runs_code_and_captures_stdout():
    result = run_python("print(6 * 7)", limits=FAST)
    assert result.ok and result.exit_code == 0 and result.violation is None, result
    assert result.stdout == "42\n" and result.stderr == ""
    assert 0 < result.wall_s < FAST.wall_s and 0 < result.cpu_s < FAST.cpu_s


@needs_root
def test_stdin_files_and_imports():
    code = (
        "import sys, helper\n"
        "print(sys.stdin.read().upper(), open('data/in.txt').read(), helper.X)"
    )
    files = {"data/in.txt": "from a file", "helper.py": "X = 'imported'"}
    result = run_python(code, stdin="from stdin", files=files, limits=FAST)
    assert result.ok, result.stderr
    assert result.stdout == "FROM STDIN from a file imported\n"


@needs_root
def test_unread_stdin_does_not_block():
    result = run_python("print('done')", stdin="x" * 5_000_000, limits=FAST)
    assert result.ok and result.stdout == "done\n"


@needs_root
@pytest.mark.parametrize(
    "code, exit_code, stderr_end",
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("raise ValueError('boom')", 1, "ValueError: boom\n"),
        ("def f(:\n    pass", 1, "SyntaxError: invalid syntax\n"),
    ],
)
def test_failures_are_exit_codes_not_violations(code, exit_code, stderr_end):
    result = run_python(code, limits=FAST)
    assert result.exit_code == exit_code and result.violation is None and not result.ok
    assert result.stderr.endswith(stderr_end)
    assert "sandbox.py" not in result.stderr  # the sandbox's own frames are not shown


@needs_root
def test_kernel_layers_seen_from_inside():
    code = """
import json, os
PATHS = [".", "/tmp", "/etc", "/var/tmp", "/dev/shm", "/run"]
print(json.dumps({
    "uid": os.getuid(),
    "pid": os.getpid(),
    "interfaces": [line.split(":")[0].strip() for line in list(open("/proc/self/net/dev"))[2:]],
    "processes": [p for p in os.listdir("/proc") if p.isdigit()],
    "tmp": os.listdir("/tmp"),
    "cwd_is_sandbox": os.listdir("/tmp") == [os.path.basename(os.getcwd())],
    "writable": {p: os.access(p, os.W_OK) for p in PATHS},
}))
"""
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    seen = json.loads(result.stdout)
    assert seen["uid"] >= UID_BASE  # not root
    assert seen["pid"] == 1  # its own PID namespace
    assert seen["processes"] == ["1"]  # /proc shows only the sandbox
    assert seen["interfaces"] == ["lo"]  # its own network namespace
    assert seen["cwd_is_sandbox"]  # /tmp is covered; only the sandbox directory is back
    writable = {p: p == "." for p in [".", "/tmp", "/etc", "/var/tmp", "/dev/shm", "/run"]}
    assert seen["writable"] == writable  # only its own directory


@needs_root
@pytest.mark.parametrize("directory", ["/tmp", "/etc"])
def test_a_write_the_audit_hook_misses_is_refused_by_the_kernel(directory):
    # The "open" audit event does not carry dir_fd, so the hook resolves "x" against the cwd
    # and lets it through; permissions (and the tmpfs over /tmp) refuse it.
    name = f"rollover-escape-{secrets.token_hex(4)}"
    code = (
        f"import os\nfd = os.open({directory!r}, os.O_RDONLY)\n"
        f"os.open({name!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd)"
    )
    result = run_python(code, limits=FAST)
    assert result.violation is None
    assert "PermissionError: [Errno 13] Permission denied" in result.stderr
    assert not os.path.exists(os.path.join(directory, name))


@needs_root
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="fork_exec's 3.11 signature")
def test_an_exec_the_audit_hook_misses_gains_nothing():
    # _posixsubprocess raises no audit event: the shell runs, but as the sandbox uid, without
    # privileges to gain (no_new_privs), in an empty network namespace, unable to write.
    script = (
        "id -u; grep NoNewPrivs /proc/self/status; touch /tmp/x /etc/x /root/x 2>&1; "
        "(exec 3<>/dev/tcp/1.1.1.1/80) 2>&1"
    )
    code = f"""
import _posixsubprocess, os
r, w = os.pipe()
pid = _posixsubprocess.fork_exec(
    [b"/bin/bash", b"-c", {script.encode()!r}], [b"/bin/bash"], True, (), None, None,
    -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, -1, -1, None, False)
os.waitpid(pid, 0)
"""
    result = run_python(code, limits=FAST)
    assert result.ok, result.stderr
    uid, no_new_privs, *refused = result.stdout.splitlines()
    assert int(uid) >= UID_BASE and no_new_privs.split() == ["NoNewPrivs:", "1"]
    assert refused == [
        "touch: cannot touch '/tmp/x': Permission denied",
        "touch: cannot touch '/etc/x': Permission denied",
        "touch: cannot touch '/root/x': Permission denied",
        "/bin/bash: connect: Network is unreachable",
        "/bin/bash: line 1: /dev/tcp/1.1.1.1/80: Network is unreachable",
    ]


@needs_root
def test_directory_is_removed_afterwards():
    result = run_python("import os; print(os.getcwd())", limits=FAST)
    assert result.ok and result.stdout.startswith("/tmp/rollover-sandbox-")
    assert not os.path.exists(result.stdout.strip())


@needs_root
def test_a_directory_chain_too_deep_for_rmtree_is_still_removed():
    # renames build 3000 levels in no time; shutil.rmtree recurses per level (RecursionError)
    code = (
        "import os\nos.mkdir('n')\n"
        "for i in range(3000):\n    os.mkdir('p'); os.rename('n', 'p/n'); os.rename('p', 'n')\n"
        "print('built')"
    )
    result = run_python(code, limits=SandboxLimits(wall_s=10.0))
    assert result.ok and result.stdout == "built\n", result  # a result, and (fixture) no directory left


def test_a_directory_nothing_can_remove_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    def rmtree(path):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(sandbox.shutil, "rmtree", rmtree)
    monkeypatch.setattr(sandbox.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "rm: cannot remove 'x': Device or resource busy"))
    sandbox._remove(str(tmp_path))  # does not raise: the run's result is still good
    assert f"could not remove the sandbox directory {tmp_path}: rm: cannot remove" in caplog.text


@needs_root
def test_runs_wait_for_a_core_so_the_wall_clock_times_their_own_run():
    # 4 programs per core, 0.4 CPU-s each: sharing the cores, each would take ~1.6 s of wall time
    cores = len(os.sched_getaffinity(0))
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\nprint('done')"
    results = [None] * (4 * cores)

    def run(i):
        results[i] = run_python(busy, limits=SandboxLimits(wall_s=1.5))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.violation for r in results] == [None] * len(results)
    assert all(r.ok and r.wall_s < 1.5 for r in results), [r.wall_s for r in results]


def test_runs_at_once_are_at_most_the_cpus(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    lock, running, most = threading.Lock(), [0], [0]

    def fake_run(root, uid, stdin, limits):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    monkeypatch.setattr(sandbox, "_run", fake_run)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox.os, "chown", lambda *a: None)
    threads = [threading.Thread(target=run_python, args=("pass",)) for _ in range(3 * cores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == cores


# --- escapes -------------------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize(
    "code",
    [
        "open('/tmp/{name}', 'w').write('x')",
        "open('../{name}', 'w').write('x')",
        "import os; os.symlink('/tmp', 'link'); open('link/{name}', 'w')",
        "import os; open('mine', 'w').close(); os.rename('mine', '/tmp/{name}')",
        "import os; os.mkdir('/tmp/{name}')",
        "import os; os.open('/tmp/{name}', os.O_WRONLY | os.O_CREAT)",
    ],
)
def test_write_outside_the_directory_is_denied(code):
    name = f"rollover-escape-{secrets.token_hex(4)}"
    result = run_python(code.format(name=name), limits=FAST)
    assert result.violation == "write" and result.reason == "write outside the sandbox directory"
    assert "PermissionError: sandbox: write outside the sandbox directory" in result.stderr
    assert not os.path.exists(f"/tmp/{name}")


@needs_root
@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
        "import socket; s = socket.socket(); s.connect(('1.1.1.1', 80))",
        "import socket; socket.getaddrinfo('example.com', 443)",
        "import urllib.request; urllib.request.urlopen('http://1.1.1.1', timeout=1)",
    ],
)
def test_network_is_disabled(code):
    result = run_python(code, limits=FAST)
    assert result.violation == "network" and result.reason == "network is disabled"


@needs_root
def test_a_caught_denial_is_still_reported():
    code = "import socket\ntry:\n    socket.socket()\nexcept PermissionError:\n    print('offline')"
    result = run_python(code, limits=FAST)
    assert result.exit_code == 0 and result.stdout == "offline\n"
    assert result.violation == "network" and not result.ok


@needs_root
@pytest.mark.parametrize(
    "code",
    [
        "import subprocess; subprocess.run(['/bin/sh', '-c', 'echo hi'])",
        "import os; os.system('echo hi')",
        "import os; os.execv('/bin/sh', ['sh', '-c', 'echo hi'])",
    ],
)
def test_subprocess_and_exec_are_denied(code):
    result = run_python(code, limits=FAST)
    assert result.violation == "exec" and "hi" not in result.stdout


@needs_root
def test_ctypes_is_denied():
    result = run_python("import ctypes; ctypes.CDLL(None).getpid()", limits=FAST)
    assert result.violation == "ctypes"


@needs_root
def test_fork_bomb_is_held_at_the_process_limit():
    limits = SandboxLimits(cpu_s=1, wall_s=1.0, max_processes=8)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    peak, done = [0], threading.Event()

    def watch():  # the most sandbox processes alive at once, sampled from outside
        while not done.is_set():
            peak[0] = max(peak[0], len(sandbox_processes()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        result = run_python(bomb, limits=limits)
    finally:
        done.set()
        watcher.join()
    assert result.violation == "process" and result.reason == "process limit 8", result
    assert 1 <= peak[0] <= 8
    assert time.monotonic() - start < limits.wall_s + 2
    assert sandbox_processes() == []


@needs_root
def test_processes_that_leave_the_session_are_killed_with_the_run():
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "print('main exits')"
    )
    result = run_python(code, limits=FAST)
    assert result.ok and result.stdout == "main exits\n", result  # before the wall clock
    assert sandbox_processes() == []


@needs_root
@pytest.mark.parametrize(
    "code", ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**6))"]
)
def test_memory_hog_hits_the_memory_limit(code):
    result = run_python(code, limits=SandboxLimits(memory_mb=128, cpu_s=2, wall_s=5.0))
    assert result.violation == "memory" and result.reason == "memory limit 128 MB"
    assert result.stderr.endswith("MemoryError\n")


@needs_root
@pytest.mark.parametrize("module", ["os", "posix"])
def test_memory_in_memfd_files_which_the_address_space_limit_does_not_count_is_refused(module):
    code = (f"import {module}\nfd = {module}.memfd_create('x')\n"
            "for _ in range(64):\n    os.write(fd, bytes(10**6))\nprint('wrote')")
    result = run_python("import os\n" + code, limits=SandboxLimits(memory_mb=128, cpu_s=2, wall_s=5.0))
    assert result.violation == "memory" and "wrote" not in result.stdout, result
    assert "PermissionError: sandbox: memfd_create is disabled" in result.stderr


@needs_root
def test_infinite_loop_hits_the_cpu_limit():
    result = run_python("while True:\n    pass", limits=SandboxLimits(cpu_s=1, wall_s=10.0))
    assert result.violation == "cpu" and result.reason == "cpu time limit 1 s", result
    assert result.exit_code == -9 and result.cpu_s >= 0.95, result


@needs_root
def test_sleep_hits_the_wall_clock_timeout():
    result = run_python("import time\ntime.sleep(100)", limits=SandboxLimits(wall_s=1.0))
    assert result.violation == "wall" and result.reason == "wall-clock timeout 1 s", result
    assert result.exit_code is None
    assert 1.0 <= result.wall_s < 3, result


@needs_root
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_capped_and_stopped(stream):
    code = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000)"
    result = run_python(code, limits=FAST)
    assert result.violation == "output" and result.reason == "output capped at 8 KiB", result
    assert len(getattr(result, stream)) == 8192 and getattr(result, f"{stream}_truncated")
    assert result.exit_code is None


@needs_root
def test_file_size_and_open_file_limits():
    big = run_python("open('big', 'wb').write(b'x' * 2**21)", limits=SandboxLimits(file_size_mb=1))
    assert big.violation == "file_size" and "File too large" in big.stderr
    code = "fs = [open(str(i), 'w') for i in range(100)]"
    many = run_python(code, limits=SandboxLimits(open_files=32))
    assert many.violation == "open_files" and "Too many open files" in many.stderr


@needs_root
def test_concurrent_runs_have_their_own_process_limits():
    code = (
        "import os\n"
        "pids = [os.fork() or os._exit(0) for _ in range(3)]\n"
        "for p in pids: os.waitpid(p, 0)\n"
        "print('ok')"
    )
    limits = SandboxLimits(max_processes=4, wall_s=5.0)
    results = [None] * 4

    def run(i):
        results[i] = run_python(code, limits=limits)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok and r.stdout == "ok\n" for r in results), [r.stderr for r in results]


# --- the API around it ---------------------------------------------------------------------------


def test_limits_are_validated():
    with pytest.raises(ValueError, match="cpu_s"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(TypeError, match="memory_mb"):
        SandboxLimits(memory_mb=1.5)
    # NaN would never time out; inf and past ~24 days overflow select()'s timeout
    for wall_s in (float("nan"), float("inf"), 2e6, "5", True):
        with pytest.raises(ValueError, match=r"wall_s must be a number of seconds in \(0, 1e\+06\]"):
            SandboxLimits(wall_s=wall_s)
    assert SandboxLimits().reason("output") == "output capped at 64 KiB"


@needs_root
@pytest.mark.parametrize("name", ["/etc/x", "../x", "a/../../x", "main.py"])
def test_file_names_must_stay_inside(name):
    with pytest.raises(ValueError):
        run_python("pass", files={name: ""})


@needs_root
def test_python_tool_shows_output_exit_code_and_reason():
    text = python_tool("print('partial')\nimport os\nos.system('ls')", limits=FAST)
    assert text.startswith("partial\n[stderr]\nTraceback")
    assert text.endswith("[exit code 1]\n[sandbox: subprocess and exec are disabled]")
    assert python_tool("pass", limits=FAST) == "[no output]"
    assert format_result(run_python("print('hi')", limits=FAST)) == "hi"


# --- the code reward -----------------------------------------------------------------------------

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"


def fenced(code: str) -> str:
    return f"Let me write it.\n```python\n{code}\n```\nDone."


def test_extract_code_takes_the_last_closed_python_block():
    text = "```python\nfirst\n```\n```py\nsecond\n```\n```\nplain\n```\n```python\nunclosed"
    assert extract_code(text) == "second\n"
    assert extract_code("no code here") is None


@needs_root
@pytest.mark.parametrize(
    "completion, score",
    [
        (fenced("def add(a, b):\n    return a + b"), 1.0),
        (fenced("def add(a, b):\n    return a - b"), 0.0),
        # right, but exits before the tests run: exiting early is not passing
        (fenced("def add(a, b):\n    return a + b\nimport sys\nsys.exit(0)"), 0.0),
        (fenced("import os\nos._exit(0)"), 0.0),
        ("def add(a, b): return a + b", 0.0),  # not fenced
    ],
)
def test_code_reward(completion, score):
    result = code_reward(completion, ADD_TESTS, limits=FAST)
    assert set(result) == {"score", "no_code", "violation", "timeout"}
    assert result["score"] == score


@needs_root
def test_code_reward_counts_a_violation_as_zero_not_an_error():
    limits = {"cpu_s": 1, "wall_s": 3.0}  # a dict, as from config
    result = code_reward(fenced("while True:\n    pass"), ADD_TESTS, limits=limits)
    assert result == {"score": 0.0, "no_code": 0.0, "violation": 1.0, "timeout": 1.0}
    assert code_reward("no code", ADD_TESTS)["no_code"] == 1.0


@needs_root
@pytest.mark.parametrize("tests", [ADD_TESTS.splitlines(), tuple(ADD_TESTS.splitlines())])
def test_code_reward_runs_a_list_of_tests_one_after_another(tests):
    # MBPP's test_list: formatted as text, a list is an expression statement that always passes
    assert code_reward(fenced("def add(a, b):\n    return a - b"), tests, limits=FAST)["score"] == 0.0
    assert code_reward(fenced("def add(a, b):\n    return a + b"), tests, limits=FAST)["score"] == 1.0


@pytest.mark.parametrize("answer, error, message", [
    ("  \n", ValueError, "code: the answer (the tests) is empty"),
    ([], ValueError, "code: the answer is an empty list of tests"),
    (["assert True", " "], ValueError, "code: test 1 of the answer is empty"),
    (["assert True", 3], TypeError, "code: test 1 of the answer is not a string of test code but int"),
    ({"tests": "assert True"}, TypeError, "code: the answer must be test code (a string) or a list of test snippets, got dict"),
    ('["assert add(2, 3) == 5"]', ValueError, "code: nothing in the answer (the tests) can fail"),  # JSON text (verl's)
    ('{"inputs": ["1"], "outputs": ["2"]}', ValueError, "code: nothing in the answer (the tests) can fail"),
    ("def check(candidate):\n    assert candidate(2, 3) == 5\n", ValueError, "HumanEval's check(candidate) must be called"),
    ("# to do\npass\nimport math", ValueError, "code: nothing in the answer (the tests) can fail"),
    (["import math"], ValueError, "code: nothing in the answer's tests can fail"),
    ("    assert add(2, 3) == 5", ValueError, "code: the answer (the tests) does not parse on its own (IndentationError"),
    (["assert True", "    assert add(2, 3) == 5"], ValueError, "code: test 1 of the answer does not parse on its own"),
])
def test_code_reward_refuses_tests_that_cannot_fail(answer, error, message):
    with pytest.raises(error, match=re.escape(message)):
        code_reward(fenced("pass"), answer, limits=FAST)


@needs_root
def test_code_reward_passes_a_program_whose_last_line_is_unfinished():
    completion = fenced("def add(a, b):\n    return a + b\nprint('ready', end='')")
    assert code_reward(completion, ADD_TESTS, limits=FAST)["score"] == 1.0


def test_code_reward_limits_are_checked_when_the_reward_is_built():
    with pytest.raises(ValueError, match=r"reward 'code' \(code\): limits has no 'cpu'; the limits are cpu_s, wall_s"):
        build_rewards([{"fn": "code", "kwargs": {"limits": {"cpu": 3}}}])
    with pytest.raises(ValueError, match=r"unknown kwargs \['limit'\] \(known: limits\)"):
        build_rewards([{"fn": "code", "kwargs": {"limit": {"cpu_s": 3}}}])
    with pytest.raises(ValueError, match="SandboxLimits.cpu_s must be > 0"):
        build_rewards([{"fn": "code", "kwargs": {"limits": {"cpu_s": 0}}}])
    [reward] = build_rewards([{"fn": "code", "kwargs": {"limits": {"cpu_s": 3}}}])
    assert reward.fn.keywords["limits"] == SandboxLimits(cpu_s=3)


def test_runner_refuses_a_timeout_the_sandbox_wall_clock_does_not_end_before():
    # wall_s 5 (the default) + 1 s to start: a correct program of 4.5 s would be a reward timeout at 6 s
    with pytest.raises(ValueError, match=r"reward 'code': .*raise reward.timeout_s above 6 or lower limits.wall_s"):
        RewardRunner(build_rewards(["code"]), timeout_s=6.0)
    with pytest.raises(ValueError, match=r"limits.wall_s=2 s"):
        RewardRunner(build_rewards([{"fn": "code", "kwargs": {"limits": {"wall_s": 2}}}]), timeout_s=2.5)
    RewardRunner(build_rewards([{"fn": "code", "kwargs": {"limits": {"wall_s": 2}}}]), timeout_s=3.5).close()


@needs_root
def test_code_calls_past_the_cpus_wait_in_the_runner_before_their_timeout_starts():
    """0.6 s programs, one per core at a time: 5 per core take 3 s, past the 2.5 s timeout, yet each
    call's timeout starts when it gets its core (the runner starts no more at once), so every
    correct program scores 1 and none times out."""
    cores = len(os.sched_getaffinity(0))
    limits = {"wall_s": 1.0, "cpu_s": 1}
    completion = fenced("import time\ntime.sleep(0.6)\ndef add(a, b):\n    return a + b")
    prompts = [Prompt(id=f"p{i}", text="q", answer=ADD_TESTS) for i in range(5 * cores)]
    runner = RewardRunner(build_rewards([{"fn": "code", "kwargs": {"limits": limits}}]), timeout_s=2.5,
                          on_error="zero", max_threads=5 * cores)
    t0 = time.monotonic()
    out = runner.score(prompts, [completion] * len(prompts))
    assert not out.failures and [s.scores["code"] for s in out.samples] == [1.0] * len(prompts)
    assert time.monotonic() - t0 > 2.5  # they did wait for one another
