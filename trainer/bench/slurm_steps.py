"""Benchmark runs as job steps of a Slurm allocation (--hosts=slurm).

The benchmark itself runs inside an allocation (`salloc` or the body of an
`sbatch` script) and starts each configuration as one `srun` job step over
the allocation's nodes, the way a user runs the trainer there:

  * a ps run is `srun --nodes=M --ntasks=K+N python -m trainer.main
    --cluster=slurm --num_ps=K ...`: the first K tasks are the ps tasks,
    the next N the workers (trainer/cluster/slurm.py), placed
    --slurm_tasks_per_node per node (default 1: every task on a node of
    its own, as --hosts=simulated places them);
  * the single-process baseline is a one-task step;
  * a peer run (trainer/bench/peers.py) is
    one one-task step per process, all started at once, each pinned with
    --nodelist to its node: the peers' processes need every address before
    they start, so task j (the leader first, Peer.roles' order) gets node
    j // --slurm_tasks_per_node and port --slurm_base_port + j.

Every node must see the same Python, this checkout and --out (a shared
file system): the steps write their logdirs and results under --out, and
the benchmark reads them there. A step that fails, times out or is
interrupted is cancelled with scancel, so no task outlives its run.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Mapping

from absl import logging

from trainer.bench import peers
from trainer.bench import runs as runs_lib
from trainer.cluster import slurm
from trainer.common import processes
from trainer.common.errors import RunFailed, UserError

SCANCEL_TIMEOUT_SECS = 30


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Where the steps run: the allocation and the tasks per node."""

    job_id: str
    nodes: tuple[str, ...]   # the allocation's nodes, in Slurm's order
    tasks_per_node: int      # tasks of a ps run on each node
    base_port: int           # --slurm_base_port of the trainer's tasks


def nodes_needed(tasks: int, tasks_per_node: int) -> int:
    return math.ceil(tasks / tasks_per_node)


def allocation(environ: Mapping[str, str], most_tasks: int,
               tasks_per_node: int, base_port: int) -> StepSettings:
    """The allocation this benchmark runs in, checked to hold its largest
    run (`most_tasks` tasks); UserError (one line) otherwise."""
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    nodelist = environ.get("SLURM_JOB_NODELIST", "").strip()
    if not job_id or not nodelist:
        raise UserError(
            "--hosts=slurm starts job steps in a Slurm allocation, and this "
            "process is not in one (no SLURM_JOB_ID); run it inside salloc "
            "or an sbatch script, e.g. salloc --nodes=5 python -m "
            "trainer.benchmark --hosts=slurm ...")
    if tasks_per_node < 1:
        raise UserError(f"--slurm_tasks_per_node={tasks_per_node}: give 1 "
                        "or more tasks per node")
    nodes = tuple(slurm.expand_hostlist(nodelist))
    needed = nodes_needed(most_tasks, tasks_per_node)
    if needed > len(nodes):
        raise UserError(
            f"--hosts=slurm: the largest run has {most_tasks} task(s), "
            f"{tasks_per_node} per node, so it needs {needed} node(s), but "
            f"allocation {job_id} has {len(nodes)} ({nodelist}); allocate "
            f"--nodes={needed} or more, or raise --slurm_tasks_per_node")
    return StepSettings(job_id, nodes, tasks_per_node, base_port)


def srun_argv(steps: StepSettings, tasks: int, name: str) -> list[str]:
    """srun for one step of `tasks` tasks named `name` (block layout)."""
    per_node = min(tasks, steps.tasks_per_node)
    return ["srun", f"--job-name={name}",
            f"--nodes={nodes_needed(tasks, per_node)}", f"--ntasks={tasks}",
            f"--ntasks-per-node={per_node}", "--distribution=block",
            "--kill-on-bad-exit=1", "--label", "--input=none",
            "--overcommit"]


