"""Fault schedules: which fault hits which task at which step, drawn from
a seed, so that any schedule can be replayed from its seed alone.

A schedule is a list of `Fault`s. Faults may overlap, also on one worker
(a worker paused while its link is down). The targets are the workers
other than the chief, and with `chief=True` worker 0 too: the chief at the
start, whose work then moves to another worker (trainer/roles/takeover.py).
SIGTERM is not among the chief's faults: it stops the whole run on
purpose (a checkpoint, then every task; the launcher's Ctrl-C), and a
term drawn for a worker that does the chief's work by then is not sent
(trainer/bench/nemesis/cluster.py). With `ps` ps tasks (ps > 0) one
fault of a schedule of two or more hits a ps task, in the place of a
worker's fault but never of the chief's only one (so a schedule of one
fault has none on a ps): a kill is undone by a restart (a ps lost for
good ends the run until it is back: its shards exist nowhere else), but
with --ps_mirrors (`lost_for_good`) a ps other than ps 0 may stay down as
a worker may (the run goes on without it: trainer/roles/without_ps.py);
term is not drawn.
"""

import dataclasses
import random

# The fault kinds. Each one hits a task at a step and (but for kill and
# term that are never undone) is undone after `secs`:
#   kill:  SIGKILL; the same command starts again after `secs` (None: never)
#   term:  SIGTERM (preemption); started again after `secs` (None: never)
#   stop:  SIGSTOP, then SIGCONT after `secs`
#   cut:   the host's link down, up again after `secs`
#   slow:  the host's link at SLOW_RATE for `secs`
#   starve: the host's CPU at STARVE_CORES for `secs`
KILL, TERM, STOP, CUT, SLOW, STARVE = ("kill", "term", "stop", "cut",
                                      "slow", "starve")
KINDS = (KILL, TERM, STOP, CUT, SLOW, STARVE)
# Kinds that need simulated hosts (root): a link or a CPU budget.
HOST_KINDS = (CUT, SLOW, STARVE)
SLOW_RATE = "1mbit"
STARVE_CORES = 0.05
# How long each kind lasts (seconds, drawn uniformly); the cut spans
# both sides of a --worker_timeout_secs of 10 s.
DURATION = {KILL: (1.0, 20.0), TERM: (1.0, 20.0), STOP: (1.0, 30.0),
            CUT: (1.0, 40.0), SLOW: (2.0, 20.0), STARVE: (2.0, 20.0)}
