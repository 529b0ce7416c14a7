"""The library entry point: `run(config, task)` runs one task, a ps
(ps.py), the chief (chief.py) or another worker (worker.py), to the end."""

import contextlib
import dataclasses
import threading
import time

from absl import logging
import tensorflow as tf

from trainer.cluster import devices, ports
from trainer.cluster.spec import Task
from trainer.common import processes
from trainer.common.config import TrainConfig, validate
from trainer.common.errors import RunFailed
from trainer.common.tf_session import error_summary
from trainer.learning import data as data_lib
from trainer.roles import (ending, graph as worker_graph, lifecycle,
                           liveness, ps, standby, states, takeover, timing,
                           without_ps)
from trainer.roles.background import ThreadCall
from trainer.roles.chief import Chief
from trainer.roles.states import Event, How, Kind, State
from trainer.roles.worker import Worker
from trainer.saving import checkpoints, settings

# A ps task dead or restarted: refused, handles or variables gone or unset.
PS_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError,
           tf.errors.NotFoundError, tf.errors.FailedPreconditionError,
           tf.errors.CancelledError, tf.errors.InternalError)


def run(config: TrainConfig, task: Task) -> None:
    """Runs this task to the end of training; raises UserError/RunFailed."""
    validate(config, task.cluster.num_workers, task.cluster.num_ps)
    ports.check_free(task)
    if task.job_name == "ps":
        ps.serve(config, task, start_server(config, task))
        return
    # Bad input stops this task before its server is up. The chief writes
    # the logdir; every worker writes its trace there when tracing.
    if task.is_chief or config.trace_steps:
        checkpoints.prepare_logdir(config.logdir)
    data_dir = data_lib.resolve_data_dir(config.data_dir)
    mnist = data_lib.load(data_dir, config.download,
                          data_lib.source_list(config.data_url),
                          need_test=task.is_chief)
    if task.is_chief:  # before the data line: a rerun's first line
        settings.check_logdir_settings(
            config, config.resolved_train_steps(len(mnist.train_labels)))
        checkpoints.check_logdir_fits_model(config)
    logging.info("data: %d training and %d test images from %s",
                 len(mnist.train_labels), len(mnist.test_labels), data_dir)
    server = start_server(config, task)
    machine = states.Machine(f"worker {task.task_index}")
    with contextlib.ExitStack() as stack:
        roles = Roles(config, task, server, mnist, data_dir, machine, stack)
        _running[:] = [roles]
        if machine.run(roles.work) is State.FAILED:
            roles.raise_failure()


class Roles:
    """Each state's work (states.py), returning the Event the loop moves
    on; `role` does it: the Worker, or the Chief once chosen or claimed.
    stack: an ExitStack open for the whole loop (the chief's beat)."""

    def __init__(self, config: TrainConfig, task: Task, server, mnist,
                 data_dir, machine: states.Machine, stack):
        self.config, self.task, self.server = config, task, server
        self.mnist, self.data_dir, self.machine = mnist, data_dir, machine
        self._stack, self.role, self._spare = stack, None, None
        machine.attach(self.interrupt)

    def work(self, state: State) -> Event:
        if state == State.STARTING:
            return self._start()
        if state == State.CLAIMING:
            return self._claim(self.machine.cause.reason)
        if state == State.RECONNECTING:
            return self._reconnect(self.machine.cause)
        return self._train()   # WORKER, CHIEF

    def _train(self) -> Event:
        """WORKER's and CHIEF's work: DONE, or the event its error means."""
        role = self.role
        try:
            role.connect()
            # Saver.save and .restore pick graph mode by the default graph.
            with role.g.graph.as_default():
                role.run_connected()
            return Event(Kind.DONE, "trained to the end")
        except Exception as e:  # noqa: BLE001 (the loop decides)
            return self._event_of(e)

    def _event_of(self, error: Exception) -> Event:
        if isinstance(error, RunFailed):
            return Event(Kind.FAILURE, str(error), error=error)
        first_line = error_summary(error)
        if without_ps.changed(error):
            return Event(Kind.SERVING_CHANGED, first_line)
        if not isinstance(error, PS_LOST):
            return Event(Kind.FAILURE, first_line, error=error)
        timeout = self.config.startup_timeout_secs
        if time.monotonic() - self.role.last_progress > timeout:
            # No error held: a post meanwhile (its close made this) wins.
            return Event(Kind.FAILURE, f"no training step succeeded for "
                         f"{timeout:.0f} s (--startup_timeout_secs); last "
                         f"error: {first_line}")
        return Event(Kind.PS_LOST, f"lost the ps tasks: {first_line}")

    def _reconnect(self, cause: Event) -> Event:
        """RECONNECTING's work: closes the session; quickly but on PS_BACK."""
        if cause.kind == Kind.PS_BACK:
            self.role.last_progress = time.monotonic()
            self.role.close_session()
        else:
            self.role.close_session(timing.QUICK_CLOSE_SECS)
        return Event(Kind.RECONNECTED, "the old session is closed")

    def interrupt(self, event: Event, how: How) -> None:
        """How a posted event ends the role's blocked work (Machine.post,
        any thread): the chief's halt (its loop stops at a step boundary),
        or the session closed: a session.run blocked on a lost peer ends
        only so, and Machine.outcome puts the event in place of its error."""
        role = self.role
        if role is None:   # not started: nothing blocks yet
            return
        if how == How.AT_BOUNDARY:
            ending.halt_loop(role, role.session)
            return
        if how == How.NOW_OR_EXIT:
            # Cut off from ps 0, the close or run can block for long: exit.
            processes.exit_after(timing.CLOSE_DEADLINE_SECS, (
                f"{role.with_step(event.reason)}; the blocked session did not"
                f" end within {timing.CLOSE_DEADLINE_SECS:.0f} s"), 1)
        role.close_session()

    def _start(self) -> Event:
        config, task, server = self.config, self.task, self.server
        if task.is_chief and not _another_chief(config, task, server):
            self._become(Chief(config, task, server, self.mnist, self.machine))
            return Event(Kind.CHOSEN, "the chief's work is this task's",
                         role=State.CHIEF)
        self.role = Worker(config, task, server, self.mnist, self.machine)
        # The chief's side, for a takeover (none with one worker).
        if task.cluster.num_workers > 1:
            self._spare = SpareChief(config, task, self.data_dir, self.role)
        return Event(Kind.CHOSEN, "another task does the chief's work",
                     role=State.WORKER)

    def _claim(self, reason: str) -> Event:
        """Takes over the chief's work on this server: claims the role
        first, with a beat of its own (others then wait for it, not claim
        too), then builds the chief's side, which may take long."""
        worker, config = self.role, self.config
        claim = takeover.Claim(self.server.target, self.task, config,
                               worker.k, worker.g.ps_down)
        checkpoints.prepare_logdir(config.logdir)
        worker.in_the_run.set()   # taking over before joining: wait no more
        mnist, graph, warmed = self._spare.result()
        self._become(Chief(
            config, self.task, self.server, mnist, self.machine,
            taking_over=takeover.TakeOver(reason, claim), graph=graph,
            warmed=warmed))
        return Event(Kind.CLAIMED, f"claimed generation {claim.generation} "
                     f"after worker {claim.previous}")

    def _become(self, chief: Chief) -> None:
        self.role = chief
        self._stack.enter_context(chief.beating())

    def raise_failure(self) -> None:
        """Raises why the loop ended in FAILED: the error out of a state's
        work, or a RunFailed naming the step this worker was at."""
        cause = self.machine.cause
        if cause.error is not None and not isinstance(cause.error, RunFailed):
            raise cause.error
        raise RunFailed(self.role.with_step(cause.reason) if self.role
                        else cause.reason) from None


