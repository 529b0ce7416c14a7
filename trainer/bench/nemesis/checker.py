"""The nemesis's checker: judges one schedule's run over its whole
history, against the 1-worker run of the same flags.

Each check returns a list of problems (empty: passed):
  * `parameters`: every parameter and optimizer slot within the
    yardstick of the 1-worker run (largest relative difference, max |a -
    b| / max |a| per variable);
  * `steps`: every step of this run averaged exactly the global batch,
    each example once (the chief's per-step record, averaged_by_step.npy),
    the global step never went back (the chief's progress lines; but
    after a ps killed, see below), and no
    chief restored a checkpoint (a run that starts fresh redoes steps
    only by a restore; allowed after a chief killed inside a write, and
    after a ps killed, which lost its variables);
  * `statuses`: every task ended, with status 0 except one killed or
    stopped for good, one still cut off when the run ended, or a chief
    whose work moved to another worker while it was out of reach (it
    exits 1 with one line);
  * `rejoined`: every worker that came back and stayed up averaged
    examples again within --worker_timeout_secs + REJOIN_SLACK_SECS.
"""

import collections
import datetime
import json
import pathlib
import re

import numpy as np
import tensorflow as tf

from trainer.bench.nemesis import schedule as schedule_lib
from trainer.observe import progress_line
from trainer.sync import step_record

REJOIN_SLACK_SECS = 10.0
_RESTORED = re.compile(r"restored \S+ \(global step \d+\)")
# What a chief logs before it restores because a write was cut short:
# the chief lost inside one, or (with --ps_mirrors) ps 0.
_LOST_INSIDE = ("the last chief was lost inside a write",
                "ps 0 was lost inside a step's write")
RECORD_FILE = step_record.RECORD_FILE
# What a restarted worker logs once it is up and asks to be taken in:
# its return, for the rejoin check (trainer/roles/worker.py).
_ASKED = "asked the chief to take it in"
# What a chief logs once it trains (trainer/roles/chief.py).
_READY = "chief ready at global step"
# What a chief logs as it exits, another worker having taken over its
# work while it was cut off, frozen or starved (trainer/roles/chief.py).
DEPOSED = "took over the chief's work while this chief was out of reach"


