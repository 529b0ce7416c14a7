"""The chief (worker 0, or a worker that took over its work): claims the
role, starts, runs the update, evaluates, checkpoints, reports, ends."""

import contextlib
import dataclasses
import pathlib
import time

from absl import logging
import tensorflow as tf

from trainer.cluster import devices
from trainer.common.errors import RunFailed
from trainer.common.tf_session import error_summary
from trainer.observe import (progress, results as results_lib, summaries,
                             tracing)
from trainer.roles import (deadlines, ending, membership, states, takeover,
                           without_ps)
from trainer.roles.lifecycle import WorkerRole, poll_until, token_of
from trainer.saving import checkpoints, export, storage
from trainer.sync import step_record


class Chief(WorkerRole):
    """taking_over: the TakeOver of a worker that took over, or None."""

    def __init__(self, *args, taking_over=None, **kwargs):
        super().__init__(*args, as_chief=True, **kwargs)
        self.taking_over = taking_over
        self.counted = results_lib.Counted(self.task.cluster.num_workers)
        self.halt_reason = None       # why training ends early (halt)
        self._first_round = 0         # the round counter at our start
        self._gone = None             # the chief we took over from
        self._graph_written = False   # into the summaries, at our start
        self._absorb_call = None      # made once a connect (`_absorb`)

    def run_connected(self) -> None:
        self._absorb_call = None   # made on the last connect's session
        ops = self.g.chief
        logdir = pathlib.Path(self.config.logdir)   # made: prepare_logdir
        step = self._claim_and_start(logdir)
        writer = self._ready(step, logdir)
        self.graphs.prebuild(self.g)
        with membership.watch(self, writer) as watch, \
                self._round_deadlines(), without_ps.ps_watch(self):
            try:
                self._wait_for_workers(self.config.min_workers)
            except RunFailed as e:
                ending.end_failed_run(self, str(e))
                raise
            outcome = progress.drive(
                self._step_runner(logdir), self.callable(ops.eval_outputs),
                lambda at: self._save(logdir, at), self.config, step,
                self.train_steps, writer, slices=lambda: watch.slices)
            # Every worker, in or out, learns that training is over.
            self.session.run(ops.end_op)
            ending.end_late_joiners(
                self.session, ops.end_op, self._absorb, self.task.cluster,
                {r["worker"] for r in watch.records} | {self.k, self._gone})
        watch.write_last_slices()
        step_breakdown = tracing.write_traces(self.traces, str(logdir),
                                              self.k, True, writer)
        writer.close()
        counted = self.counted.total(self.session.run(ops.contributions))
        # Since the last initialize or restore, across takeovers.
        record_from = int(self.session.run(ops.record_from))
        broken = step_record.save_and_check(
            logdir, self.session.run(ops.by_step), self.config.batch_size,
            record_from, self.train_steps, self.config.backup_workers)
        # The chief pushes once per round: its rounds of this launch.
        self.pushed = int(self.session.run(self.g.handles.round)) - (
            self._first_round)
        export.export_version(   # a TF Serving version
            str(logdir / "export"), self.train_steps, self.config.model,
            self.config.hidden_units, self.session.run(ops.param_values),
            self.config.keep_checkpoints)
        pushed = ending.collect_reports(self.session, self.g.chief,
                                        self.task.cluster, self.k)
        results_lib.write_ps_results(
            logdir, outcome, self.config, self.train_steps, self.task.cluster,
            results_lib.ChiefReport(
                self.train_steps - self.counted.since, counted,
                {self.k: self.pushed, **pushed}, watch.records, len(broken),
                record_from, step_breakdown))
        ending.shut_down_ps(self)
        self.close_session()

    @contextlib.contextmanager
    def beating(self):
        """The chief's beat from its claim to its end, across reconnects."""
        with contextlib.closing(takeover.BeatSession(
                self.server.target, self.task, self.config)) as beats, \
                takeover.ChiefBeat(lambda: beats.beat(self.generation),
                                   self.taking_over and self.taking_over.claim,
                                   ours=lambda: self.generation is not None):
            yield

    def _ready(self, step: int, logdir: pathlib.Path):
        """Tells the workers to go; returns the run's summary writer."""
        self.session.run(self.g.chief.mark_ready_op)
        logging.info("chief ready at global step %d of %d", step,
                     self.train_steps)
        # The graph once, not at each connect: a starved host takes seconds.
        graph = None if self._graph_written else self.g.graph
        self._graph_written = True
        writer = summaries.summary_writer(str(logdir), graph)
        summaries.write_run_card(writer, step, dataclasses.asdict(
            self.config), self.task.cluster.as_dict())
        return writer

    def _round_deadlines(self):
        ops = self.g.chief
        return contextlib.nullcontext() if ops.deadlines is None else (
            deadlines.RoundDeadlines(self.session, ops.deadlines, ops.late_op,
                                     *ops.late_in))

    def _wait_for_workers(self, count: int) -> None:
        timeout, members = self.config.startup_timeout_secs, [0]

        def ready() -> bool:
            members[0] = int(self._absorb().sum())
            return members[0] >= count or bool(self.halt_reason)
        poll_until(
            ready, timeout,
            lambda secs: f"{members[0]} of --min_workers={count} workers in;"
                         f" waiting for the others: {secs:.0f} s",
            lambda: f"only {members[0]} of the --min_workers={count} workers"
                    f" joined within {timeout:.0f} s (--startup_timeout_secs)"
                    "; start the others or lower --min_workers")

    def _absorb(self):
        """Acts on queued events; the roster after (bool [N]); warmed ahead."""
        warmed = self._warm_loop
        if self._absorb_call is None:   # once a connect
            self._absorb_call = (warmed and warmed.absorb) or self.callable(
                {"roster": self.g.chief.absorb_op}, [self.g.chief.generation])
        return self._absorb_call(self.generation)["roster"]

    def halt(self, reason: str) -> None:
        """On SIGTERM (any thread): ends training at the next step boundary
        with a checkpoint, then stops every task (_step_runner's RunFailed)."""
        with self._lock:
            if self.halt_reason:
                return
            self.halt_reason, session = reason, self.session
        ending.halt_loop(self, session, reason)

    def _step_runner(self, logdir: pathlib.Path):
        """(start, count) -> loop outputs; a halted loop saves and fails."""
        loop, ops = self.loop_callable(), self.g.chief

        def run_steps(start: int, count: int) -> dict:
            if not self.halt_reason:
                out = loop(token_of(start), count)
                if out["steps_done"] == count and (
                        out["next_token"][0] == start + count):
                    self.last_progress = time.monotonic()
                    return out
                start = int(out["next_token"][0])
            self._check_still_chief(start)
            if self.machine.pending():   # halted for it (PS_UP)
                raise states.Interrupted(f"halted at step {start}")
            members = int(self.session.run(ops.roster).sum())
            reason = self.halt_reason or (
                f"{members} worker(s) left, fewer than --min_workers="
                f"{self.config.min_workers}"
                if members < self.config.min_workers else None)
            if reason and start >= 0:
                try:
                    self._save(logdir, start)
                    self.session.run(ops.stop_op, {ops.stop_reason_in: reason})
                except tf.errors.OpError as e:
                    logging.warning("could not save or stop cleanly: %s",
                                    error_summary(e))
                ending.shut_down_ps(self, failed=True)
                raise RunFailed(f"{reason}; saved a checkpoint at step "
                                f"{start}; start every task again with the "
                                "same flags to continue from it")
            raise RunFailed(f"the training loop stopped early at step {start}")
        return run_steps

    def _check_still_chief(self, step: int | None = None) -> None:
        """Raises RunFailed if another worker claimed the role since ours."""
        index = takeover.deposed_by(self.session, self.g.lock, self.generation)
        if index is not None:
            at = "" if step is None else f" (at step {step} here)"
            raise RunFailed(
                f"{self.task.cluster.describe('worker', index)} took over "
                f"the chief's work while this chief was out of reach{at}; "
                "exiting: start this task again to join the run as a worker")

    def _claim_and_start(self, logdir: pathlib.Path) -> int:
        """Claims the role; goes on from the ps tasks' state where whole, else
        initializes or restores; asks every worker in. Returns the step."""
        ops = self.g.chief
        # Every ps answers before a claim's take and put (two runs): a ps
        # just started again then costs a reconnect, not the lock.
        self.session.run(ops.uninitialized)
        if self.generation is not None:  # reconnecting: still the chief?
            self._check_still_chief()
        if self.taking_over:  # claimed by the worker, before its graph
            claim = self.taking_over.claim
            self.generation, lost, self._gone = (claim.generation, claim.lost,
                                                 claim.previous)
        else:
            self.generation, lost = takeover.claim(
                self.session, self.g.lock, self.k,
                takeover.claim_wait(self.config))
        # Restores and refills bypass the lock: checked just before them.
        self._check_still_chief()
        if not lost and self._fill_what_was_lost():
            step = int(self.session.run(self.g.handles.global_step))
            self.counted.kept(int(self.session.run(ops.record_from)))
            self._first_round = int(self.session.run(self.g.handles.round))
            me = self.task.cluster.describe("worker", self.k)
            if self.taking_over:
                logging.warning("%s took over the chief's work at step %d "
                                "(%s); writing to %s", me, step,
                                self.taking_over.reason, logdir.resolve())
            else:
                logging.info("%s goes on from the state on the ps tasks at "
                             "step %d (nothing to restore)", me, step)
        else:
            if lost:
                logging.warning("the last chief was lost inside a write to the"
                                " ps tasks; restoring the newest checkpoint")
            step = self._initialize_or_restore(logdir)
        self.taking_over = None
        self._check_still_chief()   # again: a restore can take long
        self.session.run(self.g.coord.set_storage_word, {
            self.g.coord.storage_word_in: storage.mark(logdir)})
        self.session.run(ops.start_op)
        return step

    def _fill_what_was_lost(self) -> bool:
        """Whether to go on from the ps tasks' state (else restore): fills a
        ps done without or started again, starts afresh what may, or not."""
        session, ops = self.session, self.g.chief
        if self.take_back is not None and ops.refill:
            ops.refill.take_back(session, devices.ps_device(self.take_back))
        if ops.refill and ops.refill.after_restart(session, ops.uninitialized):
            session.run(ops.set_record_from)
        missing = [m.decode() for m in session.run(ops.uninitialized)]
        if missing and all(m in ops.transient_inits for m in missing):
            session.run([ops.transient_inits[m] for m in missing])
            logging.info("started afresh: %s", ", ".join(missing))
            return True
        return not missing

    def _initialize_or_restore(self, logdir: pathlib.Path) -> int:
        ops = self.g.chief
        latest = tf.train.latest_checkpoint(str(logdir))
        if latest:
            checkpoints.check_matches(latest, ops.checkpoint_shapes,
                                      self.config.model)
            restored = checkpoints.restore_newest_readable(
                ops.saver, self.session, logdir)
            self.session.run(ops.transient_init_op)
            self.session.run(ops.set_record_from)
        else:
            self.session.run(ops.init_op)
        if ops.refill:   # copies are not in checkpoints
            self.session.run(ops.refill.copy_all)
        step = int(self.session.run(self.g.handles.global_step))
        if latest:
            logging.info("restored %s (global step %d)", restored, step)
            self.counted.restored(step)
        else:
            self.counted.initialized(step)
            logging.info("initialized the parameters (no checkpoint in %s)",
                         logdir)
            self._save(logdir, step)
        return step

    def _save(self, logdir: pathlib.Path, step: int) -> None:
        checkpoints.save(self.g.chief.saver, self.session, logdir, step)
        self.counted.saved(step, self.session.run(self.g.chief.contributions))
