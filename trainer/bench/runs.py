"""The benchmark's runs: a local ps cluster, the single-process baseline
and MultiWorkerMirroredStrategy, each in processes of its own, and the
figures each run reports (one table row)."""

import collections
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

from absl import logging

from trainer.bench import peers
from trainer.cluster import local as launcher
from trainer.common import processes
from trainer.common.config import TrainConfig
from trainer.common.errors import RunFailed
from trainer.observe import progress_line

# Seconds a run's processes get to exit after SIGTERM before SIGKILL.
STOP_GRACE_SECS = 10.0
_LEADER_DONE = "the leader ended"
# Checkpoints are not what the benchmark measures: only the final one.
NO_CHECKPOINTS = 1 << 40
BREAKDOWN_PARTS = ("compute", "pull_params", "push_grads", "wait_others",
                   "aggregate_apply", "other")


@dataclasses.dataclass
class Settings:
    """What every run of one benchmark shares."""

    out: pathlib.Path
    config: TrainConfig      # the trainer flags, as every run uses them
    train_flags: list        # the same, as flags for the launcher
    num_ps: int
    timeout: float           # seconds before a run is given up
    sim: object = None       # simulated.HostSettings, or None: loopback
    steps: object = None     # slurm_steps.StepSettings with --hosts=slurm


def _breakdown_columns(breakdown: dict | None) -> dict:
    """A traced run's mean step breakdown (trainer/observe/timeline.py) as columns
    step_ms and step_<part>_ms; none for an untraced run."""
    if not breakdown:
        return {}
    return {"traced_step_ms": breakdown["step_ms"],
            **{f"step_{part}_ms": breakdown["ms"][part]
               for part in BREAKDOWN_PARTS},
            "step_overlap_ms": breakdown.get("overlap_ms", 0.0)}


@dataclasses.dataclass
class Run:
    """One configuration's figures."""

    name: str
    kind: str            # ps | single | mwms | sro | async | async_split
    workers: int
    results: dict        # the chief's results JSON
    peak_rss_mb: dict    # process name -> MiB
    ps_tasks: int = 0
    config_key: str = ""  # runs with the same key repeat one configuration
    extra: dict = dataclasses.field(default_factory=dict)  # more columns
    error: str | None = None  # why the run failed (a peer's row says so)

    def row(self, target: float, reference_images_per_sec: float) -> dict:
        reached = [e["train_secs"] for e in self.results["eval_history"]
                   if e["accuracy"] >= target]
        images_per_sec = self.results["images_per_sec"]
        return {
            "run": self.name,
            "kind": self.kind,
            "workers": self.workers,
            "test_accuracy": self.results["final_test_accuracy"],
            "wall_time_secs": self.results["wall_time_secs"],
            "train_time_secs": self.results["train_time_secs"],
            "images_per_sec": images_per_sec,
            "efficiency": images_per_sec / reference_images_per_sec,
            "mean_step_time_ms": self.results["mean_step_time_ms"],
            "time_to_target_secs": reached[0] if reached else None,
            "peak_rss_mb_max": max(self.peak_rss_mb.values()),
            "peak_rss_mb": ";".join(f"{k}:{v:.0f}" for k, v in
                                    self.peak_rss_mb.items()),
            **_breakdown_columns(self.results.get("step_breakdown")),
            **self.extra,
        }


class _RunWatch:
    """What stream watches while a run's processes work: the leader's
    lines (progress, its tail, `watch`), the deadline, and with
    after_leader_secs the grace the others get once the leader is done."""

    def __init__(self, children, label, timeout, after_leader_secs, watch):
        self.children, self.label = children, label
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.after_leader_secs, self.watch = after_leader_secs, watch
        self.tail = collections.deque(maxlen=30)
        self.leader_done = None  # when the first process was seen done
        self.stopped = []        # names stopped once the leader was done

    def on_line(self, line) -> None:
        line = line.decode(errors="replace") if isinstance(
            line, bytes) else line
        self.tail.append(line.rstrip())
        if self.watch is not None:
            self.watch(line)
        figures = progress_line.parse_progress_line(line)
        if figures:
            logging.info("%s: step %d/%d, ETA %s", self.label,
                         figures["step"], figures["train_steps"],
                         figures["eta"])

    def give_up(self) -> str | None:
        now = time.monotonic()
        if now > self.deadline:
            return f"no end after {self.timeout:.0f} s"
        if self.after_leader_secs is None or self.children[0].poll() != 0:
            return None
        self.leader_done = self.leader_done or now
        if now - self.leader_done < self.after_leader_secs:
            return None
        self.stopped = [c.name for c in self.children if c.poll() is None]
        return _LEADER_DONE

    def announce(self, ending: processes.Ending) -> None:
        if ending.reason == _LEADER_DONE:
            logging.info("%s: the leader ended; %s did not end within "
                         "%.0f s: stopping them", self.label,
                         ", ".join(self.stopped), self.after_leader_secs)
            return
        failed = ending.failed
        logging.error("%s: %s; stopping its processes", self.label,
                      f"process {self.children.index(failed)} exited with "
                      f"status {failed.poll()}" if failed else ending.reason)


