"""async_split: ParameterServerStrategy as in async_ps.py, each update on
global batch / N examples and N times as many updates, so the examples
seen in all equal the trainer's (async_ps.py's docstring says more)."""

import dataclasses
import sys

from trainer.bench.baselines import async_ps
from trainer.bench.baselines import peer
from trainer.common.config import TrainConfig

PEER = dataclasses.replace(
    async_ps.PEER, name="async_split", order=4,
    label="ParameterServerStrategy (async, global batch / N per update), "
          "{} worker(s)",
    help="async_split (each update on global batch / N, N times as many "
         "updates)")


def run_task(config: TrainConfig, out_path: str, job: str, index: int,
             hosts: dict) -> None:
    """One process of the split variant."""
    async_ps.run_task(config, out_path, job, index, hosts, split=True)


if __name__ == "__main__":
    sys.exit(peer.main(PEER, run_task))
