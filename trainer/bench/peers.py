"""The peers' runs: the processes each kind starts, and their figures.

A peer run is a set of processes of `python -m trainer.bench.baselines`
(trainer/bench/baselines/), the first of which leads: its results file
holds the run's figures. Where the processes run (loopback or simulated
hosts) is the caller's: trainer/bench/runs.py and
trainer/bench/simhosts/runs.py give each task an address and start it.

    mwms   workers only; worker 0 leads; every process ends by itself.
    sro    ps tasks + workers; worker 0 leads; the ps tasks never end
           (server.join()) and a worker whose last token never comes
           never ends: the benchmark stops them once the leader is done.
    async  ps tasks + workers (servers that never end) + a coordinator,
           which leads; each update on a whole global batch.
    async_split  the same processes; each update on global batch / N
           examples, N times as many updates (trainer/bench/baselines/
           async_ps.py).
"""

import dataclasses
import json
import pathlib

PEER_KINDS = ("mwms", "sro", "async", "async_split")
# The kinds with a coordinator ("chief"): ParameterServerStrategy.
ASYNC_KINDS = ("async", "async_split")
# Seconds the other processes get to end by themselves once the leader
# has ended, before the benchmark stops them (and says so).
AFTER_LEADER_SECS = 10.0


def ps_tasks(kind: str, num_ps: int) -> int:
    """ps tasks a run of `kind` starts with --num_ps (none for the ring)."""
    return 0 if kind == "mwms" else num_ps


def after_leader_secs(kind: str) -> float | None:
    """How long the others may take to end once the leader has, before
    they are stopped; None where every process ends by itself."""
    return None if kind == "mwms" else AFTER_LEADER_SECS


@dataclasses.dataclass
class PeerTask:
    """One process of a peer run."""

    name: str            # ps0, worker1, chief, ...
    job: str             # ps | worker | chief
    index: int
    argv: list           # after the python executable
    out_json: pathlib.Path


def roles(kind: str, workers: int, num_ps: int) -> list[tuple[str, int]]:
    """(job, index) of every process of `kind`, the leader first."""
    worker_tasks = [("worker", k) for k in range(workers)]
    ps_tasks = [("ps", i) for i in range(num_ps)]
    if kind == "mwms":
        return worker_tasks
    if kind == "sro":
        return worker_tasks + ps_tasks
    return [("chief", 0)] + worker_tasks + ps_tasks


def tasks(kind: str, config_path: pathlib.Path, out: pathlib.Path,
          name: str, addresses: dict) -> list[PeerTask]:
    """The processes of one run; addresses: job -> list of host:port."""
    hosts = {job: ",".join(a) for job, a in addresses.items()}
    result = []
    for job, index in roles(kind, len(addresses["worker"]),
                            len(addresses.get("ps", []))):
        task = f"{job}{index}" if job != "chief" else "chief"
        out_json = out / f"{name}.{task}.json"
        argv = ["-m", "trainer.bench.baselines", kind, str(config_path),
                str(out_json)]
        if kind == "mwms":
            argv += [str(index), hosts["worker"]]
        elif kind == "sro":
            argv += [job, str(index), hosts["ps"], hosts["worker"]]
        else:
            argv += [job, str(index), hosts["ps"], hosts["worker"],
                     hosts["chief"]]
        result.append(PeerTask(task, job, index, argv, out_json))
    return result


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def figures(kind: str, peer_tasks: list[PeerTask], stopped: list[str]
            ) -> tuple[dict, dict, dict]:
    """(the leader's results, peak MiB by process, extra columns).

    The extra columns say how many gradients each sro worker pushed and
    whether every process ended by itself (else which ones the benchmark
    stopped)."""
    leader = _read(peer_tasks[0].out_json)
    outputs = {t.name: _read(t.out_json) for t in peer_tasks}
    peak = {n: o["peak_rss_mb"] for n, o in outputs.items()
            if "peak_rss_mb" in o}
    extra = {"ended_by_itself": "yes" if not stopped else
             "no: stopped " + " ".join(stopped)}
    if kind in ASYNC_KINDS:  # of train_steps; fewer if some were repeated
        extra["distinct_slices"] = leader.get("distinct_slices")
    if kind == "sro":
        extra["pushed_gradients"] = ";".join(
            f"{t.index}:{outputs[t.name].get('pushed_gradients', '?')}"
            for t in peer_tasks if t.job == "worker")
    return leader, peak, extra