def _run_step(s: runs_lib.Settings, argv: list[str], name: str,
              label: str, **env_changes) -> int:
    """Runs one job step to its end (runs_lib.stream: progress, timeout,
    Ctrl-C); cancels the step unless it ended well. The exit status."""
    logging.info("%s: %s", label, " ".join(argv[:6]))
    child = processes.Child.start(
        name, argv, processes.child_env(**env_changes), own_session=False,
        text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    status = 1
    try:
        (status,) = runs_lib.stream([child], label, s.timeout)
    finally:
        if status != 0:  # srun stopped by a signal may leave its tasks
            _cancel_steps(s.steps.job_id, name)
    return status


def _cancel_steps(job_id: str, names: str | set) -> None:
    """scancel every step of our job named `names` (one name or a set)
    that is still there."""
    names = {names} if isinstance(names, str) else names
    listing = subprocess.run(
        ["squeue", "--steps", f"--jobs={job_id}", "--noheader",
         "--format=%i %j"], capture_output=True, text=True,
        timeout=SCANCEL_TIMEOUT_SECS, check=False, stdin=subprocess.DEVNULL)
    for line in listing.stdout.splitlines():
        step_id, _, step_name = line.strip().partition(" ")
        if step_name in names:
            subprocess.run(["scancel", step_id], timeout=SCANCEL_TIMEOUT_SECS,
                           check=False, stdin=subprocess.DEVNULL,
                           capture_output=True)
            logging.info("cancelled job step %s (%s)", step_id, step_name)


def run_ps_as_step(s: runs_lib.Settings, workers: int, name: str,
                   label: str) -> runs_lib.Run:
    """A ps cluster of --num_ps ps tasks and `workers` workers as one step;
    the chief (task --num_ps) writes results.json into out/name."""
    steps: StepSettings = s.steps
    logdir = s.out / name
    tasks = s.num_ps + workers
    argv = srun_argv(steps, tasks, name) + [
        sys.executable, "-m", "trainer.main", "--cluster=slurm",
        f"--num_ps={s.num_ps}", f"--slurm_base_port={steps.base_port}",
        *s.train_flags, f"--logdir={logdir}",
        f"--min_workers={workers}"]  # all in from the first step
    status = _run_step(s, argv, name, label)
    if status != 0:
        raise RunFailed(f"{label} failed: its job step exited with status "
                        f"{status}")
    results = json.loads((logdir / "results.json").read_text())
    return runs_lib.Run(name, "ps", workers, results,
                        {"chief": results["peak_rss_mb"]}, s.num_ps,
                        extra={"nodes": nodes_needed(
                            tasks, min(tasks, steps.tasks_per_node))})


def run_single_as_step(s: runs_lib.Settings, threads: int, name: str,
                       label: str) -> runs_lib.Run:
    """The single-process baseline as a one-task step."""
    config = runs_lib.write_config(s, name, intra_op_threads=threads)
    results = s.out / f"{name}.results.json"
    argv = srun_argv(s.steps, 1, name) + [
        sys.executable, "-m", "trainer.bench.baselines.single",
        str(config), str(results)]
    # A process without a server sizes its thread pool from this variable;
    # srun passes our environment on to the task.
    status = _run_step(s, argv, name, label,
                       TF_NUM_INTRAOP_THREADS=str(threads))
    if status != 0:
        raise RunFailed(f"{label} failed: its job step exited with status "
                        f"{status}")
    data = json.loads(results.read_text())
    return runs_lib.Run(name, "single", 1, data,
                        {"process": data["peak_rss_mb"]},
                        extra={"nodes": 1})


def peer_addresses(steps: StepSettings, kind: str, workers: int,
                   num_ps: int) -> tuple[dict, list]:
    """Where each process of a peer run goes: (job -> [node:port], the
    node of each task in Peer.roles' order)."""
    placed = {"worker": [], "ps": [], "chief": []}
    task_nodes = []
    for j, (job, _) in enumerate(peers.get(kind).roles(workers, num_ps)):
        node = steps.nodes[j // steps.tasks_per_node]
        placed[job].append(f"{node}:{steps.base_port + j}")
        task_nodes.append(node)
    return placed, task_nodes


def run_peer_as_steps(s: runs_lib.Settings, workers: int, name: str,
                      label: str, kind: str) -> runs_lib.Run:
    """A peer run, each process a one-task job step on its node; the
    leader's output is streamed, the others' go to out/<name>.<task>.log.
    Steps still there once the run is over (servers that never end) are
    stopped, then cancelled."""
    config = runs_lib.write_config(s, name, intra_op_threads=1)
    num_ps = peers.get(kind).ps_tasks(s.num_ps)
    addresses, task_nodes = peer_addresses(s.steps, kind, workers, num_ps)
    peer_tasks = peers.tasks(kind, config, s.out, name, addresses)
    step_names = [f"{name}.{t.name}" for t in peer_tasks]
    children = []
    try:
        for i, (task, node) in enumerate(zip(peer_tasks, task_nodes)):
            # --overlap: steps of one run may share a node's CPUs.
            argv = srun_argv(s.steps, 1, step_names[i]) + [
                f"--nodelist={node}", "--overlap", sys.executable,
                *task.argv]
            children.append(runs_lib.popen_argv(
                task.name, argv, None if i == 0 else
                s.out / f"{name}.{task.name}.log"))
        run = runs_lib.finish_peer(kind, workers, name, label, peer_tasks,
                                   children, s.timeout, s.num_ps)
    finally:  # a stopped srun may leave its task behind
        processes.stop_all(children, runs_lib.STOP_GRACE_SECS)
        _cancel_steps(s.steps.job_id, set(step_names))
    run.extra["nodes"] = len(set(task_nodes))
    return run


def describe(steps: StepSettings) -> str:
    return (f"job steps of Slurm allocation {steps.job_id} on "
            f"{len(steps.nodes)} node(s) ({','.join(steps.nodes)}), "
            f"{steps.tasks_per_node} task(s) per node, from port "
            f"{steps.base_port}; this process: {os.uname().nodename}")
