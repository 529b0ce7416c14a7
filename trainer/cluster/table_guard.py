"""The guard of a `--firewall` table: deletes it once its task has exited.

    python -I -S .../table_guard.py --pid=PID --table=NAME --handle=H

Why a process of its own. The table must stay until nothing listens on
the port any more, and TensorFlow's server listens until the task's
process is gone: it has no call that closes its listening socket, and it
keeps serving while the interpreter shuts down. A task that deleted its
own table at exit (atexit, a signal handler) left its port open to
anyone for that last moment. Only another process can act after the last
file descriptor of the task is closed, and SIGKILL leaves no moment to
act at all. So the task starts this guard right after installing its
table (trainer/cluster/firewall.py); the guard waits for the task to be
gone, then deletes the table.

How it knows. `os.pidfd_open(PID)` and a wait for the descriptor to be
readable: the kernel reports a process's exit through its pidfd only
after every thread of it has exited, and a thread closes its files
(the listening socket among them) before it exits. The guard is the
task's child, so if the task died before pidfd_open, either pidfd_open
fails (ESRCH) or `os.getppid()` is no longer PID (the guard was handed to
another parent): then the table is deleted at once. Without pidfd_open
(kernels before 5.3) the guard looks at `os.getppid()` every
POLL_SECS, which changes at the same point of the task's exit.

What it deletes. The table by its handle (`nft delete table inet handle
H`), not by its name: the kernel never gives a handle twice, so a table
of the same name put in by a later task on the same port (one started
again at once) is never deleted by the guard of the earlier one. A
table no longer there (deleted by hand, replaced) is left as it is.

How it survives the task's end. Started with `start_new_session`: Ctrl-C
at a terminal and `kill -- -PGID` reach the task's process group, not
the guard. It ignores SIGINT, SIGHUP and SIGTERM (systemd sends SIGTERM
to every process of a unit): it ends on its own once the task has gone.
SIGKILL stops it, and then the table stays, with the port closed, until
the next start on that port replaces it.

What it says. On start, one line `watching` on its stdout (a pipe to
the task, closed at once after), so that the task knows it is guarded.
Nothing more, except one line on stderr (the task's) if the table could
not be deleted. It never raises. It imports only the standard library,
and `start()` below is the task's side.
"""

import argparse
import os
import select
import signal
import subprocess
import sys
import time

READY = b"watching\n"
START_TIMEOUT_SECS = 10.0   # for the guard to say `watching`
NFT_TIMEOUT_SECS = 20
POLL_SECS = 0.02            # without pidfd_open only


def start(table: str, handle: int) -> subprocess.Popen:
    """Starts the guard of table `table` (handle `handle`) for this
    process and returns it once it watches; raises OSError saying why
    not (then no guard runs)."""
    if not sys.executable:
        raise OSError("no Python executable to run it with")
    argv = [sys.executable, "-I", "-S", os.path.abspath(__file__),
            f"--pid={os.getpid()}", f"--table={table}", f"--handle={handle}"]
    # fork+exec without running Python in the child: safe with threads.
    guard = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, start_new_session=True)
    with guard.stdout:
        said, closed = _first_line(guard.stdout.fileno(), START_TIMEOUT_SECS)
    if said == READY:
        return guard
    try:   # a closed stdout: it is exiting, or has
        status = guard.wait(timeout=1.0 if closed else 0.0)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()
        raise OSError(f"the guard did not say it watched within "
                      f"{START_TIMEOUT_SECS:.0f} s") from None
    raise OSError(f"the guard exited with status {status} before it "
                  "watched")


def _first_line(fd: int, timeout: float) -> tuple[bytes, bool]:
    """What fd gave up to its first newline, within `timeout` s; and
    whether it was closed first."""
    said, deadline = b"", time.monotonic() + timeout
    while not said.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return said, False
        chunk = os.read(fd, 64)
        if not chunk:
            return said, True
        said += chunk
    return said, False


def wait_for_exit(pid: int) -> None:
    """Returns once process `pid`, our parent, has exited (at once if it
    already has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd_open here
        while os.getppid() == pid:
            time.sleep(POLL_SECS)
        return
    try:
        if os.getppid() != pid:  # died before pidfd_open: not our parent
            return
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():
            pass
    finally:
        os.close(pidfd)


def delete(table: str, handle: int) -> str | None:
    """Deletes the table by its handle; None if done or already gone,
    else why not (one line)."""
    try:
        result = subprocess.run(
            ["nft", "delete", "table", "inet", "handle", str(handle)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=NFT_TIMEOUT_SECS, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if result.returncode == 0 or "No such file" in result.stderr:
        return None
    lines = result.stderr.strip().splitlines() or [
        f"nft exited with status {result.returncode}"]
    return lines[0]


def say(line: str) -> None:
    """Writes one line to stderr; never raises (stderr may be gone)."""
    try:
        os.write(2, f"{line}\n".encode(errors="replace"))
    except OSError:
        pass


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="table_guard")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--handle", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        os.write(1, READY)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)   # the task stops reading: let the pipe close
        os.close(devnull)
    except OSError:
        pass   # the task gave up on us; still delete once it is gone
    wait_for_exit(args.pid)
    why = delete(args.table, args.handle)
    if why is None:
        return 0
    say(f"firewall: the guard could not delete table inet {args.table} "
        f"(handle {args.handle}) after process {args.pid} exited: {why}; "
        f"delete it with `nft delete table inet {args.table}`")
    return 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BaseException as e:  # noqa: BLE001 (never a traceback)
        if isinstance(e, SystemExit):
            raise
        say(f"firewall: table guard failed: {type(e).__name__}: {e}")
        sys.exit(1)
