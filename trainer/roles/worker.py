"""Workers other than the chief: wait for the chief, join, then compute
and push a gradient for every slice the chief hands out, to the end (a
step: step.py's `WorkerStep`; connecting, reconnecting: lifecycle.py)."""

import time

from absl import logging

from trainer.common.errors import RunFailed
from trainer.observe import tracing
from trainer.roles import takeover
from trainer.roles import watchdog as watchdog_lib
from trainer.saving import storage
from trainer.roles import timing
from trainer.roles.lifecycle import WorkerRole, poll_until
from trainer.roles.states import Event, Kind
from trainer.sync import state


class Worker(WorkerRole):
    judge: takeover.Judge | None = None   # the chief watch's, once made

    def run_connected(self) -> None:
        """Joins, then computes every slice the chief hands out, to the
        end (or the chief's STOP)."""
        h = self.g.handles
        self._wait_for_chief()
        loop = self.loop_callable()   # placed on every task beforehand
        with self._watchdog() as dog, self._chief_watch():
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
        """Posts STALLED when the global step stays put for as long as a
        starting worker waits for its cluster (--startup_timeout_secs): cut
        off, or waiting on a stopped chief. Posts PS_BACK when ps 0 answers
        after --worker_timeout_secs without: the chief counted us out."""
        h, cluster = self.g.handles, self.task.cluster
        timeout = self.config.startup_timeout_secs
        chief = cluster.describe("worker", 0)

        def read_progress():
            session, _ = self.session_and_graph()
            if session is None:
                raise RunFailed("no session")
            step, admitted = session.run([h.global_step, h.admitted])
            return int(step), list(admitted)

        def describe_missing(admitted) -> str:
            missing = [k for k, flag in enumerate(admitted)
                       if not flag and k != self.k]
            if not missing:
                return "the chief to apply the step"
            return ", ".join(cluster.describe("worker", k) for k in missing)

        def on_timeout(at, who) -> None:
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

    def _chief_watch(self) -> takeover.ChiefWatch:
        """Watches the chief's beat; posts CHIEF_LOST if this worker may
        take over the chief's work (trainer/roles/takeover.py)."""
        read = self.callable({"record": self.g.lock.recorded,
                              "roster": self.g.handles.roster,
                              "step": self.g.handles.global_step})
        # One Judge for the worker's life: a chief seen stepping before a
        # reconnect is not "in its start" after it (it is lost, not slow to
        # start, if its beat stays silent: nemesis seed 921). Silence is
        # measured anew from the first reading of each watch.
        self.judge = self.judge or takeover.Judge(
            self.k, self.config.worker_timeout_secs,
            takeover.port_refuses(self.task.cluster),
            self.config.startup_timeout_secs)
        self.judge.forget()

        def fetch():
            out = read()
            return out["record"], out["roster"], out["step"]

        return takeover.ChiefWatch(fetch, self.judge, self.machine.post,
                                   self.train_steps)

    def _join(self, dog):
        """Asks the chief in; the first token (int64 [4]), within
        --startup_timeout_secs. Asks again every timing.JOIN_AGAIN_SECS while
        the roster lacks us (a LOST of our old self may overtake the ask)."""
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
        """The handshake (trainer/sync/coordination.py): waits until the
        chief marks the run ready, then compares its settings with ours."""
        chief = self.task.cluster.describe("worker", 0)
        timeout = self.config.startup_timeout_secs
        poll_until(
            lambda: self.session.run(self.g.handles.ready), timeout,
            lambda secs: f"waiting for the chief, {chief}, to initialize the"
                         f" variables: {secs:.0f} s",
            lambda: f"the chief, {chief}, did not initialize the variables "
                    f"within {timeout:.0f} s (--startup_timeout_secs); start"
                    " it or check --worker_hosts")
        storage.warn_if_elsewhere(
            self.config.logdir,
            lambda: self.session.run(self.g.coord.read_storage_word))
        chiefs = self.session.run(self.g.handles.chief_fingerprint).decode()
        ours = self.g.coord.fingerprint
        if chiefs != ours:
            chief_value, our_value = _first_difference(chiefs, ours)
            raise RunFailed(
                f"this worker's settings differ from the chief's: chief has "
                f"'{chief_value}', this worker has '{our_value}'; start every "
                "task with the same cluster and training flags")


def _first_difference(a: str, b: str) -> tuple[str, str]:
    """The first differing words of a and b (or a and b themselves)."""
    for x, y in zip(a.split(), b.split()):
        if x != y:
            return x, y
    return a, b