# The share of kills and terms whose task is never started again.
NEVER_BACK = 0.25
CHIEF = "worker0"
CHIEF_KINDS = tuple(k for k in KINDS if k != TERM)
PS_KINDS = CHIEF_KINDS


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: `kind` hits `task` ("worker2") once the chief has logged
    step `at_step`, and is undone `secs` later (None: never)."""

    kind: str
    task: str
    at_step: int
    secs: float | None

    def describe(self) -> str:
        lasting = "never back" if self.secs is None else f"{self.secs:.0f} s"
        return f"{self.kind} {self.task} @{self.at_step} ({lasting})"


def ps_mirrored(train_flags: list[str]) -> bool:
    """Whether the runs train with --ps_mirrors."""
    return any(f in ("--ps_mirrors", "--ps_mirrors=true")
               for f in train_flags)


def draw(seed: int, workers: int, train_steps: int, faults: int,
         kinds=KINDS, max_secs: float | None = None,
         chief: bool = False, ps: int = 0,
         lost_for_good: bool = False) -> list[Fault]:
    """`faults` faults of random kinds on workers 1..workers-1, sorted by
    step, none lasting over max_secs; the same arguments give the same
    list. With `chief`, worker 0 too, at least once, by a kind of
    CHIEF_KINDS (if `kinds` has one). With `ps` > 0 and more than one
    fault, exactly one of them on one of `ps` ps tasks instead, by a kind
    of PS_KINDS (if `kinds` has one), never in the place of the chief's
    only fault: a schedule of one fault has no ps fault."""
    rng = random.Random(seed)
    drawn = [_one(rng, rng.choice(list(kinds)), workers, train_steps,
                  max_secs, chief) for _ in range(faults)]
    chief_kinds = [k for k in kinds if k in CHIEF_KINDS]
    if chief and drawn and chief_kinds and all(
            f.task != CHIEF for f in drawn):
        # Every schedule hits the chief at least once.
        first = _one(rng, rng.choice(chief_kinds), workers, train_steps,
                     max_secs)
        drawn[0] = dataclasses.replace(first, task=CHIEF)
    ps_kinds = [k for k in kinds if k in PS_KINDS]
    if ps and len(drawn) > 1 and ps_kinds:
        drawn[_ps_slot(drawn)] = _ps_fault(
            rng, rng.choice(ps_kinds), workers, train_steps, max_secs, ps,
            lost_for_good)
    return _sorted(drawn)


def _ps_slot(drawn: list[Fault]) -> int:
    """The index of the fault (of >= 2) a ps fault takes the place of:
    the last one, or the one before it where the last is the only fault
    on the chief."""
    on_chief = [f for f in drawn if f.task == CHIEF]
    if len(on_chief) == 1 and drawn[-1].task == CHIEF:
        return len(drawn) - 2
    return len(drawn) - 1


def _ps_fault(rng: random.Random, kind: str, workers: int,
              train_steps: int, max_secs: float | None, ps: int,
              lost_for_good: bool) -> Fault:
    """A fault of `kind` on ps 0..ps-1, undone after its secs; a kill
    drawn as never back (drawn alike either way, so that a seed's
    schedule stays) is never back only with `lost_for_good`, on a ps
    other than ps 0."""
    fault = _one(rng, kind, workers, train_steps, max_secs)
    secs = fault.secs
    if secs is None:
        secs = round(rng.uniform(*_bounds(KILL, max_secs)), 1)
    index = rng.randrange(ps)
    if fault.secs is None and lost_for_good and index > 0:
        secs = None
    return dataclasses.replace(fault, task=f"ps{index}", secs=secs)


def covering(seed: int, workers: int, train_steps: int, kinds=KINDS,
             max_secs: float | None = None) -> list[Fault]:
    """One fault of every kind in `kinds` (the suite's short schedules),
    on random workers at random steps."""
    rng = random.Random(seed)
    return _sorted([_one(rng, kind, workers, train_steps, max_secs)
                    for kind in kinds])


def _one(rng: random.Random, kind: str, workers: int, train_steps: int,
         max_secs: float | None, chief: bool = False) -> Fault:
    """A fault of `kind` at a step in the first half of the run (so that
    a worker that comes back has steps left to rejoin in)."""
    if workers < 2:
        raise ValueError("a fault schedule needs a worker besides the chief")
    first = 0 if chief and kind in CHIEF_KINDS else 1
    secs = round(rng.uniform(*_bounds(kind, max_secs)), 1)
    if kind in (KILL, TERM) and rng.random() < NEVER_BACK:
        secs = None
    last = max(11, int(0.5 * train_steps))
    return Fault(kind, f"worker{rng.randrange(first, workers)}",
                 rng.randrange(10, last), secs)


def _bounds(kind: str, max_secs: float | None) -> tuple[float, float]:
    """The (low, high) seconds a fault of `kind` lasts, capped by
    max_secs."""
    low, high = DURATION[kind]
    if max_secs is not None:
        high = min(high, max_secs)
        low = min(low, high)
    return low, high


def _sorted(faults: list[Fault]) -> list[Fault]:
    return sorted(faults, key=lambda f: (f.at_step, f.task, f.kind))


def parse(text: str, lost_for_good: bool = False) -> list[Fault]:
    """A hand-written schedule: "kind:task:step:secs" items, comma
    separated ("never" for secs: not undone), e.g. "cut:worker1:100:30".
    lost_for_good: a ps other than ps 0 may be killed for good
    (--ps_mirrors). Raises ValueError naming the item and the form."""
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        parts = item.split(":")
        try:
            kind, task, step, secs = parts
            fault = Fault(kind, task, int(step),
                          None if secs == "never" else float(secs))
        except ValueError:
            raise ValueError(f"bad fault {item!r}; write kind:task:step:secs"
                             ", e.g. cut:worker1:100:30") from None
        if not _allowed(fault, lost_for_good):
            raise ValueError(f"bad fault {item!r}: the kind is one of "
                             f"{', '.join(KINDS)} and the task worker0, "
                             f"worker1, ... (worker0, the chief: "
                             f"{', '.join(CHIEF_KINDS)}), or ps0, ps1, "
                             f"... ({', '.join(PS_KINDS)}; a kill comes "
                             "back, but for a ps other than ps 0 with "
                             "--ps_mirrors)")
        faults.append(fault)
    return _sorted(faults)


def _allowed(fault: Fault, lost_for_good: bool) -> bool:
    job = fault.task.rstrip("0123456789")
    index = fault.task[len(job):]
    if fault.kind not in KINDS or not index.isdigit():
        return False
    if job == "ps":
        return fault.kind in PS_KINDS and (fault.secs is not None or (
            lost_for_good and fault.kind == KILL and int(index) > 0))
    return job == "worker" and (fault.task != CHIEF
                                or fault.kind in CHIEF_KINDS)
