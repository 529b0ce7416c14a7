"""The peers' runs: which peers there are, the processes a run starts, and
its figures.

Every module of trainer/bench/baselines/ that defines `PEER` is a peer
(trainer/bench/baselines/peer.py says what it declares). A peer run is a
set of its processes, the first of which leads: its results file holds
the run's figures. Where the processes run (loopback, simulated hosts or
Slurm job steps) is the caller's: trainer/bench/runs.py,
trainer/bench/simhosts/runs.py and trainer/bench/slurm_steps.py give each
task an address and start it.
"""

import dataclasses
import functools
import importlib
import json
import pathlib
import pkgutil

from trainer.bench import baselines
from trainer.bench.baselines import peer as peer_lib
from trainer.bench.baselines.peer import Peer

# Seconds the other processes get to end by themselves once the leader
# has ended, before the benchmark stops them (and says so).
AFTER_LEADER_SECS = 10.0


@functools.cache
def all_peers() -> dict[str, Peer]:
    """name -> Peer, in the peers' declared order."""
    found = []
    for info in pkgutil.iter_modules(baselines.__path__):
        module_name = f"{baselines.__name__}.{info.name}"
        declared = getattr(importlib.import_module(module_name), "PEER",
                           None)
        if declared is not None:
            found.append(dataclasses.replace(declared, module=module_name))
    return {p.name: p for p in sorted(found, key=lambda p: p.order)}


def all_kinds() -> tuple[str, ...]:
    """Every kind of run: the ps trainer, the single process, the peers."""
    return ("ps", "single", *all_peers())


def get(kind: str) -> Peer:
    return all_peers()[kind]


def is_peer(kind: str) -> bool:
    return kind in all_peers()


def after_leader_secs(kind: str) -> float | None:
    """How long the others may take to end once the leader has, before
    they are stopped; None where every process ends by itself."""
    return None if get(kind).ends_by_itself else AFTER_LEADER_SECS


@dataclasses.dataclass
class PeerTask:
    """One process of a peer run."""

    name: str            # ps0, worker1, chief, ...
    job: str             # ps | worker | chief
    index: int
    argv: list           # after the python executable
    out_json: pathlib.Path


def task_counts(kind: str, workers: int, num_ps: int) -> dict[str, int]:
    """job -> how many processes of it a run of `kind` starts."""
    counts = {"worker": 0, "ps": 0, "chief": 0}
    for job, _ in get(kind).roles(workers, num_ps):
        counts[job] += 1
    return counts


def tasks(kind: str, config_path: pathlib.Path, out: pathlib.Path,
          name: str, addresses: dict) -> list[PeerTask]:
    """The processes of one run; addresses: job -> list of host:port."""
    peer = get(kind)
    hosts = {job: list(a) for job, a in addresses.items() if a}
    result = []
    for job, index in peer.roles(len(addresses["worker"]),
                                 len(addresses.get("ps", []))):
        task = f"{job}{index}" if job != "chief" else "chief"
        out_json = out / f"{name}.{task}.json"
        argv = peer_lib.argv(peer, config_path, out_json, job, index, hosts)
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

    The extra columns say whether every process ended by itself (else
    which ones the benchmark stopped), and what the peer adds
    (Peer.extra_columns)."""
    leader = _read(peer_tasks[0].out_json)
    outputs = {t.name: _read(t.out_json) for t in peer_tasks}
    peak = {n: o["peak_rss_mb"] for n, o in outputs.items()
            if "peak_rss_mb" in o}
    extra = {"ended_by_itself": "yes" if not stopped else
             "no: stopped " + " ".join(stopped)}
    peer = get(kind)
    if peer.extra_columns is not None:
        extra.update(peer.extra_columns(leader, outputs, peer_tasks))
    return leader, peak, extra