def _another_chief(config: TrainConfig, task: Task, server) -> bool:
    """Whether another worker does the chief's work (worker 0 started
    again after a takeover), asked once every ps task answers."""
    if task.cluster.num_workers == 1:
        return False
    lifecycle.wait_for_ps(task, config.startup_timeout_secs)
    index = takeover.acting_chief(server.target, task, config)
    if index is None or index == task.task_index:
        return False
    logging.warning("%s does the chief's work; this task joins the run as "
                    "a worker", task.cluster.describe("worker", index))
    return True


class SpareChief:
    """The chief's side for a worker that may take over, built on a thread
    ahead of need once first in line (liveness.Judge's order, checked every
    timing.BUILD_AHEAD_AFTER_SECS in the run: building slows steps), else at
    a claim. result(): (Mnist with test set, WorkerGraph, Warmed or None)."""

    def __init__(self, config: TrainConfig, task: Task, data_dir,
                 worker: Worker):
        self._config, self._task, self._data_dir = config, task, data_dir
        self._worker = worker
        self._now = threading.Event()   # a claim: build at once
        self._call = ThreadCall(self._build, "spare-chief")

    def result(self) -> tuple:
        """Builds at once if not built yet, and waits for it."""
        self._now.set()
        return self._call.result()

    def _build(self) -> tuple:
        config, worker = self._config, self._worker
        joined = worker.in_the_run.wait(config.startup_timeout_secs)
        while joined and not self._now.wait(timing.BUILD_AHEAD_AFTER_SECS):
            judge = worker.judge   # the chief watch's last reading
            if judge and judge.roster is not None and liveness.place_in_line(
                    judge.roster, judge.chief, worker.k) == 0:
                break
        ahead = not self._now.is_set()
        test = data_lib.load(self._data_dir, config.download,
                             data_lib.source_list(config.data_url),
                             need_train=False)
        mnist = dataclasses.replace(worker.mnist, test_images=test.test_images,
                                    test_labels=test.test_labels)
        # For our session's ps tasks; warmed only ahead (a claim's connect
        # places as soon), within --worker_timeout_secs (seeds 981, 990).
        down = worker.session_and_graph()[1].ps_down
        graph = worker_graph.build_worker(
            config, self._task, len(mnist.train_labels),
            len(mnist.test_labels), worker.train_steps, True, down)
        warmed = (standby.warm(config, self._task, worker.server, graph,
                               without_ps.ps_tasks(self._task, down),
                               config.worker_timeout_secs)
                  if joined and ahead else None)
        return mnist, graph, warmed


_running = []            # this process's Roles, once made


def terminate() -> float:
    """On SIGTERM (main thread): a worker tells the chief it leaves (at
    most timing.LEAVE_DEADLINE_SECS); the chief halts (chief.halt: saves,
    stops every task). Returns the grace in seconds: 0, exit now."""
    role = _running[0].role if _running else None
    if role is None:
        return 0.0
    if isinstance(role, Chief):
        threading.Thread(target=role.halt, args=(
            "the chief was sent SIGTERM",), daemon=True).start()
        return processes.CHIEF_STOP_SECS
    ThreadCall(role.leave, "leave").done(timing.LEAVE_DEADLINE_SECS)
    logging.info("told the chief that this worker leaves")
    return 0.0


def start_server(config: TrainConfig, task: Task):
    devices.give_up_silent_connections(config)
    return tf.distribute.Server(
        tf.train.ClusterSpec(task.cluster.as_dict()), job_name=task.job_name,
        task_index=task.task_index,
        config=devices.session_config(config, task))
