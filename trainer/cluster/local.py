"""A whole cluster as OS processes on this machine (the local launcher).

Starts ps tasks and workers as separate processes of `python -m
trainer.main` on free loopback ports, prefixes their output with the
task's name, and stops them all when one fails or on Ctrl-C. The exit
status is the run's: 0 when every task exited 0, else that of the first
task that failed. `trainer.launch` is its command line.
"""

import ctypes
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import logging

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


def _die_with_parent():
    """In the child: get SIGKILL if the launcher dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Task:
    """One child process and the thread that relays its output."""

    def __init__(self, job: str, index: int, argv: list[str], env: dict):
        self.name = f"{job}{index}"
        self.job = job
        self.peak_rss_mb = None
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            preexec_fn=_die_with_parent)
        logging.info("started %s (pid %d)", self.name, self.process.pid)
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self):
        prefix = f"[{self.name}] ".encode()
        for line in self.process.stdout:
            if _NOISE.search(line.decode(errors="replace")):
                continue
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()

    def poll(self, block: bool = False):
        """The exit status, or None while running; records peak memory.

        Reaps the child with wait4 (not Popen.poll) to get its rusage.
        """
        if self.process.returncode is None:
            pid, status, usage = os.wait4(self.process.pid,
                                          0 if block else os.WNOHANG)
            if pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                self.peak_rss_mb = usage.ru_maxrss / 1024.0  # KiB on Linux
        return self.process.returncode

    def report(self) -> dict:
        return {"task": self.name, "pid": self.process.pid,
                "exit_status": self.process.returncode,
                "peak_rss_mb": self.peak_rss_mb}

    def signal(self, signum):
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass


def launch(num_ps: int, num_workers: int, host: str, extra: list[str],
           worker_flags: list[str], exit_grace_secs: float,
           report: str | None = None) -> int:
    """Runs the cluster to the end; returns the exit status of the run.

    Args:
      extra: trainer flags for every task.
      worker_flags: further flags for the workers only (thread counts).
    """
    ports = free_ports(host, num_ps + num_workers)
    ps_hosts = ",".join(f"{host}:{p}" for p in ports[:num_ps])
    worker_hosts = ",".join(f"{host}:{p}" for p in ports[num_ps:])
    logging.info("cluster: ps %s; workers %s", ps_hosts, worker_hosts)
    logging.info(SECURITY_NOTICE)
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONUNBUFFERED"] = "1"

    def argv(job, index):
        return [sys.executable, "-m", "trainer.main", f"--job_name={job}",
                f"--task_index={index}", f"--ps_hosts={ps_hosts}",
                f"--worker_hosts={worker_hosts}"] + (
                    worker_flags if job == "worker" else []) + extra

    tasks = [Task("ps", i, argv("ps", i), env) for i in range(num_ps)]
    tasks += [Task("worker", i, argv("worker", i), env)
              for i in range(num_workers)]
    try:
        status = _supervise(tasks, exit_grace_secs)
    except KeyboardInterrupt:
        logging.error("interrupted: stopping every task")
        _stop_all(tasks)
        status = 130
    if report:
        with open(report, "w") as f:
            json.dump({"exit_status": status,
                       "tasks": [t.report() for t in tasks]}, f, indent=2)
    return status


def _supervise(tasks: list[Task], exit_grace_secs: float) -> int:
    workers = [t for t in tasks if t.job == "worker"]
    workers_done_at = None
    while True:
        for task in tasks:
            status = task.poll()
            if status not in (None, 0):
                logging.error("%s exited with status %d; stopping the others",
                              task.name, status)
                _stop_all(tasks)
                return status
        if all(t.poll() == 0 for t in tasks):
            for t in tasks:
                t.relay.join(timeout=5)
            logging.info("every task exited 0")
            return 0
        if workers_done_at is None and all(t.poll() == 0 for t in workers):
            workers_done_at = time.monotonic()
        if (workers_done_at is not None
                and time.monotonic() - workers_done_at > exit_grace_secs):
            stuck = ", ".join(t.name for t in tasks if t.poll() is None)
            logging.error("%s still running %.0f s after the workers finished;"
                          " killing it", stuck, exit_grace_secs)
            _stop_all(tasks)
            return 1
        time.sleep(0.1)


def _stop_all(tasks: list[Task]) -> None:
    """SIGTERM, then SIGKILL for whatever is still running after a grace.

    SIGTERM, not SIGINT: a task still importing TensorFlow dies of it
    quietly, where SIGINT would print a KeyboardInterrupt traceback from
    deep inside the import; a running task logs one line and exits.
    """
    for task in tasks:
        task.signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_SIGNAL_GRACE_SECS
    while time.monotonic() < deadline and any(
            t.poll() is None for t in tasks):
        time.sleep(0.05)
    for task in tasks:
        task.signal(signal.SIGKILL)
    for task in tasks:
        task.poll(block=True)
        task.relay.join(timeout=5)
