"""Runs every schedule of a nemesis command and prints its rows.

Simulated hosts are made once for all schedules and removed at the end,
also on an error or Ctrl-C (SimulatedHosts is a context manager); on
loopback every schedule gets fresh free ports.
"""

import contextlib
import json
import socket
import time

from absl import logging

from trainer.bench.nemesis import checker
from trainer.bench.nemesis import run as run_lib
from trainer.bench.nemesis import schedule as schedule_lib

ROWS_FILE = "nemesis.json"
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
    """One row per schedule (see trainer/nemesis.py for the callables),
    each also written to <out>/ROWS_FILE as it is judged, so that the rows
    of an interrupted command are kept."""
    reference = checker.checkpoint_values(run_lib.reference_logdir(
        setup, out, [], timeout=flags.run_secs))
    rows = []
    mirrored = schedule_lib.ps_mirrored(flags.train_flags)
    with _hosts(flags.hosts == "simulated") as sim:
        for i in range(flags.schedules):
            seed = flags.seed + i
            if flags.schedule:
                faults = schedule_lib.parse(flags.schedule, mirrored)
            elif flags.covering:
                faults = schedule_lib.covering(
                    seed, setup.workers, flags.train_steps, kinds,
                    flags.max_fault_secs)
            else:
                faults = schedule_lib.draw(
                    seed, setup.workers, flags.train_steps, flags.faults,
                    kinds, flags.max_fault_secs, flags.chief_faults,
                    setup.ps if flags.ps_faults else 0, mirrored)
            started = time.monotonic()
            outcome = run_lib.run_schedule(
                setup, faults, out / f"schedule-{seed}", sim,
                None if sim else free_ports(setup.ps + setup.workers))
            verdict = judge(outcome, faults, reference)
            row = {"seed": seed, **verdict,
                   "faults": [f.describe() for f in faults],
                   "out_when": out_when(outcome),
                   "steps": max([s for _, s in outcome.steps_seen] or [0]),
                   "secs": round(time.monotonic() - started, 1),
                   "codes": outcome.codes, "replay": replay_command(seed)}
            rows.append(row)
            (out / ROWS_FILE).write_text(json.dumps(rows, indent=2))
            logging.info("schedule %d of %d:\n%s", i + 1, flags.schedules,
                         format_row(row))
    return rows


def format_row(row: dict) -> str:
    """A schedule's line of the table, then one line per problem."""
    lines = [f"{row['seed']:>5}  {'pass' if row['passed'] else 'FAIL':7}  "
             f"{row['difference']:>10.3g}  {row['steps']:>5}  "
             f"{row['secs']:>5.0f}  {', '.join(row['faults'])} | "
             f"{row['out_when']}"]
    return "\n".join(lines + [f"{'':>7}{p}" for p in row["problems"]])


def table(rows: list[dict]) -> str:
    """The command's result: a row per schedule, the count, and the replay
    command of each failing schedule."""
    failed = [r for r in rows if not r["passed"]]
    if not rows:
        return "no schedule was judged"
    lines = [HEADER, *map(format_row, rows),
             f"{len(rows) - len(failed)} of {len(rows)} schedules passed; "
             f"worst difference {max(r['difference'] for r in rows):.3g}"]
    lines += [f"schedule {r['seed']} failed: {r['problems'][0]}\n"
              f"  replay: {r['replay']}" for r in failed]
    return "\n".join(lines)
