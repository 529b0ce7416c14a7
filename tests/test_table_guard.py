"""The guard of a --firewall table (trainer/cluster/table_guard.py), alone.

No cluster, no root, no nftables: tests/guarded_listener.py listens on a
free loopback port and starts a guard, and a fake `nft` first on PATH
writes one JSON line per call to a file: its arguments, the time, and
whether the listener's port still accepted a connection at that moment.
The guard must call `nft delete table inet handle H` once, and only once
nothing listens any more, however the listener ended.

With root and nftables, in a network namespace of the test's own, the
real tables: a table put in again on the same port outlives the guard of
the earlier one, and one whose guard was killed stays until replaced.
"""

import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import helpers
from trainer.cluster import spec as cluster_spec
from trainer.cluster import firewall, table_guard

TABLE, HANDLE = "mnist_trainer_test", 42
LINGER_SECS = 0.5   # the listener's atexit sleep, its socket still open
WAIT_SECS = 20      # bound on every wait here

FAKE_NFT = """#!{python}
import json, socket, sys, time
listening = socket.socket().connect_ex(("127.0.0.1", {port})) == 0
with open({log!r}, "a") as log:
    log.write(json.dumps({{"args": sys.argv[1:], "time": time.time(),
                           "listening": listening}}) + "\\n")
sys.stdout.write({stdout!r})
sys.stderr.write({stderr!r})
sys.exit({status})
"""


def fake_nft(folder: pathlib.Path, port: int, status: int = 0,
             stdout: str = "", stderr: str = "") -> dict:
    """Writes folder/bin/nft; returns an environment with it first on
    PATH (its calls go to folder/nft.log)."""
    (folder / "bin").mkdir(exist_ok=True)
    script = folder / "bin" / "nft"
    script.write_text(FAKE_NFT.format(
        python=sys.executable, port=port, log=str(folder / "nft.log"),
        stdout=stdout, stderr=stderr, status=status))
    script.chmod(0o755)
    return helpers.python_env(PATH=f"{folder / 'bin'}:{os.environ['PATH']}")


def nft_calls(folder: pathlib.Path, count: int = 1) -> list[dict]:
    """The fake nft's calls, once there are `count` (bounded wait)."""
    log, deadline = folder / "nft.log", time.monotonic() + WAIT_SECS
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.02)
    raise AssertionError(f"nft was called {len(lines)} times, not {count}")


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + WAIT_SECS
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.02)


class Listener:
    """tests/guarded_listener.py on a free port, and its guard's pid."""

    def __init__(self, folder: pathlib.Path, **nft):
        self.port = helpers.free_ports(1)[0]
        self.folder = folder
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.guarded_listener", str(self.port),
             TABLE, str(HANDLE), str(LINGER_SECS)],
            env=fake_nft(folder, self.port, **nft), cwd=helpers.REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self.guard = None

    def read_guard(self) -> None:
        """Waits (bounded) for the listener's line naming its guard."""
        ready, _, _ = select.select([self.process.stdout], [], [], WAIT_SECS)
        line = self.process.stdout.readline() if ready else ""
        assert line, f"no guard line; stderr: {self.process.stderr.read()}"
        self.guard = json.loads(line)["guard"]

    def end(self, how: str) -> float:
        """Ends the listener (`exit N` or a signal's name); returns the
        time it was asked to."""
        asked = time.time()
        if how.startswith("exit"):
            self.process.stdin.write(f"{how}\n")
            self.process.stdin.flush()
        else:
            self.process.send_signal(getattr(signal, how))
        return asked

    def close(self) -> None:
        """Kills whatever is left (listener, guard); never raises."""
        for pid in (self.process.pid, self.guard):
            if pid and not gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.process.wait(timeout=WAIT_SECS)


@pytest.fixture
def listener(tmp_path):
    made = []

    def make(**nft) -> Listener:
        made.append(Listener(tmp_path, **nft))
        made[-1].read_guard()
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.mark.parametrize("how, status", [
    ("exit 0", 0), ("exit 1", 1), ("SIGTERM", -signal.SIGTERM),
    ("SIGKILL", -signal.SIGKILL)])
def test_the_table_goes_only_once_nothing_listens(listener, how, status):
    task = listener()
    time.sleep(0.3)   # the guard waits while the listener lives
    assert not gone(task.guard)
    assert not (task.folder / "nft.log").exists()
    asked = task.end(how)
    assert task.process.wait(timeout=WAIT_SECS) == status
    [call] = nft_calls(task.folder)
    assert call["args"] == ["delete", "table", "inet", "handle", str(HANDLE)]
    assert not call["listening"], call
    if how.startswith("exit"):   # after the atexit linger, listening
        assert call["time"] >= asked + LINGER_SECS, call
    wait_gone(task.guard)
    assert task.process.stderr.read() == ""


def test_the_guard_ignores_ctrl_c_hangup_and_sigterm(listener):
    task = listener()
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        os.kill(task.guard, signum)
    time.sleep(0.3)
    assert not gone(task.guard)
    assert not (task.folder / "nft.log").exists()
    task.end("exit 0")
    assert nft_calls(task.folder)[0]["listening"] is False


def test_a_failed_delete_is_one_line(listener):
    task = listener(status=1, stderr="Error: Operation not permitted\n")
    task.end("exit 0")
    task.process.wait(timeout=WAIT_SECS)
    nft_calls(task.folder)
    wait_gone(task.guard)
    err = task.process.stderr.read()
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"could not delete table inet {TABLE} (handle {HANDLE}) after "
            f"process {task.process.pid} exited: Error: Operation not "
            "permitted") in err


