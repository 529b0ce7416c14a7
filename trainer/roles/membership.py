"""The chief's membership watch (docs/how-it-works.md, Membership), a
thread beside its blocked loop: a worker with a slice outstanding (`late`)
silent since its last push of any round, by liveness.lost, is reported
LOST; roster changes are logged, kept on ps 0 and written to TensorBoard."""

import dataclasses
import json
import time
from typing import Callable

from absl import logging
import numpy as np

from trainer.common.tf_session import error_summary
from trainer.observe import summaries
from trainer.roles import ending, liveness, timing
from trainer.roles.background import BackgroundThread
from trainer.roles.watchdog import BoundedRead
from trainer.sync.state import EVENT_NAMES, LEAVING


@dataclasses.dataclass
class _Round:
    step: int
    round: int
    planned: np.ndarray    # bool [N]
    admitted: np.ndarray   # bool [N]
    roster: np.ndarray     # bool [N]
    slices: np.ndarray     # int64 [N, 2]
    last_push: np.ndarray  # int64 [N]: the round of each one's last push
    issued_round: np.ndarray  # int64 [N]: the round of each one's last token


def watch(chief, writer) -> "MembershipWatch":
    """The watch on `chief`'s session: it reads the round, takes the roster
    changes, reports a worker lost with `lost_op` (a LOST on sync/events:
    the rule acts on it, averaging.decide) and keeps its log on ps 0 for
    the next chief; each write only in its generation (graph.py)."""
    ops, handles, session = chief.g.chief, chief.g.handles, chief.session
    read = chief.callable({
        "step": handles.global_step, "round": handles.round,
        "planned": handles.planned, "admitted": handles.admitted,
        "roster": ops.roster, "slices": ops.slices,
        "last_push": ops.last_push, "issued_round": ops.issued_round})
    log, mine = ops.membership_log, {ops.generation: chief.generation}
    kept = json.loads(session.run(log.read).decode() or "[]")

    def keep(records: list) -> None:
        session.run(log.write, {log.value_in: json.dumps(records), **mine})
    return MembershipWatch(
        read, lambda: session.run(ops.membership, mine),
        lambda k: session.run(ops.lost_op, {ops.lost_in: k, **mine}),
        chief.task.cluster, chief.config, writer,
        on_unreachable=lambda step, who: ending.on_ps0_silent(
            chief, step, who), chief=chief.k, kept=(kept, keep))


