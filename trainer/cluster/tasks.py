"""A launcher's cluster tasks as processes: started, watched, stopped.

The local launcher (local.py) and the ssh launcher (ssh.py) differ only
in how a task is started: `python -m trainer.main` here, or `ssh host
... python -m trainer.remote run ...`. Everything after the start is
here and is the same for both:

  * a worker that fails does not end the run: the chief hands its
    examples to the others, and the task is started again (up to
    --worker_restarts times) so that it joins again. The chief counts as
    a worker where there are others: one of them takes over its work
    (trainer/roles/takeover.py), and it joins again as a worker;
  * a ps failing, or the chief where it is the only worker, stops every
    task, unless --ps_restarts allows the ps to be started again (the
    workers reconnect, and the chief restores the newest checkpoint, or
    with --ps_mirrors refills it), or, with --ps_mirrors, the ps is not
    ps 0 (the run goes on without it: trainer/roles/without_ps.py);
  * Ctrl-C first asks the chief (whichever worker does the chief's work
    now: `ChiefName`) to save a checkpoint where it is (SIGTERM, which a
    remote task receives as its ssh stdin closing);
  * the exit status is the run's: 0 when the chief and the ps tasks
    exited 0, else that of the first of them that failed.
"""

import json
import re
import signal
import subprocess
import time
from typing import Callable

from absl import logging

from trainer.common import processes

# Start-up chatter of TensorFlow's C++ runtime that says nothing about the
# run; everything else a task prints is passed through.
NOISE = re.compile(
    r"(failed call to cuInit|Could not find cuda drivers|oneDNN custom "
    r"operations are on|rebuild TensorFlow with the appropriate compiler|"
    r"This TensorFlow binary is optimized|All log messages before "
    r"absl::InitializeLog|Unable to register cu(DNN|FFT|BLAS) factory|"
    r"computation placer already registered|TF-TRT Warning|"
    r"cuda_executor|cudart_stub)")
STOP_SIGNAL_GRACE_SECS = 5.0
CHIEF = "worker0"
INPUT_ERROR_STATUS = 2   # bad input (trainer/flags.py): every task has it


class TaskProcess(processes.Child):
    """A cluster task (ps or worker) run as a child process of the
    launcher (not a cluster_lib.Task, which is a task's place in the
    cluster spec). `name` is "ps0", "worker1", ..."""

    @property
    def job(self) -> str:
        return self.name.rstrip("0123456789")

    @property
    def index(self) -> int:
        return int(self.name[len(self.job):])

    @property
    def unreachable(self) -> bool:
        """Whether it ended because its host could not be reached (only
        a task started over ssh can tell)."""
        return False

    def report(self) -> dict:
        return {"task": self.name, "pid": self.process.pid,
                "exit_status": self.process.returncode,
                "peak_rss_mb": self.peak_rss_mb}


def relay_output(task: TaskProcess, label: str, console=None,
                 on_line=None) -> None:
    """Relays the task's output to ours (or to `console`) as `[label]
    ...`, start-up noise left out; each line also goes to on_line(str),
    if given."""
    echo = processes.echo_lines(label, skip=NOISE, console=console)

    def relay(line: bytes) -> None:
        echo(line)
        if on_line is not None:
            on_line(line.decode(errors="replace"))

    task.relay(relay)


def start_local(job: str, index: int, argv: list[str], env: dict,
                console=None, on_line=None) -> TaskProcess:
    """Starts a task on this machine in a session of its own, killed if
    the launcher dies, its output relayed as `[ps0] ...`."""
    task = TaskProcess.start(
        f"{job}{index}", argv, env, own_session=True, die_with_parent=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL)
    relay_output(task, task.name, console, on_line)
    return task


Start = Callable[[str, int], TaskProcess]   # (job, index) -> started task
_TOOK_OVER = re.compile(r"worker (\d+) \S+ took over the chief's work")


class ChiefName:
    """Which task does the chief's work: worker 0, until a worker's output
    says it took over. `watch(on_line)` makes a worker's line callback
    that keeps track, then calls on_line (if given)."""

    def __init__(self):
        self.name = CHIEF

    def watch(self, on_line=None):
        def seen(line: str) -> None:
            took = _TOOK_OVER.search(line)
            if took:
                self.name = f"worker{took.group(1)}"
            if on_line is not None:
                on_line(line)
        return seen


