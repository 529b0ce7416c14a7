"""A whole cluster as OS processes on this machine (the local launcher).

Starts ps tasks and workers as separate processes of `python -m
trainer.main` on free loopback ports and prefixes their output with the
task's name; what happens after the start (failed workers, Ctrl-C, the
run's exit status) is tasks.py's, shared with the ssh launcher.
`trainer.launch` is its command line.
"""

import os
import random
import socket
import sys

from absl import logging

from trainer.cluster import isolation
from trainer.cluster import tasks
from trainer.common import processes
from trainer.common.errors import UserError

SECURITY_NOTICE = (
    "security: TensorFlow servers listen on all network interfaces and run "
    "any graph sent to them, with no authentication or encryption; use "
    "this only on a trusted, isolated network")


def free_ports(host: str, count: int) -> list[int]:
    """Ports that are free now, below the kernel's ephemeral range.

    A port from the ephemeral range (what binding port 0 returns) can be
    taken by any outgoing connection, for instance another task's gRPC
    channel, between our check and the task's own bind; a port below that
    range can only be taken by another server.
    """
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    ports = []
    for port in candidates:
        trial = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            trial.bind((host if host != "localhost" else "127.0.0.1", port))
        except OSError:
            continue
        finally:
            trial.close()
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports below {low}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def default_worker_threads(num_workers: int) -> dict[str, int]:
    """Thread counts that share this machine's cores among the workers.

    Each worker gets cores / workers threads for its ops and runs one op at
    a time: several TensorFlow processes on two cores otherwise
    oversubscribe them (measured: two cnn workers at 7,546 images/s with
    two ops at a time each, 8,415 with one).
    """
    cores = os.cpu_count() or 1
    return {"intra_op_threads": max(1, cores // num_workers),
            "inter_op_threads": 1}


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def isolate_network(enabled: bool, host: str, fetch_data) -> bool:
    """Moves the launcher (and so every task it starts) into a private
    network namespace with only loopback (trainer/cluster/isolation.py)
    and says so in one line; returns whether the cluster is isolated.

    fetch_data() runs first, in a child process, while the network is
    still there (the MNIST download). Where the machine allows no such
    namespace, one line says why and the run goes on as with isolation
    off.

    Raises UserError if --host is not a loopback address (the namespace
    has nothing else).
    """
    if not enabled:
        logging.info("isolation: off (--noisolate)")
        return False
    if host not in _LOOPBACK_NAMES:
        raise UserError(f"--host={host} cannot be used with isolation: the "
                        "cluster's private network has only loopback; use "
                        "--host=localhost, or --noisolate to run on the "
                        "machine's network")
    if isolation.only_loopback():
        logging.info("isolation: already in a network namespace with only "
                     "loopback; the cluster's ports are reachable from "
                     "nowhere else")
        return True
    isolation.in_child(fetch_data)  # keeps this process single-threaded
    try:
        how = isolation.isolate()
    except isolation.Unavailable as e:
        logging.warning("isolation: unavailable (%s); the cluster's ports "
                        "are open on every interface of this machine, as "
                        "with --noisolate", e)
        return False
    logging.info("isolation: the cluster runs in %s with only loopback; no "
                 "other machine, and no process outside it on this "
                 "machine, can reach its ports (--noisolate turns this off)",
                 how)
    return True


def launch(num_ps: int, num_workers: int, host: str, extra: list[str],
           worker_flags: list[str], exit_grace_secs: float,
           report: str | None = None, worker_restarts: int = 0,
           isolated: bool = False, console=None, on_chief_line=None,
           ps_restarts: int = 0, ps_mirrors: bool = False) -> int:
    """Runs the cluster to the end (tasks.run); returns the exit status
    of the run.

    Args:
      extra: trainer flags for every task.
      worker_flags: further flags for the workers only (thread counts).
      worker_restarts: how often a failed worker is started again (the
        chief too, where there are other workers).
      ps_restarts: how often a failed ps task is started again.
      ps_mirrors: --ps_mirrors with 2 or more ps (a ps other than ps 0
        may fail, and the run goes on).
      isolated: isolate_network() succeeded (no security notice).
      console: a common.console.Console for the tasks' lines, or None.
      on_chief_line: (line) -> None, called with each line of the
        workers, whichever does the chief's work (the status line), or
        None.
    """
    ports = free_ports(host, num_ps + num_workers)
    ps_hosts = ",".join(f"{host}:{p}" for p in ports[:num_ps])
    worker_hosts = ",".join(f"{host}:{p}" for p in ports[num_ps:])
    logging.info("cluster: ps %s; workers %s", ps_hosts, worker_hosts)
    if not isolated:
        logging.info(SECURITY_NOTICE)
    env = processes.child_env()

    def start(job, index):
        argv = [sys.executable, "-m", "trainer.main", f"--job_name={job}",
                f"--task_index={index}", f"--ps_hosts={ps_hosts}",
                f"--worker_hosts={worker_hosts}"] + (
                    worker_flags if job == "worker" else []) + extra
        return tasks.start_local(
            job, index, argv, env, console,
            chief.watch(on_chief_line) if job == "worker" else None)

    chief = tasks.ChiefName()
    return tasks.run(start, num_ps, num_workers, exit_grace_secs, report,
                     worker_restarts, chief, ps_restarts, ps_mirrors)
