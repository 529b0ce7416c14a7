"""A whole cluster as OS processes on this machine (the local launcher).

Starts ps tasks and workers as separate processes of `python -m
trainer.main` on free loopback ports and prefixes their output with the
task's name. A worker other than the chief that fails does not end the
run: the chief hands its examples to the others, and the launcher starts
it again (up to --worker_restarts times) so that it joins again. The
chief or a ps failing stops every task; so does Ctrl-C, which first asks
the chief to save a checkpoint where it is. The exit status is the run's:
0 when the chief and the ps tasks exited 0, else that of the first of
them that failed. `trainer.launch` is its command line.
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

from absl import logging

from trainer.cluster import isolation
from trainer.common import processes
from trainer.common.errors import UserError

# Start-up chatter of TensorFlow's C++ runtime that says nothing about the
# run; everything else a task prints is passed through.
_NOISE = re.compile(
    r"(failed call to cuInit|Could not find cuda drivers|oneDNN custom "
    r"operations are on|rebuild TensorFlow with the appropriate compiler|"
    r"This TensorFlow binary is optimized|All log messages before "
    r"absl::InitializeLog|Unable to register cu(DNN|FFT|BLAS) factory|"
    r"computation placer already registered|TF-TRT Warning|"
    r"cuda_executor|cudart_stub)")
_STOP_SIGNAL_GRACE_SECS = 5.0
_CHIEF_STOP_SECS = 30.0     # Ctrl-C: how long the chief may take to save
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
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind((host if host != "localhost" else "127.0.0.1", port))
        except OSError:
            continue
        finally:
            probe.close()
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


class TaskProcess(processes.Child):
    """A cluster task (ps or worker) run as a child process of the
    launcher (not a cluster_lib.Task, which is a task's place in the
    cluster spec)."""

    @property
    def job(self) -> str:
        return self.name.rstrip("0123456789")

    def report(self) -> dict:
        return {"task": self.name, "pid": self.process.pid,
                "exit_status": self.process.returncode,
                "peak_rss_mb": self.peak_rss_mb}


def start_task(job: str, index: int, argv: list[str], env: dict,
               console=None, on_line=None) -> TaskProcess:
    """Starts a task in a session of its own, killed if the launcher dies,
    its output relayed to ours (or to `console`) as `[ps0] ...`, start-up
    noise left out; each of its lines also goes to on_line(str), if
    given."""
    task = TaskProcess.start(
        f"{job}{index}", argv, env, own_session=True, die_with_parent=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL)
    echo = processes.echo_lines(task.name, skip=_NOISE, console=console)

    def relay(line: bytes) -> None:
        echo(line)
        if on_line is not None:
            on_line(line.decode(errors="replace"))

    task.relay(relay)
    return task


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
           isolated: bool = False, console=None, on_chief_line=None) -> int:
    """Runs the cluster to the end; returns the exit status of the run.

    Args:
      extra: trainer flags for every task.
      worker_flags: further flags for the workers only (thread counts).
      worker_restarts: how often a failed worker (not the chief) is
        started again.
      isolated: isolate_network() succeeded (no security notice).
      console: a common.console.Console for the tasks' lines, or None.
      on_chief_line: (line) -> None, called with each of the chief's
        lines (the status line), or None.
    """
    ports = free_ports(host, num_ps + num_workers)
    ps_hosts = ",".join(f"{host}:{p}" for p in ports[:num_ps])
    worker_hosts = ",".join(f"{host}:{p}" for p in ports[num_ps:])
    logging.info("cluster: ps %s; workers %s", ps_hosts, worker_hosts)
    if not isolated:
        logging.info(SECURITY_NOTICE)
    env = processes.child_env()

    def start(job, index):
        return start_task(job, index, argv(job, index), env, console,
                          on_chief_line if (job, index) == ("worker", 0)
                          else None)

    def argv(job, index):
        return [sys.executable, "-m", "trainer.main", f"--job_name={job}",
                f"--task_index={index}", f"--ps_hosts={ps_hosts}",
                f"--worker_hosts={worker_hosts}"] + (
                    worker_flags if job == "worker" else []) + extra

    tasks: list[TaskProcess] = []
    try:
        # Started inside the try: a Ctrl-C between two starts stops the
        # tasks already running.
        for job, count in (("ps", num_ps), ("worker", num_workers)):
            for i in range(count):
                tasks.append(start(job, i))
        restart = _Restarts(worker_restarts, start)
        status = _supervise(tasks, exit_grace_secs, restart)
    except KeyboardInterrupt:
        logging.error("interrupted: stopping every task")
        _stop_chief_first(tasks)
        status = 130
    if report:
        with open(report, "w") as f:
            json.dump({"exit_status": status,
                       "tasks": [t.report() for t in tasks]}, f, indent=2)
    return status


class _Restarts:
    """survive() for processes.supervise: a failed worker other than the
    chief is left behind, or started again while it has restarts left."""

    def __init__(self, allowed: int, start):
        self.allowed, self.start, self.used = allowed, start, {}

    def __call__(self, task: TaskProcess, tasks: list) -> bool:
        if task.job != "worker" or task.name == "worker0":
            return False
        index = int(task.name[len("worker"):])
        used = self.used.get(index, 0)
        if used >= self.allowed:
            logging.warning("%s exited with status %d; the run goes on "
                            "without it (--worker_restarts=%d)", task.name,
                            task.poll(), self.allowed)
            return True
        self.used[index] = used + 1
        logging.warning("%s exited with status %d; starting it again (%d "
                        "of --worker_restarts=%d)", task.name, task.poll(),
                        used + 1, self.allowed)
        tasks.append(self.start("worker", index))
        return True


def _stop_chief_first(tasks: list[TaskProcess]) -> None:
    """Ctrl-C: SIGTERM to the chief, which saves a checkpoint at the next
    step boundary and stops every task; whatever still runs after
    _CHIEF_STOP_SECS is stopped as usual."""
    chief = next((t for t in tasks if t.name == "worker0"), None)
    if chief is not None and chief.poll() is None:
        chief.signal(signal.SIGTERM)
        deadline = time.monotonic() + _CHIEF_STOP_SECS
        while (any(t.poll() is None for t in tasks)
               and time.monotonic() < deadline):
            time.sleep(0.1)
    processes.stop_all(tasks, _STOP_SIGNAL_GRACE_SECS)


def _supervise(tasks: list[TaskProcess], exit_grace_secs: float,
               restart: _Restarts) -> int:
    """Runs the tasks to their end (processes.supervise); returns the exit
    status of the run. Once every worker is done, the ps tasks have
    exit_grace_secs to exit before they are stopped."""
    workers_done_at = None

    def give_up() -> str | None:
        nonlocal workers_done_at
        workers = [t for t in tasks if t.job == "worker"]
        if workers_done_at is None and all(t.poll() is not None
                                           for t in workers):
            workers_done_at = time.monotonic()
        if (workers_done_at is not None
                and time.monotonic() - workers_done_at > exit_grace_secs):
            stuck = ", ".join(t.name for t in tasks if t.poll() is None)
            return (f"{stuck} still running {exit_grace_secs:.0f} s after "
                    "the workers finished; killing it")
        return None

    def announce(ending: processes.Ending) -> None:
        if ending.failed:
            logging.error("%s exited with status %d; stopping the others",
                          ending.failed.name, ending.failed.poll())
        else:
            logging.error("%s", ending.reason)

    ending = processes.supervise(tasks, _STOP_SIGNAL_GRACE_SECS, give_up,
                                 announce,
                                 survive=lambda task: restart(task, tasks))
    if ending is None:
        for t in tasks:
            t.join_relay(timeout=5)
        failed = sorted({t.name for t in tasks if t.poll() != 0})
        if failed:
            logging.info("the chief and the ps tasks exited 0; %s failed "
                         "during the run", ", ".join(failed))
        else:
            logging.info("every task exited 0")
        return 0
    return ending.failed.poll() if ending.failed else 1