def run(start: Start, num_ps: int, num_workers: int, exit_grace_secs: float,
        report: str | None = None, worker_restarts: int = 0,
        chief: ChiefName | None = None, ps_restarts: int = 0,
        ps_mirrors: bool = False) -> int:
    """Starts every task with start(job, index), runs the cluster to the
    end and returns the exit status of the run.

    worker_restarts: how often a failed worker (not the chief) is started
      again. report: a JSON file for each task's exit status and memory.
      ps_mirrors: the run goes on without a ps other than ps 0.
    """
    tasks: list[TaskProcess] = []
    try:
        # Started inside the try: a Ctrl-C between two starts stops the
        # tasks already running.
        for job, count in (("ps", num_ps), ("worker", num_workers)):
            for i in range(count):
                tasks.append(start(job, i))
        restart = Restarts(worker_restarts, start, num_workers, ps_restarts,
                           ps_mirrors)
        status = _supervise(tasks, exit_grace_secs, restart)
    except KeyboardInterrupt:
        logging.error("interrupted: stopping every task")
        _stop_chief_first(tasks, (chief or ChiefName()).name)
        status = 130
    if report:
        with open(report, "w") as f:
            json.dump({"exit_status": status,
                       "tasks": [t.report() for t in tasks]}, f, indent=2)
    return status


class Restarts:
    """survive() for processes.supervise: a failed worker other than the
    chief is left behind, or started again while it has restarts left."""

    def __init__(self, allowed: int, start: Start, num_workers: int = 1,
                 ps_allowed: int = 0, ps_mirrors: bool = False):
        self.allowed, self.start, self.used = allowed, start, {}
        self.num_workers, self.ps_allowed = num_workers, ps_allowed
        self.ps_mirrors = ps_mirrors
        self.away: set[int] = set()  # workers whose host is away

    def __call__(self, task: TaskProcess, tasks: list) -> bool:
        if task.job == "ps":
            if self.ps_mirrors and task.index > 0:
                self._again(task, tasks, self.ps_allowed, "--ps_restarts",
                            "the run goes on without it (--ps_mirrors)")
                return True
            return self._again(task, tasks, self.ps_allowed, "--ps_restarts",
                               "the run stops")
        if task.name == CHIEF and (self.num_workers == 1 or task.poll()
                                   == INPUT_ERROR_STATUS):
            return False
        if _run_over(tasks):
            # Started again, it would wait --startup_timeout_secs for ps
            # tasks that are gone, then fail.
            logging.warning("%s exited with status %d after the run's end;"
                            " not started again", task.name, task.poll())
            return True
        if task.unreachable:  # not the worker's failure: try until it's back
            if task.index not in self.away:
                logging.warning("%s: its host cannot be reached; the run "
                                "goes on without it, and it is started "
                                "again once its host answers", task.name)
            self.away.add(task.index)
            tasks.append(self.start("worker", task.index))
            return True
        self.away.discard(task.index)
        self._again(task, tasks, self.allowed, "--worker_restarts",
                    "the run goes on without it")
        return True

    def _again(self, task: TaskProcess, tasks: list, allowed: int,
               flag: str, otherwise: str) -> bool:
        """Starts `task` again if it has restarts left (True), else logs
        `otherwise` (False)."""
        used = self.used.get(task.name, 0)
        if used >= allowed:
            logging.warning("%s exited with status %d; %s (%s=%d)",
                            task.name, task.poll(), otherwise, flag, allowed)
            return False
        self.used[task.name] = used + 1
        logging.warning("%s exited with status %d; starting it again (%d "
                        "of %s=%d)", task.name, task.poll(), used + 1, flag,
                        allowed)
        tasks.append(self.start(task.job, task.index))
        return True


def _run_over(tasks: list) -> bool:
    """Whether ps 0's latest process exited 0 (the chief told it the run
    is over: trainer/roles/ending.py) and no ps task still runs (with
    --ps_mirrors, one lost for good may have failed)."""
    latest = {t.index: t for t in tasks if t.job == "ps"}
    return (0 in latest and latest[0].poll() == 0
            and all(t.poll() is not None for t in latest.values()))


def _stop_chief_first(tasks: list[TaskProcess], name: str) -> None:
    """Ctrl-C: SIGTERM to the chief (task `name`), which saves a
    checkpoint at the next step boundary and stops every task; whatever
    still runs after the chief's time to stop (a little more over ssh,
    whose remote side must pass the exit on) is stopped as usual."""
    chief = next((t for t in reversed(tasks)
                  if t.name == name and t.poll() is None), None)
    if chief is not None and chief.poll() is None:
        chief.signal(signal.SIGTERM)
        deadline = time.monotonic() + processes.CHIEF_STOP_SECS + 5.0
        while (any(t.poll() is None for t in tasks)
               and time.monotonic() < deadline):
            time.sleep(0.1)
    processes.stop_all(tasks, STOP_SIGNAL_GRACE_SECS)


def _supervise(tasks: list[TaskProcess], exit_grace_secs: float,
               restart: Restarts) -> int:
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

    ending = processes.supervise(tasks, STOP_SIGNAL_GRACE_SECS, give_up,
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