def checkpoint_values(logdir: pathlib.Path) -> dict:
    """name -> value of every float variable of the newest checkpoint but
    the protocol's own (sync/*) and the step."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(logdir)))
    names = reader.get_variable_to_shape_map()
    return {name: reader.get_tensor(name) for name in names
            if not name.startswith("sync/") and name != "global_step"}


def largest_difference(reference: dict, values: dict) -> tuple[float, str]:
    """(max over variables of max |a - b| / max |a|, that variable)."""
    worst, where = 0.0, ""
    for name, a in reference.items():
        b = values[name]
        scale = float(np.max(np.abs(a))) or 1.0
        diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) / scale
        if diff > worst:
            worst, where = diff, name
    return worst, where


def parameters(reference: dict, logdir: pathlib.Path,
               yardstick: float) -> tuple[list, float, str]:
    """(problems, largest relative difference, its variable)."""
    try:
        values = checkpoint_values(logdir)
    except (ValueError, tf.errors.OpError, TypeError) as e:
        return [f"no final checkpoint: {e}"], float("nan"), ""
    if values.keys() != reference.keys():
        return [f"checkpoint variables differ: "
                f"{sorted(values.keys() ^ reference.keys())}"], float("nan"), ""
    worst, where = largest_difference(reference, values)
    problems = ([] if worst <= yardstick else
                [f"{where} is {worst:.3g} from the 1-worker run "
                 f"(yardstick {yardstick:g})"])
    return problems, worst, where


def steps(logdir: pathlib.Path, chief_logs: list[str],
          train_steps: int, ps_killed: bool = False) -> list:
    """Per-step averaging (this launch of the chief) and the global step's
    progress in every chief log; a restore passes only after a ps was
    killed (`ps_killed`) or a chief was lost inside a write."""
    problems = []
    path, results_path = logdir / RECORD_FILE, logdir / "results.json"
    if not path.exists() or not results_path.exists():
        problems.append(f"no per-step record ({RECORD_FILE}, results.json)")
    else:
        results = json.loads(results_path.read_text())
        batch = int(results["flags"]["batch_size"])
        # Every step since the last initialize or restore, whichever
        # chief applied it: a step applied twice reads 2.
        first = int(results["record_from"])
        short = step_record.steps_not_once(np.load(path), batch, first,
                                         train_steps)
        if short:
            problems.append(f"{len(short)} steps did not average the global "
                            f"batch exactly once, first {short[:5]}")
    for i, text in enumerate(chief_logs):
        seen = [p["step"] for p in map(progress_line.parse_progress_line,
                                       text.splitlines()) if p]
        # A ps killed lost its variables, or a write was cut short: the
        # restore then takes the step back.
        excused = ps_killed or any(why in text for why in _LOST_INSIDE)
        if not excused and any(b < a for a, b in zip(seen, seen[1:])):
            problems.append(f"the global step went back in the chief's "
                            f"log {i}")
        restored = _RESTORED.search(text)
        if restored and not excused:
            problems.append(f"steps redone: a chief {restored.group(0)} "
                            f"(log {i})")
    return problems


def ps_killed(outcome, mirrored: bool = False) -> bool:
    """Whether a ps task was killed whose variables then existed nowhere
    else: any ps, or with --ps_mirrors two of them (one alone is refilled
    from the copies, and a restore then is steps redone, unless a write
    was cut short, which the chief's log says)."""
    killed = {task for _, _, task, what in outcome.history
              if what == schedule_lib.KILL and task.startswith("ps")}
    return len(killed) > (1 if mirrored else 0)


def deposed(outcome) -> set[str]:
    """The tasks whose latest start ended as a deposed chief (DEPOSED)."""
    found = set()
    for task in outcome.codes:
        logs = sorted(outcome.folder.glob(f"{task}.*.log"),
                      key=lambda p: int(p.suffixes[-2][1:]))
        if logs and DEPOSED in logs[-1].read_text(errors="replace"):
            found.add(task)
    return found


def statuses(codes: dict, faults: list, in_effect: dict,
             stopped_late=(), deposed_chiefs=()) -> list:
    """Every task ended; 0 unless its last fault left it down, it was
    (re)started too late to join and stopped by the nemesis, or it was a
    chief deposed while out of reach (status 1)."""
    problems = []
    for task, code in codes.items():
        if code is None:
            problems.append(f"{task} did not end")
            continue
        if task in stopped_late or (task in deposed_chiefs and code == 1):
            continue
        last = [f for f in faults if f.task == task]
        gone = last and last[-1].kind in (schedule_lib.KILL,
                                          schedule_lib.TERM)
        if code != 0 and not gone and task not in in_effect:
            problems.append(f"{task} exited {code}")
    return problems


def rejoined(outcome, record: np.ndarray | None,
             timeout_secs: float) -> list:
    """Each return of a worker that stayed up, and training with it (its
    last step, not ps 0's exit: 961), until the bound: it is in some
    step's average within timeout_secs + REJOIN_SLACK_SECS. A return ends
    a stop, cut, slow or starve, or is a restarted process asking in.
    The bound's clock stands still while a ps fault is in effect, and
    from a hit on the chief until a chief is ready again: then no worker
    can be taken in (seeds 507, 622). One deposed as chief meanwhile
    exits by design, and is not judged (926)."""
    if record is None:
        return []
    problems, bound = [], timeout_secs + REJOIN_SLACK_SECS
    end = next((t for t, s in outcome.steps_seen if s >= len(record)),
               outcome.ended_at)   # the last step, seen before ps 0 exits
    paused = _merged(_ps_faulted(outcome.history, _ready_times(outcome))
                     + _chief_out(outcome))
    for when, task, what in returns(outcome):
        k = int(task[len("worker"):])
        deadline = _deadline(when, bound, paused, end)
        if deadline > end or any(
                t == task and when < at <= deadline and _is_hit(w)
                for at, _, t, w in outcome.history) or any(
                when < at <= deadline for log in outcome.folder.glob(
                    f"{task}.*.log") for at in _times_of(log, DEPOSED)):
            continue  # the run ended, it was hit again, or it was deposed
        step_then = _step_at(outcome.steps_seen, when)
        step_due = _step_at(outcome.steps_seen, deadline)
        # A restore inside the bound (a ps killed and started again) took
        # the step back: the record holds the steps trained after it.
        step_then = min([step_then] + [
            s for at, s in outcome.steps_seen if when < at <= deadline])
        if not record[step_then:step_due + 1, 1 + k].any():
            problems.append(f"{task} back at step {step_then} ({what}) "
                            f"averaged nothing by step {step_due}, "
                            f"{bound:.0f} s later")
    return problems


def returns(outcome) -> list[tuple[float, str, str]]:
    """(wall time, task, what) of each worker's return: a restarted
    process asking to be taken in (worker 0 too, which joins as a worker
    then), or the end of the last fault in effect on a process that had
    asked by then (one still starting up, or dead,
    is not back from anything; one whose starved CPU came back while its
    link is still cut is not back either)."""
    found, starts, asked = [], {}, {}
    in_effect = collections.defaultdict(collections.Counter)
    for when, _, task, what in outcome.history:
        if task.startswith("ps") or task == "all" or (
                task == "worker0" and starts.get(task, 0) == 0
                and what != "start"):
            # The chief's own returns are not joins: it goes on as the
            # chief, or exits if its work moved (`deposed`); started
            # again, it joins as a worker, and is judged as one.
            continue
        if what == "start":
            starts[task] = starts.get(task, -1) + 1
            asked[task] = _asked_at(
                outcome.folder / f"{task}.{starts[task]}.log")
            if starts[task] > 0 and asked[task] is not None:
                found.append((asked[task], task, "restarted"))
        elif what in ("kill", "term"):
            asked[task] = None
        elif what.startswith("end "):
            in_effect[task][what[len("end "):]] -= 1
            if asked.get(task) is not None and asked[task] <= when \
                    and not +in_effect[task]:
                found.append((when, task, what))
        else:
            in_effect[task][what] += 1
    return found


def _ps_faulted(history: list, ready: list) -> list[tuple[float, float]]:
    """(from, to) wall times while a fault was in effect on a ps task:
    from a hit to its end; from a kill to the next time in `ready`, as a
    chief's: all reconnect, the chief may restore first (seed 914)."""
    spans, since, inf = [], {}, float("inf")
    for when, _, task, what in history:
        if not task.startswith("ps"):
            continue
        if what == schedule_lib.KILL:   # until a chief is ready again
            spans.append((when, next((t for t in ready if t > when), inf)))
        elif _is_hit(what):
            since.setdefault(task, when)
        elif task in since:
            spans.append((since.pop(task), when))
    return spans + [(t, float("inf")) for t in since.values()]


def _chief_out(outcome) -> list[tuple[float, float]]:
    """(from, to) wall times while the schedule's chief could take no one
    in: from a kill to the next `chief ready` line in any worker's log (a
    worker's takeover, or the chief's restart); from any other hit to its
    end. After a takeover the hit task may no longer be the chief: the
    clock then stands still for nothing, which only makes the check
    looser."""
    ready, spans, since, inf = _ready_times(outcome), [], None, float("inf")
    for when, _, task, what in outcome.history:
        if task != schedule_lib.CHIEF:
            continue
        if what == schedule_lib.KILL:   # until a chief is ready again
            spans.append((when, next((t for t in ready if t > when), inf)))
        elif _is_hit(what):
            since = when if since is None else since
        elif what.startswith("end ") and since is not None:
            spans.append((since, when))
            since = None
    return spans + ([(since, inf)] if since is not None else [])


def _ready_times(outcome) -> list[float]:   # every `chief ready` line
    return sorted(t for log in outcome.folder.glob("worker*.log")
                  for t in _times_of(log, _READY))


def _merged(spans: list) -> list[tuple[float, float]]:
    """The union of spans, as spans that do not overlap."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _deadline(when: float, bound: float, paused: list,
              ended_at: float) -> float:
    """when + bound, plus the time inside `paused` from `when` on (the
    deadline once past ended_at is past it: the caller skips it)."""
    deadline = when + bound
    while deadline <= ended_at:
        later = when + bound + _overlap(paused, when, deadline)
        if later <= deadline:
            break
        deadline = later
    return deadline


def _overlap(spans: list, start: float, end: float) -> float:
    """Seconds of [start, end] inside any of `spans` (none overlap)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def _is_hit(what: str) -> bool:
    return not what.startswith("end ") and what != "start"


_ABSL_TIME = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+)")


def _asked_at(log: pathlib.Path) -> float | None:
    """The wall time of the log's first 'asked the chief' line."""
    return next(iter(_times_of(log, _ASKED)), None)


def _times_of(log: pathlib.Path, text: str) -> list[float]:
    """The wall times of the log's lines holding `text` (absl's local
    time; the year is this one)."""
    if not log.exists():
        return []
    found = []
    for line in log.read_text(errors="replace").splitlines():
        match = _ABSL_TIME.match(line) if text in line else None
        if match:
            month, day, clock = match.groups()
            stamp = datetime.datetime.strptime(
                f"{datetime.date.today().year}-{month}-{day} {clock}",
                "%Y-%m-%d %H:%M:%S.%f")
            found.append(stamp.timestamp())
    return found


def _step_at(steps_seen: list, when: float) -> int:
    """The chief's step last seen at wall time `when`."""
    step = 0
    for seen_at, seen in steps_seen:
        if seen_at > when:
            break
        step = seen
    return step
