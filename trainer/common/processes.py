"""Child processes: start them, relay their output, watch them, stop them.

The one supervisor that the local launcher (trainer/cluster/local.py), the
benchmark's runs (trainer/bench/runs.py, also on simulated hosts) and the
soak command use, and the one grace-then-kill stop that the simulated
hosts (trainer/bench/simhosts/hosts.py) use for their processes too:

  * `child_env()`: the environment every child gets.
  * `Child.start()`: a child process, in a session (and so a process
    group) of its own or not; `Child.relay()` hands each line of its
    output to a function, e.g. `echo_lines()`, which prefixes it with the
    child's name (`[ps0] ...`); `popen()` starts one alike for a Child
    subclass built with more than a name and a process.
  * `supervise()`: waits until every child exits, or stops them all as
    soon as one fails or the caller gives up.
  * `stop_all()` / `terminate_then_kill()`: SIGTERM, a bounded wait, then
    SIGKILL.

And this process's own end: `exit_now()`, which runs `AT_EXIT` first, and
`exit_after()`, the same on a timer.

Signal handling stays with the commands: a command that must stop its
children on Ctrl-C or SIGTERM turns them into KeyboardInterrupt (as
trainer/launch.py does) and calls `stop_all()` when it arrives.
"""

import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, NoReturn

from absl import logging

# Run before os._exit (which skips atexit): e.g. --firewall's at_exit.
AT_EXIT: list[Callable[[], None]] = []
KILL_WAIT_SECS = 10.0  # for SIGKILLed processes to be gone
# How long a chief sent SIGTERM may take to end training at a step
# boundary, save a checkpoint and stop every task. The chief itself
# (trainer/roles/run.py), ssh's remote side (trainer/remote.py) and the
# launchers' Ctrl-C (trainer/cluster/tasks.py) all wait this long.
CHIEF_STOP_SECS = 60.0


def child_env(**changes) -> dict:
    """The environment of our child processes: ours with `changes`,
    unbuffered output (lines arrive as they are written), TensorFlow's C++
    chatter off unless the caller's environment sets its level, and no
    TF_CONFIG of ours leaking into them (the trainer would read it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **changes)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("TF_CONFIG", None)
    return env


def _die_with_parent():
    """In the child: get SIGKILL if the parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def popen(name: str, argv: list, env: dict | None = None,
          own_session: bool = True, die_with_parent: bool = False,
          **popen_kwargs) -> subprocess.Popen:
    """Starts argv, a process named `name` in the log (for a Child, or a
    subclass that takes more than Child.start passes).

    own_session: a session and process group of its own, which a
      terminal's Ctrl-C does not reach; whoever starts it stops it.
    die_with_parent: the kernel kills the child if we die (even when
      SIGKILLed).
    """
    process = subprocess.Popen(
        argv, env=env, start_new_session=own_session,
        preexec_fn=_die_with_parent if die_with_parent else None,
        **popen_kwargs)
    logging.info("started %s (pid %d)", name, process.pid)
    return process


