"""One process of one peer: `python -m trainer.bench.baselines KIND ...`.

    single CONFIG.json OUT.json
    mwms   CONFIG.json OUT.json INDEX WORKER_HOSTS
    sro    CONFIG.json OUT.json JOB INDEX PS_HOSTS WORKER_HOSTS
    async  CONFIG.json OUT.json JOB INDEX PS_HOSTS WORKER_HOSTS CHIEF_HOST
    async_split  (the same arguments as async)

CONFIG.json holds a TrainConfig's fields; OUT.json gets the results; hosts
are comma-separated host:port lists. The benchmark writes these lines
(trainer/bench/runs.py); they are not a user interface.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import logging  # noqa: E402

from trainer.common.config import TrainConfig  # noqa: E402

KINDS = ("single", "mwms", "sro", "async", "async_split")


def main(argv: list[str]) -> int:
    kind, config_path, out_path = argv[1:4]
    config = TrainConfig(**json.loads(pathlib.Path(config_path).read_text()))
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    rest = argv[4:]
    # Each kind imports TensorFlow its own way; import only the one run.
    if kind == "single":
        from trainer.bench.baselines import single
        single.run_single_process(config, out_path)
    elif kind == "mwms":
        from trainer.bench.baselines import mwms
        mwms.run_mwms_worker(config, out_path, int(rest[0]),
                             rest[1].split(","))
    elif kind == "sro":
        from trainer.bench.baselines import sro
        sro.run_sro_task(config, out_path, rest[0], int(rest[1]),
                         rest[2].split(","), rest[3].split(","))
    elif kind in ("async", "async_split"):
        from trainer.bench.baselines import async_ps
        async_ps.run_async_task(config, out_path, rest[0], int(rest[1]),
                                rest[2].split(","), rest[3].split(","),
                                rest[4], split=kind == "async_split")
    else:
        raise SystemExit(f"unknown baseline {kind!r}; use one of "
                         f"{', '.join(KINDS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