def test_a_table_already_gone_is_left_quietly(listener):
    task = listener(status=1, stderr="Error: No such file or directory\n")
    task.end("SIGKILL")
    task.process.wait(timeout=WAIT_SECS)
    nft_calls(task.folder)
    wait_gone(task.guard)
    assert task.process.stderr.read() == ""


def test_a_process_already_gone_is_not_waited_for():
    # Not our parent (or no longer): wait_for_exit returns at once.
    started = time.monotonic()
    table_guard.wait_for_exit(1)
    child = subprocess.Popen(["true"])
    child.wait()
    table_guard.wait_for_exit(child.pid)
    assert time.monotonic() - started < 1


def test_a_guard_that_cannot_start_says_why(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(OSError, match="exited with status 1 before it"):
        table_guard.start(TABLE, HANDLE)


class FakeGuard:
    def __init__(self, status):
        self.pid, self.returncode = 1234, status

    def poll(self):
        return self.returncode


@pytest.mark.parametrize("guard_status, deletes", [
    (None, False), (1, True), ("no guard", True)])
def test_the_task_deletes_its_table_only_without_a_guard(
        tmp_path, monkeypatch, guard_status, deletes):
    task = cluster_spec.resolve("ps", 0, "127.0.0.1:2222", "127.0.0.1:2223",
                                None)
    env = fake_nft(tmp_path, 2222, stdout="add table inet mnist_trainer_2222"
                   " # handle 1\nadd table inet mnist_trainer_2222 # handle "
                   "7\n")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setattr(firewall, "check_available", lambda: None)
    started = []

    def start(table, handle):
        started.append((table, handle))
        if guard_status == "no guard":
            raise OSError("no guard here")
        return FakeGuard(guard_status)

    monkeypatch.setattr(table_guard, "start", start)
    wall = firewall.Firewall(task)
    wall.install(task)
    assert started == [("mnist_trainer_2222", 7)]
    wall.at_exit()
    wall.at_exit()
    calls = [c["args"] for c in nft_calls(tmp_path, 2)]
    deleted = [c for c in calls if c[0] == "delete"]
    assert deleted == ([["delete", "table", "inet", "handle", "7"]]
                       if deletes else [])


def test_without_an_echo_the_handle_comes_from_a_listing(monkeypatch):
    listing = "table inet mnist_trainer_2222 { # handle 9\n\tchain input {"
    monkeypatch.setattr(firewall, "_nft", lambda args: subprocess.
                        CompletedProcess(args, 0, listing, ""))
    assert firewall._handle("mnist_trainer_2222", "") == 9


# With real nftables, in a network namespace of the test's own: a process
# that installs ps 0's table for port 2222 and its guard, prints
# "HANDLE GUARD_PID" and exits when its stdin closes.
INSTALL = """
import sys
from absl import logging
from trainer.cluster import firewall, spec
logging.set_verbosity(logging.INFO)
task = spec.resolve("ps", 0, "localhost:2222", "localhost:2223", None)
wall = firewall.Firewall(task)
wall.install(task)
print(wall.handle, wall.guard.pid, flush=True)
sys.stdin.read()
"""
needs_nft = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None
    or shutil.which("nsenter") is None, reason="needs root, nft, nsenter")


@pytest.fixture
def netns():
    """`nsenter` arguments into a new network namespace, held by a sleep
    that is killed at the end."""
    holder = subprocess.Popen(["unshare", "--net", "sleep", "300"])
    try:
        enter = ["nsenter", f"--net=/proc/{holder.pid}/ns/net"]
        deadline = time.monotonic() + WAIT_SECS
        while os.readlink(f"/proc/{holder.pid}/ns/net") == os.readlink(
                "/proc/self/ns/net"):   # until unshare has run
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield enter
    finally:
        holder.kill()
        holder.wait()


class Installer:
    def __init__(self, enter: list[str]):
        self.process = subprocess.Popen(
            [*enter, sys.executable, "-c", INSTALL], cwd=helpers.REPO,
            env=helpers.python_env(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.handle, self.guard = map(
                int, self.process.stdout.readline().split())
        except ValueError:
            self.process.kill()
            raise AssertionError(self.process.communicate()[1]) from None

    def end(self) -> str:
        """Lets it exit; its stderr."""
        return self.process.communicate(timeout=WAIT_SECS)[1]


def tables(enter: list[str]) -> str:
    return subprocess.run([*enter, "nft", "-a", "list", "ruleset"],
                          capture_output=True, text=True, check=True,
                          timeout=WAIT_SECS).stdout


@needs_nft
def test_an_earlier_guard_leaves_a_later_table_alone(netns):
    first = Installer(netns)
    second = Installer(netns)   # the same port, before the first is gone
    assert second.handle != first.handle
    first.end()
    wait_gone(first.guard)   # it found no table of its handle: left quiet
    assert f"mnist_trainer_2222 {{ # handle {second.handle}\n" in tables(
        netns)
    log = second.end()
    assert "replaced one left by an earlier task" in log, log
    wait_gone(second.guard)
    assert "mnist_trainer_2222" not in tables(netns)


@needs_nft
def test_a_table_whose_guard_was_killed_stays_until_replaced(netns):
    first = Installer(netns)
    os.kill(first.guard, signal.SIGKILL)
    first.end()
    assert "mnist_trainer_2222" in tables(netns)   # the port stays closed
    second = Installer(netns)
    log = second.end()
    assert "replaced one left by an earlier task" in log, log
    wait_gone(second.guard)
    assert "mnist_trainer_2222" not in tables(netns)