class Child:
    """One child process, its exit status, peak memory and output relay.

    `own_group`: the child leads a process group of its own (it was
    started in a new session), so signals go to the whole group, its own
    children included; otherwise to the child's pid only, never to the
    group it shares with us.
    """

    def __init__(self, name: str, process: subprocess.Popen,
                 own_group: bool = False):
        self.name = name
        self.process = process
        self.own_group = own_group
        self.peak_rss_mb = None
        self._relay = None

    @classmethod
    def start(cls, name: str, argv: list, env: dict | None = None,
              own_session: bool = True, die_with_parent: bool = False,
              **popen_kwargs) -> "Child":
        """Starts argv as a child named `name` (popen; Popen's keyword
        arguments pass through: stdout, stderr, stdin, text, cwd)."""
        return cls(name, popen(name, argv, env, own_session,
                               die_with_parent, **popen_kwargs),
                   own_group=own_session)

    def __repr__(self) -> str:
        return self.name

    @property
    def pid(self) -> int:
        return self.process.pid

    def relay(self, on_line: Callable) -> None:
        """Calls on_line with each line of the child's output (str or
        bytes, as the child's stdout was opened), in a daemon thread."""
        def read():
            for line in self.process.stdout:
                on_line(line)

        self._relay = threading.Thread(target=read, daemon=True,
                                       name=f"relay {self.name}")
        self._relay.start()

    def join_relay(self, timeout: float) -> None:
        """Waits (at most timeout) for the relay to pass the last line."""
        if self._relay is not None:
            self._relay.join(timeout=timeout)

    def poll(self, block: bool = False) -> int | None:
        """The exit status (-N: killed by signal N), None while running;
        records peak memory.

        Reaps the child with wait4 (not Popen.poll) to get its rusage.
        """
        if self.process.returncode is None:
            try:
                pid, status, usage = os.wait4(self.process.pid,
                                              0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere through Popen
                return self.process.wait() if block else self.process.poll()
            if pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                self.peak_rss_mb = usage.ru_maxrss / 1024.0  # KiB on Linux
        return self.process.returncode

    def signal(self, signum: int) -> None:
        """Sends signum to the child (its group) if it is still running."""
        if self.poll() is None:
            try:
                if self.own_group:
                    os.killpg(self.process.pid, signum)
                else:
                    os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt in the main thread, once,
    so a command stops what it started on the way out, however started:
    one started from a script's background job (`cmd &`) inherits SIGINT
    as ignored, and SIGTERM would otherwise end it without cleaning up."""

    def interrupt(signum, frame):
        del signum, frame
        # Once: a second signal (Ctrl-C twice; SIGTERM to both `timeout`
        # and the command it forwards it to) would cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def echo_lines(name: str, skip: re.Pattern | None = None,
               console=None) -> Callable:
    """An on_line for Child.relay: writes each line to our stdout (or to
    `console`, a console.Console) as `[name] line`, except lines that
    `skip` matches. Bytes pass through unchanged (no re-encoding of what a
    child printed)."""
    prefix = f"[{name}] ".encode()

    def write(line):
        data = line.encode() if isinstance(line, str) else line
        if skip is not None and skip.search(
                data.decode(errors="replace")):
            return
        if console is not None:
            console.line(prefix + data)
            return
        sys.stdout.buffer.write(prefix + data)
        sys.stdout.buffer.flush()

    return write


def terminate_then_kill(alive: Callable[[], Iterable],
                        send: Callable[[object, int], None],
                        grace_secs: float,
                        kill_wait_secs: float = KILL_WAIT_SECS,
                        poll_secs: float = 0.05) -> None:
    """SIGTERM to everything alive(), then SIGKILL to what is still alive
    after grace_secs, and a wait of at most kill_wait_secs for it to go.

    alive() lists the targets still running (children, pids); send(target,
    signum) signals one, ignoring targets that exited meanwhile.
    """
    for signum, wait_secs in ((signal.SIGTERM, grace_secs),
                              (signal.SIGKILL, kill_wait_secs)):
        targets = list(alive())
        if not targets:
            return
        if signum == signal.SIGKILL:
            logging.warning("killing %s: still alive %.0f s after SIGTERM",
                            ", ".join(sorted(str(t) for t in targets)),
                            grace_secs)
        for target in targets:
            send(target, signum)
        deadline = time.monotonic() + wait_secs
        while list(alive()) and time.monotonic() < deadline:
            time.sleep(poll_secs)


def stop_all(children: list[Child], grace_secs: float) -> None:
    """Stops every child still running (terminate_then_kill), reaps them
    all and waits a little for their relays to pass their last lines.

    SIGTERM, not SIGINT: a trainer still importing TensorFlow dies of it
    quietly, where SIGINT would print a KeyboardInterrupt traceback from
    deep inside the import; a running one logs one line and exits.
    """
    terminate_then_kill(lambda: [c for c in children if c.poll() is None],
                        lambda child, signum: child.signal(signum),
                        grace_secs)
    for child in children:
        child.poll(block=True)
        child.join_relay(timeout=5)


@dataclasses.dataclass
class Ending:
    """Why supervise() stopped the children early."""

    failed: Child | None = None  # the first child found exited non-zero
    reason: str | None = None    # else: what give_up() returned


def supervise(children: list[Child], grace_secs: float,
              give_up: Callable[[], str | None] | None = None,
              announce: Callable[[Ending], None] | None = None,
              poll_secs: float = 0.1,
              survive: Callable[[Child], bool] | None = None
              ) -> Ending | None:
    """Waits until every child has exited 0 and returns None; or, as soon
    as one exits non-zero or give_up() returns a reason, calls
    announce(ending) (to log why), stops them all (stop_all) and returns
    the Ending.

    One failed child ends the whole group at once (the others would wait
    for it: a ps for the chief's shutdown, a worker for its peers), unless
    survive(child), called once for it, returns True: then the others go
    on without it, and `survive` may have put a replacement in `children`.
    """
    survived = set()
    while True:
        failed = next((c for c in children if c.poll() not in (None, 0)
                       and id(c) not in survived), None)
        if failed is not None and survive is not None and survive(failed):
            survived.add(id(failed))
            continue
        ending = Ending(failed=failed) if failed else None
        if ending is None and all(c.poll() == 0 for c in children
                                  if id(c) not in survived):
            return None
        if ending is None and give_up is not None:
            reason = give_up()
            ending = Ending(reason=reason) if reason else None
        if ending is not None:
            if announce is not None:
                announce(ending)
            stop_all(children, grace_secs)
            return ending
        time.sleep(poll_secs)


def exit_now(why: str | None, status: int) -> NoReturn:
    """Ends this process now, saying `why` (None: a normal end) at error
    level, after AT_EXIT. Checkpoints are safe: TensorFlow only points
    `checkpoint` at a new one after it is fully written."""
    if why:
        logging.error("%s; exiting", why)
    for cleanup in AT_EXIT:
        cleanup()
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def exit_after(secs: float, why: str, status: int) -> None:
    """exit_now(why, status) in `secs` s, from a daemon thread started now:
    it bounds the process's life (nothing cancels it)."""
    def later():
        time.sleep(secs)
        exit_now(why, status)
    threading.Thread(target=later, daemon=True, name="exit-after").start()