class MembershipWatch(BackgroundThread):
    """A thread beside the chief's training runs (a context manager)."""

    def __init__(self, read: Callable, take_records: Callable,
                 report_lost: Callable[[int], None], cluster, config, writer,
                 on_unreachable: Callable[[int | None, str], None],
                 chief: int = 0, kept: tuple = ([], None)):
        """read: () -> _Round's fields (numpy); take_records: () -> (step,
        kind, worker, members) arrays; report_lost(k) sends LOST; writer:
        a FileWriter or None; chief: its index (never lost); kept: (records
        so far, keep(records) storing them on ps 0), to outlive this chief."""
        every = timing.MEMBERSHIP_CHECK_SECS
        super().__init__("membership", every, every * 8)
        self._bounded_read = BoundedRead(lambda: _Round(**read()))
        self._take, self._report_lost = take_records, report_lost
        self._cluster, self._config, self._writer = cluster, config, writer
        self._on_unreachable = on_unreachable
        self._chief, self._refuses = chief, liveness.port_refuses(cluster)
        # {"step", "event", "worker", "workers"}, this run's so far
        self.records, self._keep = list(kept[0]), kept[1]
        self._unkept = False     # records taken but not kept on ps 0
        self.reasons = {}        # worker -> why we reported it lost
        # worker -> (its last push's round, when that changed, reported)
        self._heard, self._failing_since = {}, None
        self._logged_step, self._last = -1, time.monotonic()
        self.slices = None       # each worker's examples in the last round

    def __exit__(self, kind, *rest):
        # A failed run may have stopped ps 0 already (a halt saves, then
        # stops the ps tasks): the last take's error must not hide its own.
        try:
            self.stop()
            self.take_records()   # what the last rounds recorded
        except Exception as e:  # noqa: BLE001 (re-raised on a clean exit)
            if kind is None:
                raise
            logging.warning("the last roster changes are not logged (ps 0 "
                            "did not answer: %s)", error_summary(e))

    def write_last_slices(self) -> None:
        """The last round's slices, at the run's end, once stopped: a short
        run may end between checks, or slow reads kept each from writing."""
        try:
            state = self._bounded_read()
        except TimeoutError:
            logging.warning("the last round's slices are not in TensorBoard:"
                            " ps 0 did not answer within %.0f s",
                            timing.READ_DEADLINE_SECS)
            return
        if state.step != self._logged_step:
            self._note_slices(state, always=True)

    def take_records(self) -> None:
        """Keeps on ps 0, then logs, the roster changes recorded so far (a
        change logged is kept, whatever happens to this chief next)."""
        changes = [tuple(int(x) for x in change)
                   for change in zip(*self._take())]
        self.records += [{"step": step, "event": EVENT_NAMES[kind],
                          "worker": worker, "workers": count}
                         for step, kind, worker, count in changes]
        self._unkept = self._unkept or bool(changes)
        if self._unkept and self._keep is not None:
            self._keep(self.records)   # raises if ps 0 did not answer
            self._unkept = False
        for change in changes:
            self._log_change(*change)

    def _log_change(self, step, kind, worker, count) -> None:
        event = EVENT_NAMES[kind]
        why = ("; it was stopped (SIGTERM)" if kind == LEAVING
               else self.reasons.pop(worker, "") if event == "left" else "")
        carry = "1 worker carries" if count == 1 else f"{count} workers carry"
        logging.info("%s %s at step %d%s; %s the global batch of %d",
                     self._cluster.describe("worker", worker), event, step,
                     why, carry, self._config.batch_size)
        summaries.write_scalars(self._writer, step,
                               {"membership/workers": count})

    def run_once(self) -> bool | None:
        """One check of the round; False once ps 0 was given up on."""
        now = time.monotonic()
        if now - self._last > timing.STALL_SECS:
            # This process did not run (stopped, swapped out): that time
            # is not the workers' silence.
            self._heard, self._failing_since = {}, None
        self._last = now
        try:
            state = self._bounded_read()
            self.take_records()
        except Exception:  # noqa: BLE001 (any failure: no answer)
            self._failing_since = self._failing_since or now
            if now - self._failing_since >= self._config.worker_timeout_secs:
                self._on_unreachable(None, self._cluster.describe(
                    "ps", 0) + ", which does not answer")
                return False
            return None
        self._failing_since = None
        self._note_slices(state)
        for k in late(state, self._chief):
            self._check_silent(k, state, now)
        return None

    def _check_silent(self, k: int, state: _Round, now: float) -> None:
        pushed, since, reported = self._heard.get(k, (None, now, False))
        if state.last_push[k] != pushed:
            pushed, since, reported = state.last_push[k], now, False
        self._heard[k] = (pushed, since, reported)
        why = None if reported else liveness.lost(
            now - since, self._config.worker_timeout_secs,
            "--worker_timeout_secs", "gradient", lambda: self._refuses(k))
        if why is not None:
            self.reasons[k] = f" ({why})"
            self._heard[k] = (pushed, since, True)
            self._report_lost(k)

    def _note_slices(self, state: _Round, always: bool = False) -> None:
        """Keeps the round's slices; writes them each --log_every steps."""
        if not state.planned.any():
            return
        sizes = state.slices[:, 1] - state.slices[:, 0]
        self.slices = [int(n) for n in sizes * state.planned]
        step, every = state.step, self._config.log_every
        if self._writer is None or (
                not always and step // every == self._logged_step // every):
            return
        summaries.write_scalars(self._writer, step, {
            f"membership/slice_{k}": n for k, n in enumerate(self.slices)})
        self._logged_step = step


def late(state: _Round, chief: int) -> list[int]:
    """Workers in the roster (not `chief`) with a slice outstanding: the
    round's members that have not pushed, and any given a token since its
    last push (a probe, or a member benched by a round's deadline: only
    this finds it if it died)."""
    return [k for k in range(len(state.planned))
            if k != chief and state.roster[k] and (
                (state.planned[k] and not state.admitted[k])
                or state.last_push[k] < state.issued_round[k])]
