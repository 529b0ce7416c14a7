"""What a peer declares, and the command line of its processes.

A peer is one module of this package that defines `PEER = Peer(...)` (what
the benchmark must start and how it ends), `run_task(config, out_path,
job, index, hosts)` (one of its processes) and, at its end,

    if __name__ == "__main__":
        sys.exit(peer.main(PEER, run_task))

The benchmark finds every such module (trainer/bench/peers.py) and starts
each process as

    python -m trainer.bench.baselines.<module> CONFIG.json OUT.json JOB INDEX HOSTS

CONFIG.json holds a TrainConfig's fields, OUT.json gets the process's
results, and HOSTS is a JSON object, job -> [host:port]. `argv` writes that
line and `main` reads it: the layout lives here only. It is not a user
interface.
"""

import dataclasses
import json
import pathlib
import sys
from typing import Callable, Optional

from absl import logging

from trainer.common.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Peer:
    """A peer's declaration: what its runs need from the benchmark."""

    name: str            # its --baselines value, and its runs' kind
    order: int           # its place in the benchmark's plan and tables
    label: str           # a run's label; "{}" gets the worker count
    help: str            # a phrase for --baselines' help
    ps: bool = False     # it starts --num_ps ps tasks
    # A "chief" process (a coordinator) that leads; else worker 0 leads.
    coordinator: bool = False
    # Every process ends by itself once training is done. If not (servers
    # that only join()), the benchmark stops the others once the leader
    # has ended, and says so in the run's row.
    ends_by_itself: bool = True
    # (leader's results, {task name: results}, [PeerTask]) -> columns that
    # only this peer has; None for none.
    extra_columns: Optional[Callable] = None
    # The module that declares it, set when the benchmark finds it
    # (trainer/bench/peers.py): what `argv` runs.
    module: str = ""

    def series_label(self) -> str:
        """Its line in the benchmark's chart (trainer/bench/report.py),
        which spans worker counts: the label without the count."""
        return self.label.replace(", {} worker(s)", "").replace("{}", "N")

    def ps_tasks(self, num_ps: int) -> int:
        """ps tasks a run starts with --num_ps."""
        return num_ps if self.ps else 0

    def roles(self, workers: int, num_ps: int) -> list[tuple[str, int]]:
        """(job, index) of every process of a run, the leader first."""
        leader = [("chief", 0)] if self.coordinator else []
        return (leader + [("worker", k) for k in range(workers)]
                + [("ps", i) for i in range(self.ps_tasks(num_ps))])


def argv(peer: Peer, config_path: pathlib.Path, out_json: pathlib.Path,
         job: str, index: int, hosts: dict) -> list[str]:
    """The command line (after the python executable) of one process."""
    return ["-m", peer.module, str(config_path), str(out_json), job,
            str(index), json.dumps(hosts, sort_keys=True)]


def start_process(config_path: str) -> TrainConfig:
    """A benchmark process's start: absl logging to stderr, and the
    TrainConfig the benchmark wrote to config_path."""
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    return TrainConfig(**json.loads(pathlib.Path(config_path).read_text()))


def main(peer: Peer, run_task: Callable, args: list[str] = None) -> int:
    """Runs the process that `argv` describes (sys.argv by default)."""
    config_path, out_path, job, index, hosts = (args or sys.argv)[1:6]
    run_task(start_process(config_path), out_path, job, int(index),
             json.loads(hosts))
    return 0