def stream(children: list, label: str, timeout: float,
           after_leader_secs: float | None = None,
           stopped: list | None = None, watch=None) -> list[int]:
    """Waits for a run's processes (processes.Child or Popen), logging a
    progress line per log interval of the first (the chief); returns
    their exit statuses.

    A run is over as soon as one of its processes fails: the others would
    wait for it until the timeout, so they are stopped at once
    (processes.supervise). On timeout, and on Ctrl-C or any error here,
    all are stopped. On failure, logs the end of the chief's output.

    With after_leader_secs (peers whose servers never return), once the
    first process has exited 0 the others get that long to end, then are
    stopped; their names go to `stopped` and their statuses are not
    failures. watch(line), if given, sees every line of the first."""
    children = [c if isinstance(c, processes.Child) else
                processes.Child(f"process {i}", c)
                for i, c in enumerate(children)]
    run = _RunWatch(children, label, timeout, after_leader_secs, watch)
    children[0].relay(run.on_line)
    try:
        processes.supervise(children, STOP_GRACE_SECS, run.give_up,
                            run.announce, poll_secs=0.2)
    finally:  # nothing left running, whatever ended the wait
        processes.stop_all(children, STOP_GRACE_SECS)
    statuses = [c.poll(block=True) for c in children]
    children[0].join_relay(timeout=10)
    if stopped is not None:
        stopped.extend(run.stopped)
    statuses = [0 if c.name in run.stopped else status
                for c, status in zip(children, statuses)]
    if any(statuses):
        logging.error("%s failed (exit statuses %s); its last lines:\n%s",
                      label, statuses, "\n".join(run.tail))
    return statuses


def popen(name: str, args: list[str],
          log_path: pathlib.Path | None = None,
          **env_changes) -> processes.Child:
    """Starts `python args...` for a run, its output piped (for stream)
    or written to log_path. In our process group: a terminal's Ctrl-C
    reaches it as before, and stream stops it on anything else."""
    return popen_argv(name, [sys.executable] + args, log_path, **env_changes)


def popen_argv(name: str, argv: list[str],
               log_path: pathlib.Path | None = None,
               **env_changes) -> processes.Child:
    """popen with the whole command line (e.g. srun ... python ...)."""
    def start(stdout):
        return processes.Child.start(
            name, argv, processes.child_env(**env_changes), own_session=False,
            text=True, stdout=stdout, stderr=subprocess.STDOUT)

    if log_path is None:
        return start(subprocess.PIPE)
    with open(log_path, "w") as log:  # the child writes to its own copy
        return start(log)


def run_ps(s: Settings, workers: int, name: str, label: str) -> Run:
    """A local ps cluster through the launcher (trainer/cluster/local.py)."""
    out = s.out
    logdir = out / name
    report = out / f"{name}.launch.json"
    process = popen("launcher", ["-m", "trainer.launch",
                                 f"--num_workers={workers}",
                                 f"--num_ps={s.num_ps}", f"--logdir={logdir}",
                                 f"--report={report}", *s.train_flags,
                                 # It measures N workers: all in from the
                                 # first step.
                                 f"--min_workers={workers}"])
    (status,) = stream([process], label, s.timeout)
    if status != 0:
        raise RunFailed(f"{label} failed with status {status}")
    tasks = json.loads(report.read_text())["tasks"]
    return Run(name, "ps", workers,
               json.loads((logdir / "results.json").read_text()),
               {t["task"]: t["peak_rss_mb"] for t in tasks}, s.num_ps)


def write_config(s: Settings, name: str, **changes) -> pathlib.Path:
    """The run's TrainConfig as JSON, for the baselines' processes."""
    out = s.out
    config = dataclasses.replace(s.config, logdir=str(out / name),
                                 checkpoint_every=NO_CHECKPOINTS, **changes)
    path = out / f"{name}.config.json"
    path.write_text(json.dumps(dataclasses.asdict(config)))
    return path


def run_single(s: Settings, threads: int, name: str, label: str) -> Run:
    """The single-process baseline with `threads` intra-op threads."""
    config = write_config(s, name, intra_op_threads=threads)
    results = s.out / f"{name}.results.json"
    # A process without a server sizes its thread pool from this variable,
    # not from the session's ConfigProto.
    process = popen("single", ["-m", "trainer.bench.baselines.single",
                               str(config), str(results)],
                    TF_NUM_INTRAOP_THREADS=str(threads))
    (status,) = stream([process], label, s.timeout)
    if status != 0:
        raise RunFailed(f"{label} failed with status {status}")
    data = json.loads(results.read_text())
    return Run(name, "single", 1, data, {"process": data["peak_rss_mb"]})


def run_peer(s: Settings, workers: int, name: str, label: str,
             kind: str) -> Run:
    """A peer (trainer/bench/peers.py) with `workers` local workers and
    --num_ps local ps tasks, every process on a free loopback port."""
    out = s.out
    config = write_config(
        s, name, intra_op_threads=max(1, (os.cpu_count() or 1) // workers))
    counts = peers.task_counts(kind, workers, s.num_ps)
    addresses = {job: [f"localhost:{p}" for p in
                       launcher.free_ports("localhost", n)] if n else []
                 for job, n in counts.items()}
    peer_tasks = peers.tasks(kind, config, out, name, addresses)
    children = []
    try:
        for i, task in enumerate(peer_tasks):
            children.append(popen(
                task.name, task.argv,
                None if i == 0 else out / f"{name}.{task.name}.log"))
    except BaseException:  # Ctrl-C or a failed start: stop those started
        processes.stop_all(children, STOP_GRACE_SECS)
        raise
    return finish_peer(kind, workers, name, label, peer_tasks, children,
                       s.timeout, s.num_ps)


def finish_peer(kind: str, workers: int, name: str, label: str,
                peer_tasks: list, children: list, timeout: float,
                num_ps: int, watch=None) -> Run:
    """Streams a started peer run to its end; its figures as a Run."""
    stopped = []
    statuses = stream(children, label, timeout,
                      peers.after_leader_secs(kind), stopped, watch)
    if any(statuses):
        raise RunFailed(f"{label} failed with statuses {statuses}")
    leader, peak, extra = peers.figures(kind, peer_tasks, stopped)
    return Run(name, kind, workers, leader, peak,
               peers.get(kind).ps_tasks(num_ps), extra=extra)
