"""Watches ports from outside: a plain TCP connect to each, every 20 ms.

    python -m tests.outside_watch [--every=0.02] [--max_secs=900] HOST:PORT...

Every `--every` seconds it starts one non-blocking connect to each target
and keeps it waiting for an answer up to PENDING_SECS (less than the
first SYN retransmission, so each try is one SYN): a connection is
"open" (a listener answered and nothing filtered it), "refused" (a reset:
nothing listens and nothing filters), "filtered" (no answer: dropped), or
another errno's name. Nothing is sent on an open connection; it is closed
at once. Stops on SIGTERM or SIGINT (or after --max_secs), waits for the
tries still out, and prints one JSON line:

    {"every": 0.02, "targets": {"HOST:PORT": {
        "tries": N, "counts": {"refused": N, "filtered": N, ...},
        "open": [T, ...],                 # send times of open tries
        "changes": [[T, "refused"], [T, "filtered"], ...]}}}

T is the wall-clock time (time.time()) the try was sent; `changes` lists
each try whose answer differs from the try before it to the same target.
OutsideWatch below runs it on a simulated host for a test.
"""

import argparse
import errno
import json
import select
import selectors
import signal
import socket
import subprocess
import sys
import time

PENDING_SECS = 0.9


def try_connect(target: tuple[str, int]) -> tuple[socket.socket, str | None]:
    """A non-blocking connect started; (socket, its answer if known now)."""
    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setblocking(False)
    code = sock.connect_ex(target)
    if code in (errno.EINPROGRESS, errno.EAGAIN):
        return sock, None
    return sock, answer(code)


def answer(code: int) -> str:
    if code == 0:
        return "open"
    if code == errno.ECONNREFUSED:
        return "refused"
    return errno.errorcode.get(code, str(code))


def watch(targets: list[str], every: float, max_secs: float,
          stop: list) -> dict:
    """Tries each target every `every` s until `stop` is non-empty;
    {target: [(sent, answer), ...]} in sending order."""
    addresses = {t: (t.rsplit(":", 1)[0].strip("[]"), int(t.rsplit(":", 1)[1]))
                 for t in targets}
    results = {t: [] for t in targets}
    pending = {}   # socket -> (target, index into results[target], sent)
    selector = selectors.DefaultSelector()
    end = time.monotonic() + max_secs
    next_try = time.monotonic()
    while pending or not stop:
        now = time.monotonic()
        if not stop and now >= next_try:
            for target, address in addresses.items():
                sent = time.time()
                sock, known = try_connect(address)
                results[target].append([sent, known])
                if known is None:
                    selector.register(sock, selectors.EVENT_WRITE)
                    pending[sock] = (target, len(results[target]) - 1,
                                     time.monotonic())
                else:
                    sock.close()
            next_try += every
            if next_try < now:   # fell behind (a busy machine): no burst
                next_try = now + every
        timeout = max(0.0, next_try - time.monotonic()) if not stop else 0.05
        for key, _ in selector.select(timeout):
            target, index, _ = pending.pop(key.fileobj)
            results[target][index][1] = answer(
                key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
            selector.unregister(key.fileobj)
            key.fileobj.close()
        for sock, (target, index, started) in list(pending.items()):
            if time.monotonic() - started > PENDING_SECS:
                results[target][index][1] = "filtered"
                selector.unregister(sock)
                sock.close()
                del pending[sock]
        if time.monotonic() > end:
            stop.append("max_secs")
    return results


def summary(tries: list) -> dict:
    counts, changes, previous = {}, [], None
    for sent, state in tries:
        counts[state] = counts.get(state, 0) + 1
        if state != previous:
            changes.append([round(sent, 3), state])
        previous = state
    return {"tries": len(tries), "counts": counts,
            "open": [round(sent, 3) for sent, s in tries if s == "open"],
            "changes": changes}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.outside_watch")
    parser.add_argument("--every", type=float, default=0.02)
    parser.add_argument("--max_secs", type=float, default=900.0)
    parser.add_argument("targets", nargs="+")
    args = parser.parse_args(argv)
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.append("signal"))
    print("watching", flush=True)
    results = watch(args.targets, args.every, args.max_secs, stop)
    print(json.dumps({"every": args.every, "targets": {
        t: summary(tries) for t, tries in results.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


class OutsideWatch:
    """The test's side: this program on a simulated host, watching
    `targets` (HOST:PORT) from start() until stop() (its JSON)."""

    def __init__(self, host, targets: list[str], env: dict, cwd):
        self.targets = targets
        self.process = host.popen(
            [sys.executable, "-m", "tests.outside_watch", *targets],
            env=env, cwd=cwd, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        if not ready or self.process.stdout.readline() != "watching\n":
            self.kill()
            raise AssertionError("the outside watch did not start")

    def stop(self) -> dict:
        """Stops it (bounded); its JSON."""
        self.process.send_signal(signal.SIGTERM)
        try:
            out, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("the outside watch did not stop") from None
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        """Kills it if still running (cleanup after a failure)."""
        if self.process.returncode is None:
            self.process.kill()
            self.process.communicate()


def closed_after(changes: list, exited: float) -> float | None:
    """Seconds from `exited` (a task's exit, wall clock) to the first try
    after it that a reset answered (table gone) once the port had been
    filtered; None if the port was still filtered at the end."""
    filtered = False
    for sent, state in changes:
        if state == "filtered":
            filtered = True
        elif state == "refused" and filtered and sent >= exited - 0.05:
            return round(sent - exited, 3)
    return None
