"""Workers other than the chief: wait for it, join, then push a gradient
for each slice it hands out (step.WorkerStep; reconnects: run.py)."""

import time

from absl import logging

from trainer.common.errors import RunFailed
from trainer.observe import tracing
from trainer.roles import liveness, timing, watchdog as watchdog_lib
from trainer.roles.lifecycle import WorkerRole, poll_until
from trainer.roles.states import Event, Kind
from trainer.saving import storage
from trainer.sync import state


class Worker(WorkerRole):
    judge: liveness.Judge | None = None   # the chief watch's, once made

    def run_connected(self) -> None:
        """Joins, then computes each slice handed out, to the end or STOP."""
        h = self.g.handles
        self._wait_for_chief()
        loop = self.loop_callable()   # placed on every task beforehand
        with self._watchdog() as dog, liveness.watch_chief(self):
            token = self._join(dog)
            while True:
                step = self.at_step = int(token[0])
                if step == state.REJOIN:  # a restarted chief
                    token = self._join(dog)
                    continue
                if not 0 <= step < self.train_steps:
                    break
                with dog.busy():
                    out = loop(token, self.config.log_every)
                self.last_progress = time.monotonic()
                self.pushed += int(out["steps_done"])
                token = out["next_token"]
                logging.info("worker %d: global step %d, %d gradients pushed",
                             self.k, max(int(token[0]), 0), self.pushed)
        if step == state.STOP:
            reason = self.session.run(h.stop_reason).decode()
            raise RunFailed(f"the chief stopped the run: {reason}")
        tracing.write_traces(self.traces, self.config.logdir, self.k, False)
        self.session.run(h.finish_op, {h.pushed_in: self.pushed})
        logging.info("worker %d finished: %d gradients pushed", self.k,
                     self.pushed)
        self.close_session()

    def _watchdog(self) -> watchdog_lib.Watchdog:
        """Posts STALLED when the global step stays put for
        --startup_timeout_secs (cut off, or a stopped chief); PS_BACK when
        ps 0 answers after --worker_timeout_secs: the chief counted us out."""
        h, cluster = self.g.handles, self.task.cluster
        timeout = self.config.startup_timeout_secs

        def read_progress():
            session, _ = self.session_and_graph()
            if session is None:
                raise RunFailed("no session")
            step, admitted = session.run([h.global_step, h.admitted])
            return int(step), list(admitted)

        def describe_missing(admitted) -> str:
            missing = [cluster.describe("worker", k)
                       for k, flag in enumerate(admitted)
                       if not flag and k != self.k]
            return ", ".join(missing) or "the chief to apply the step"

        def on_timeout(at, who) -> None:
            chief = cluster.describe(
                "worker", self.judge.chief if self.judge else 0)
            self.machine.post(Event(Kind.STALLED, (
                f"{'global step ' + str(at) if at is not None else 'training'}"
                f" did not move for {timeout:.0f} s (--startup_timeout_secs),"
                f" waiting for {who}; is the chief, {chief}, running?")))

        def on_return(outage_secs: float) -> None:
            self.machine.post(Event(Kind.PS_BACK, (
                f"ps 0 answers again after {outage_secs:.0f} s; joining "
                "again (the chief counted us out meanwhile)")))
        return watchdog_lib.Watchdog(
            read_progress, describe_missing, timeout, on_timeout,
            f"{cluster.describe('ps', 0)}, which does not answer",
            "--startup_timeout_secs", on_return=on_return,
            return_after_secs=self.config.worker_timeout_secs)

    def _join(self, dog):
        """Asks the chief in; the first token (int64 [4]). Asks again while
        the roster lacks us (our old self's LOST may overtake an ask)."""
        h = self.g.handles
        self.session.run(h.join_op)
        logging.info("worker %d asked the chief to take it in", self.k)
        start = asked = time.monotonic()
        with dog.busy():
            while not self.session.run(h.tokens_waiting):
                now = time.monotonic()
                if now - start > self.config.startup_timeout_secs:
                    raise RunFailed(
                        "the chief did not take this worker in within "
                        f"{self.config.startup_timeout_secs:.0f} s "
                        "(--startup_timeout_secs)")
                if (now - asked > timing.JOIN_AGAIN_SECS
                        and not self.session.run(h.roster)[self.k]):
                    self.session.run(h.join_op)
                    asked = now
                time.sleep(timing.POLL_SECS / 5)
            token = self.session.run(h.next_token)
        logging.info("worker %d joined at global step %d", self.k,
                     max(int(token[0]), 0))
        self.in_the_run.set()
        self.graphs.prebuild(self.g)
        return token

    def leave(self) -> None:
        """On SIGTERM: tells the chief we leave, so that it does not wait
        out a timeout for our gradient (any thread; failures logged)."""
        session, g = self.session_and_graph()
        try:
            if session is not None:
                session.run(g.handles.leave_op)
        except Exception as e:  # noqa: BLE001 (leaving anyway)
            logging.warning("could not tell the chief: %s", e)

    def _wait_for_chief(self) -> None:
        """The handshake (sync/coordination.py): ready, then settings."""
        first = self.task.cluster.describe("worker", 0)
        timeout = self.config.startup_timeout_secs
        poll_until(
            lambda: self.session.run(self.g.handles.ready), timeout,
            lambda secs: f"waiting for the chief to initialize the variables:"
                         f" {secs:.0f} s",
            lambda: f"no chief initialized the variables within {timeout:.0f}"
                    f" s (--startup_timeout_secs); start {first} or check "
                    "--worker_hosts")
        storage.warn_if_elsewhere(self.config.logdir, lambda: self.session.run(
            self.g.coord.read_storage_word))
        chiefs = self.session.run(self.g.handles.chief_fingerprint).decode()
        if chiefs != self.g.coord.fingerprint:
            theirs, ours = _first_difference(chiefs, self.g.coord.fingerprint)
            raise RunFailed(
                f"this worker's settings differ from the chief's: chief has "
                f"'{theirs}', this worker has '{ours}'; start every "
                "task with the same cluster and training flags")


def _first_difference(a: str, b: str) -> tuple[str, str]:
    for x, y in zip(a.split(), b.split()):
        if x != y:
            return x, y
    return a, b
