"""What the ssh launcher runs on each host (trainer/cluster/ssh.py).

    python -m trainer.remote check --ports=2222,2223 [--data_dir=D] [--nodownload]
    python -m trainer.remote run [--port=P] -- <trainer.main's flags>

`check` prints one JSON line that says what this host has: the Python,
TensorFlow and trainer versions, which of the ports are taken and which
MNIST files are missing. It imports no TensorFlow, so it answers in well
under a second.

`run` starts `python -m trainer.main` with the flags and ties its life to
the ssh session. ssh gives a remote command no signal when the launcher
stops or its connection drops: the command sees its stdin close, or,
when the link is cut, nothing. So `run` reads its stdin, where the
launcher writes a heartbeat every few seconds, and when it closes, or
SILENCE_SECS pass without a heartbeat, sends the task SIGTERM: the chief
saves a checkpoint where it is, any task exits within seconds. A task
still running STOP_GRACE_SECS later is killed. The task dies with `run`
too (the kernel's parent-death signal), and `run` exits with the task's
status, which ssh passes back. Nothing is left on the host: no shell
(the launcher `exec`s it away), no file outside the remote folder.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import select
import signal
import subprocess
import sys
import threading
import time

from absl import logging

from trainer.cluster import ports as ports_lib
from trainer.common import processes
from trainer.learning import data as data_lib

STOP_GRACE_SECS = processes.CHIEF_STOP_SECS + 5.0  # then SIGKILL
SILENCE_SECS = 30.0     # the launcher writes a heartbeat every 5 s
PORT_WAIT_SECS = SILENCE_SECS + STOP_GRACE_SECS + 5.0
_PACKAGE = pathlib.Path(__file__).resolve().parent


def trainer_version() -> str:
    """The package's version and a digest of its source files: two hosts
    with the same string run the same trainer code."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    try:
        version = importlib.metadata.version("mnist-ps-trainer")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return f"{version} (source {digest.hexdigest()[:12]})"


def facts(ports: list[int], data_dir: str | None, download: bool) -> dict:
    """What the launcher compares across hosts: {"python", "tensorflow",
    "trainer", "ports_taken": [int], "data_missing": [file name],
    "download": bool}."""
    try:
        tensorflow = importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        tensorflow = None
    folder = data_lib.resolve_data_dir(data_dir)
    return {"python": platform.python_version(), "tensorflow": tensorflow,
            "trainer": trainer_version(),
            "ports_taken": [p for p in ports if ports_lib.taken(p)],
            "data_dir": str(folder),
            "data_missing": [n for n in data_lib.FILES
                             if not (folder / n).is_file()],
            "download": download}


def run(flags: list[str], port: int | None = None) -> int:
    """Runs trainer.main with `flags` until it exits or our stdin closes;
    returns its exit status (128 + N if a signal N ended it).

    port: the task's; if taken, wait (at most PORT_WAIT_SECS) for it to
    be free first. After a cut link, the launcher starts a worker again as
    soon as ssh gets through, while the one it had started before may
    still be on its way out (it stops SILENCE_SECS after its last
    heartbeat). A launcher that hangs up meanwhile ends the wait, and
    nothing is started.
    """
    hung_up = threading.Event()
    started: list[processes.Child] = []

    def stop(*_):
        # Only the main thread reaps the task (poll below): a second
        # waiter could take its exit status away. So what is alive is
        # read from returncode, and _send does not reap.
        hung_up.set()
        if not started:
            return
        task = started[0]
        processes.terminate_then_kill(
            lambda: [task] if task.process.returncode is None else [],
            _send, STOP_GRACE_SECS)

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(
        target=stop, daemon=True).start())
    signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides
    threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    if port is not None:
        _wait_for_port(port, hung_up)
    if hung_up.is_set():
        return 128 + signal.SIGTERM
    started.append(processes.Child.start(
        "task", [sys.executable, "-m", "trainer.main", *flags],
        processes.child_env(), own_session=False, die_with_parent=True,
        stdin=subprocess.DEVNULL))
    if hung_up.is_set():  # hung up while the task started
        threading.Thread(target=stop, daemon=True).start()
    status = started[0].poll(block=True)
    return 128 - status if status < 0 else status


def _watch_stdin(stop) -> None:
    """Calls stop() once stdin closes, or no heartbeat came for
    SILENCE_SECS (the launcher is gone or cut off)."""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], SILENCE_SECS)
        if not ready or not os.read(fd, 4096):
            break
    stop()


def _wait_for_port(port: int, hung_up: threading.Event) -> None:
    deadline = time.monotonic() + PORT_WAIT_SECS
    if ports_lib.taken(port):
        logging.warning("port %d is taken, perhaps by this task's run "
                        "before a lost connection, on its way out; waiting "
                        "for it", port)
    while (ports_lib.taken(port) and time.monotonic() < deadline
           and not hung_up.wait(0.5)):
        pass


def _send(task: processes.Child, signum: int) -> None:
    """Sends signum to the task while it runs, without reaping it (as
    Child.signal would)."""
    if task.process.returncode is None:
        try:
            os.kill(task.pid, signum)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.remote")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check")
    check.add_argument("--ports", default="")
    check.add_argument("--data_dir", default=None)
    check.add_argument("--nodownload", action="store_true")
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--port", type=int, default=None)
    run_parser.add_argument("flags", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "check":
        ports = [int(p) for p in args.ports.split(",") if p]
        # The one line the launcher reads (preflight.py).
        sys.stdout.write(json.dumps(facts(ports, args.data_dir,
                                          not args.nodownload)) + "\n")
        return 0
    return run(args.flags, args.port)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
