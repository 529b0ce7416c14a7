"""The chief (worker 0): initializes or restores, runs the update, and
evaluates, checkpoints, summarizes and reports; at the end it tells every
ps task to exit."""

import pathlib
import time

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.common.errors import RunFailed
from trainer.common.tf_session import error_summary
from trainer.observe import progress
from trainer.observe import tracing
from trainer.roles.lifecycle import POLL_SECS, WorkerRole
from trainer.saving import checkpoints
from trainer.saving import export

FINISH_WAIT_SECS = 15.0    # how long the chief waits for workers' reports
RESULTS_FILE = "results.json"
EXPORT_DIR = "export"


class Chief(WorkerRole):

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # sync/contributions lives on ps 0 and restarts from zero whenever
        # the chief restores a checkpoint. What it had counted up to each
        # checkpoint this process saved is kept here, so that the counts
        # survive a restore: int64 [N] by global step.
        self._counted_at_save = {}
        self._counted_before = None   # the counts at the restored step

    def run_connected(self) -> None:
        ops = self.g.chief
        logdir = pathlib.Path(self.config.logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        step = self._initialize_or_restore(logdir)
        self.session.run(ops.start_op)
        self.session.run(ops.mark_ready_op)
        logging.info("chief ready at global step %d of %d", step,
                     self.train_steps)
        writer = progress.summary_writer(str(logdir), self.g.graph)
        with self.watchdog(self.config.worker_timeout_secs,
                           lambda at, who: self._stop_stalled_run(
                               logdir, at, who)) as dog:
            outcome = progress.drive(
                self._step_runner(dog, step), self.callable(ops.eval_outputs),
                lambda at: self._save(logdir, at), self.config, step,
                self.train_steps, writer)
        step_breakdown = tracing.write_traces(self.traces, str(logdir),
                                              self.k, True, writer)
        writer.close()
        counted = self._counted_before + self.session.run(ops.contributions)
        self._export(logdir)
        pushed = self._collect_finished()
        self._write_results(logdir, self.train_steps - step, outcome,
                            counted, pushed, step_breakdown)
        self._shut_down_ps()
        self.close_session()

    def _step_runner(self, dog, first_step: int):
        """(start, count) -> loop outputs, failing if the loop stopped
        early (the watchdog or the chief's STOP)."""
        loop = self.loop_callable()

        def run_steps(start: int, count: int) -> dict:
            # The first step also waits for every worker to start.
            first = start == first_step
            with dog.busy(self.config.startup_timeout_secs if first else None,
                          "--startup_timeout_secs" if first else None):
                out = loop(start, count)
            if out["steps_done"] != count or (
                    out["next_step"] != start + count):
                raise RunFailed(f"the training loop stopped early at "
                                f"step {out['next_step']}")
            self.last_progress = time.monotonic()
            return out

        return run_steps

    def _stop_stalled_run(self, logdir: pathlib.Path, step: int | None,
                          who: str) -> None:
        """The step waited --worker_timeout_secs for `who`: save and stop.

        Runs on the watchdog's thread. The blocked step has not been
        applied, so the parameters are those after `step` steps: a
        consistent checkpoint to resume from. With step None ps 0 does not
        answer, so nothing can be saved: the last checkpoint stands.
        """
        timeout = f"{self.config.worker_timeout_secs:.0f} s"
        if step is None:  # nothing can be saved or sent through ps 0
            reason = f"{who} for {timeout} (--worker_timeout_secs)"
            then = ("stopped; start every task again with the same flags "
                    "to continue from the last checkpoint")
        else:
            reason = (f"{who} sent no gradient for step {step} in {timeout} "
                      "(--worker_timeout_secs)")
            self._save_and_stop(logdir, step, reason)
            then = (f"stopped the run after saving a checkpoint at step "
                    f"{step}; restart the missing task(s) and start every "
                    "task again with the same flags to continue from it")
        # Even when the stop could not be sent, the ps tasks must exit.
        self._shut_down_ps(failed=True)
        self.give_up(f"{reason}; {then}")

    def _save_and_stop(self, logdir: pathlib.Path, step: int,
                       reason: str) -> None:
        ops = self.g.chief
        with self.g.graph.as_default():
            try:
                self._save(logdir, step)
                self.session.run(ops.stop_op, {ops.stop_reason_in: reason})
            except tf.errors.OpError as e:
                logging.warning("could not save or stop cleanly: %s",
                                error_summary(e))

    def _initialize_or_restore(self, logdir: pathlib.Path) -> int:
        ops = self.g.chief
        latest = tf.train.latest_checkpoint(str(logdir))
        if latest:
            checkpoints.check_matches(latest, ops.checkpoint_shapes,
                                      self.config.model)
            restored = checkpoints.restore_newest_readable(
                ops.saver, self.session, logdir)
            self.session.run(ops.transient_init_op)
            step = int(self.session.run(self.g.handles.global_step))
            logging.info("restored %s (global step %d)", restored, step)
            self._counted_before = self._counted_at_save.get(
                step, self._no_counts())
        else:
            self.session.run(ops.init_op)
            step = int(self.session.run(self.g.handles.global_step))
            self._counted_before = self._no_counts()
            logging.info("initialized the parameters (no checkpoint in %s)",
                         logdir)
            self._save(logdir, step)
        return step

    def _export(self, logdir: pathlib.Path) -> None:
        """The trained model as a SavedModel in <logdir>/export/<step>/,
        a TF Serving version (see trainer/saving/export.py)."""
        values = self.session.run(self.g.chief.param_values)
        export.export_version(str(logdir / EXPORT_DIR), self.train_steps,
                              self.config.model, self.config.hidden_units,
                              values, self.config.keep_checkpoints)

    def _no_counts(self) -> np.ndarray:
        return np.zeros([self.task.cluster.num_workers], np.int64)

    def _save(self, logdir: pathlib.Path, step: int) -> None:
        checkpoints.save(self.g.chief.saver, self.session, logdir, step)
        self._counted_at_save[step] = self._counted_before + self.session.run(
            self.g.chief.contributions)

    def _collect_finished(self) -> dict:
        """The gradients the other workers say they pushed, reported as
        they finish."""
        reports = {}
        deadline = time.monotonic() + FINISH_WAIT_SECS
        while (len(reports) < self.task.cluster.num_workers - 1
               and time.monotonic() < deadline):
            workers, steps = self.session.run(self.g.chief.take_finished)
            reports.update(zip(workers.tolist(), steps.tolist()))
            if len(reports) < self.task.cluster.num_workers - 1:
                time.sleep(POLL_SECS)
        missing = [k for k in range(1, self.task.cluster.num_workers)
                   if k not in reports]
        if missing:
            logging.warning("no end-of-training report from %s",
                            ", ".join(self.task.cluster.describe("worker", k)
                                      for k in missing))
        return reports

    def _write_results(self, logdir: pathlib.Path, steps_trained: int,
                       outcome: progress.Outcome, counted: np.ndarray,
                       pushed: dict, step_breakdown: dict | None) -> None:
        """results.json. local_steps: the applied steps of this launch that
        averaged each worker's gradient (ps-side, exact); pushed_gradients:
        what each worker pushed (with stale, dropped and redone ones)."""
        config, cluster = self.config, self.task.cluster
        results = {
            **progress.results_fields(outcome, config, self.train_steps),
            "global_step": self.train_steps,
            "steps_this_run": steps_trained,
            "num_workers": cluster.num_workers,
            "num_ps": cluster.num_ps,
            "replicas_to_aggregate": config.replicas_to_aggregate(
                cluster.num_workers),
            "backup_workers": config.backup_workers,
            "dropped_gradients": outcome.dropped,
            "local_steps": {str(k): int(n) for k, n in enumerate(counted)},
            "pushed_gradients": {"0": steps_trained,
                                 **{str(k): v for k, v in pushed.items()}},
            "cluster": cluster.as_dict(),
        }
        if step_breakdown:
            results["step_breakdown"] = step_breakdown
        progress.write_json(logdir / RESULTS_FILE, results)
        logging.info("final test accuracy %.2f%% after %d steps; wrote %s",
                     100 * results["final_test_accuracy"], self.train_steps,
                     logdir / RESULTS_FILE)

    def _shut_down_ps(self, failed: bool = False) -> None:
        """Tells every ps task to exit (with status 1 if the run failed)."""
        ops = self.g.chief
        options = tf.compat.v1.RunOptions(timeout_in_ms=5000)
        for i, op in enumerate(ops.shutdown_ops):
            try:
                self.session.run(op, {ops.shutdown_status: int(failed)},
                                 options=options)
            except tf.errors.OpError as e:
                logging.warning("could not tell %s to exit: %s",
                                self.task.cluster.describe("ps", i),
                                error_summary(e))
