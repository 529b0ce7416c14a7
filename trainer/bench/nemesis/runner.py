"""Runs every schedule of a nemesis command and prints its rows.

Simulated hosts are made once for all schedules and removed at the end,
also on an error or Ctrl-C (SimulatedHosts is a context manager); on
loopback every schedule gets fresh free ports.
"""

import contextlib
import socket
import time

from trainer.bench.nemesis import checker
from trainer.bench.nemesis import run as run_lib
from trainer.bench.nemesis import schedule as schedule_lib

HEADER = (f"{'seed':>5}  {'verdict':7}  {'difference':>10}  {'steps':>5}  "
          f"{'secs':>5}  faults / who was out when")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("localhost", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _hosts(simulated: bool):
    if not simulated:
        return contextlib.nullcontext(None)
    from trainer.bench.simhosts import hosts  # noqa: PLC0415 (root only)
    return hosts.SimulatedHosts()


def run_all(setup: run_lib.Setup, kinds, out, flags, judge, out_when,
            replay_command) -> list[dict]:
    """One row per schedule (see trainer/nemesis.py for the callables)."""
    reference = checker.checkpoint_values(run_lib.reference_logdir(
        setup, out, [], timeout=flags.run_secs))
    rows = []
    print(HEADER, flush=True)
    with _hosts(flags.hosts == "simulated") as sim:
        for i in range(flags.schedules):
            seed = flags.seed + i
            if flags.schedule:
                faults = schedule_lib.parse(flags.schedule)
            elif flags.covering:
                faults = schedule_lib.covering(
                    seed, setup.workers, flags.train_steps, kinds,
                    flags.max_fault_secs)
            else:
                faults = schedule_lib.draw(
                    seed, setup.workers, flags.train_steps, flags.faults,
                    kinds, flags.max_fault_secs)
            started = time.monotonic()
            outcome = run_lib.run_schedule(
                setup, faults, out / f"schedule-{seed}", sim,
                None if sim else free_ports(setup.workers + 1))
            verdict = judge(outcome, faults, reference)
            row = {"seed": seed, **verdict,
                   "faults": [f.describe() for f in faults],
                   "out_when": out_when(outcome),
                   "steps": max([s for _, s in outcome.steps_seen] or [0]),
                   "secs": round(time.monotonic() - started, 1),
                   "codes": outcome.codes, "replay": replay_command(seed)}
            rows.append(row)
            print(f"{seed:>5}  {'pass' if row['passed'] else 'FAIL':7}  "
                  f"{row['difference']:>10.3g}  {row['steps']:>5}  "
                  f"{row['secs']:>5.0f}  {', '.join(row['faults'])} | "
                  f"{row['out_when']}", flush=True)
            for problem in row["problems"]:
                print(f"{'':>7}{problem}", flush=True)
    return rows
