"""Runs of the cluster with --firewall on simulated hosts, watched from
outside (tests/test_firewall.py).

The outsider host runs tests/outside_watch.py: a plain TCP connect to
each task's port every 20 ms, from before the first task starts until
every task has exited and its table's guard is done. A try that connects
is a hole; `refused` means nothing listens and nothing filters (no
table), `filtered` that the table dropped it.
"""

import re
import signal
import subprocess
import time

from tests import helpers
from tests.outside_watch import OutsideWatch, closed_after
from tests.test_multihost import CPUS, PORT, HostCluster
from trainer.cluster import firewall


def trainer_tables(host) -> list[str]:
    """The trainer's nftables tables in a host's namespace."""
    listing = subprocess.run(
        ["ip", "netns", "exec", host.namespace, "nft", "list", "tables"],
        capture_output=True, text=True, timeout=30, check=True).stdout
    return re.findall(rf"\b{firewall.TABLE_PREFIX}\d+\b", listing)


def start_until_chief_waits(c: HostCluster) -> None:
    """ps0 and the chief; returns once the chief has the model on the ps
    and waits for worker 1 (not started yet)."""
    c.start("ps0")
    c.start("worker0")
    deadline = time.monotonic() + 240
    while "chief ready at global step 0" not in c.log("worker0"):
        assert time.monotonic() < deadline, c.tails()
        assert c.processes["worker0"].poll() is None, c.tails()
        time.sleep(0.2)


def watch_ports(sim, c: HostCluster, names) -> OutsideWatch:
    """tests/outside_watch.py on the outsider: a TCP connect to each named
    task's port every 20 ms (before it starts, until it has exited)."""
    return OutsideWatch(sim.hosts["outsider"],
                        [f"{c.hosts[n].address}:{PORT}" for n in names],
                        helpers.python_env(), helpers.REPO)


def wait_exits(c: HostCluster, names, timeout: float = 300) -> dict:
    """{name: (exit status, wall-clock time seen)} once every named task
    has exited, looked at every 10 ms (bounded)."""
    exits, deadline = {}, time.monotonic() + timeout
    while len(exits) < len(names):
        assert time.monotonic() < deadline, c.tails()
        for name in names:
            status = c.processes[name].poll()
            if name not in exits and status is not None:
                exits[name] = (status, time.time())
        time.sleep(0.01)
    return exits


def wait_no_tables(c: HostCluster, timeout: float = 20) -> None:
    """Waits (bounded) until no host has a trainer table: their guards
    delete them once their tasks are gone."""
    deadline = time.monotonic() + timeout
    while any(trainer_tables(h) for h in c.hosts.values()):
        assert time.monotonic() < deadline, {
            n: trainer_tables(h) for n, h in c.hosts.items()}
        time.sleep(0.05)


def assert_never_open(seen: dict, c: HostCluster, exits: dict) -> None:
    """No try of the outside watch got a connection; prints, per task,
    when its port was closed again after its exit."""
    for name, (status, exited) in exits.items():
        target = seen["targets"][f"{c.hosts[name].address}:{PORT}"]
        after = closed_after(target["changes"], exited)
        print(f"{name}: exit {status}; {target['tries']} tries "
              f"{target['counts']}; table gone {after} s after the exit")
    for target, watched in seen["targets"].items():
        assert watched["open"] == [], (target, watched["open"])
    for name in exits:
        target = seen["targets"][f"{c.hosts[name].address}:{PORT}"]
        assert target["counts"].get("filtered"), (name, target)


# How each ending is brought about once the chief waits for worker 1:
# steps in turn (a signal to send, "wait" for the task's exit, or "start"
# it), and the exit statuses of ps 0, the chief (and worker 1 if
# started). Between them every way out of a task, SIGKILL aside
# (test_with_the_flag_only_the_cluster_gets_in).
ENDINGS = {
    "normal": ((("worker1", "start"),), (0, 0, 0)),
    # The chief gives up waiting for worker 1 (1) and tells the ps the
    # run failed, which makes it exit 1 too (a SIGTERM from here raced
    # with that exit: 143, 1 or -15 by the timing).
    "failed": ((("worker0", "wait"), ("ps0", "wait")), (1, 1)),
    # The chief stops the ps, as after an error, which fails it: it
    # returns from main (1), its server listening on as Python ends.
    "SIGTERM": ((("worker0", signal.SIGTERM),), (1, 143)),
    # Ctrl-C in each task's terminal.
    "SIGINT": ((("ps0", signal.SIGINT), ("worker0", signal.SIGINT)),
               (130, 130)),
}
FAIL_AFTER_SECS = 5   # --startup_timeout_secs of the failed ending


def end_watched(sim, folder, ending: str) -> None:
    """One run with --firewall ended as ENDINGS[ending] says, watched from
    outside from before the ps starts until every task has exited and
    the guards are done: no connection ever, and no table left."""
    steps, statuses = ENDINGS[ending]
    c = HostCluster(sim, folder, helpers.real_mnist_dir(), CPUS,
                    "--firewall", f"--startup_timeout_secs="
                    f"{FAIL_AFTER_SECS if ending == 'failed' else 120}")
    watch = watch_ports(sim, c, c.names)
    try:
        try:
            start_until_chief_waits(c)
            for name, action in steps:
                if action == "wait":
                    c.wait(name, 60)
                elif action == "start":
                    c.start(name)
                else:
                    c.processes[name].send_signal(action)
            exits = wait_exits(c, list(c.processes), 300)
            wait_no_tables(c)
        finally:
            c.stop()
        seen = watch.stop()
    finally:
        watch.kill()
    assert_never_open(seen, c, exits)
    assert tuple(exits[n][0] for n in c.names if n in exits) == statuses, (
        c.tails())


