"""Doing without a lost ps (--ps_mirrors; never ps 0, whose queues and lock
have no second home), its shards served by their copies on the next ps:
the chief chooses at each connect, naming it in `sync/ps_down` on ps 0,
and the workers follow (docs/how-it-works.md#a-lost-ps-and-its-mirrors)."""

import contextlib
import time

from absl import logging
import tensorflow as tf

from trainer.cluster import devices, ports
from trainer.roles import sessions, timing
from trainer.roles.background import BackgroundThread
from trainer.roles.states import Event, Kind
from trainer.sync import state as state_lib

READ_MS = 5000     # the most a read of ps 0 waits


def port_open(task, ps: int) -> bool:
    return ports.answer(task.cluster.ps[ps], timing.PS_PORT_CHECK_SECS,
                        "--ps_hosts") == ports.OPEN


class Ps0Reader:
    """A graph and session of our own on ps 0 alone: whether it holds a
    run, and which ps the chief's graph does without. Each read raises
    tf.errors.OpError if ps 0 does not answer."""

    def __init__(self, target: str, task, config):
        graph = tf.Graph()
        with graph.as_default(), tf.device(devices.ps_device(0)):
            step, down = _like("global_step"), _like("sync/ps_down")
            self._held = tf.raw_ops.VarIsInitializedOp(resource=step.handle)
            self._down_set = tf.raw_ops.VarIsInitializedOp(
                resource=down.handle)
            self._down = down.read_value()
        self._session = sessions.Own(target, graph, config, task, [0], READ_MS)

    def holds_run(self) -> bool:
        return bool(self._session.run(self._held))

    def ps_down(self) -> int | None:
        """The ps the chief's graph does without, or None."""
        if not self._session.run(self._down_set):
            return None
        down = int(self._session.run(self._down))
        return None if down == state_lib.NO_PS_DOWN else down


def _like(name: str) -> tf.Variable:
    """A handle to ps 0's int64 [] variable `name` (never set from here)."""
    return tf.compat.v1.get_variable(
        name, [], tf.int64, initializer=tf.compat.v1.zeros_initializer(),
        use_resource=True, collections=[])


def chief_choice(task, reader: Ps0Reader) -> int | None:
    """The ps the chief does without, or None (it waits for every ps): the
    one ps, not ps 0, that does not answer, if ps 0 holds a run."""
    silent = [i for i in range(task.cluster.num_ps) if not port_open(task, i)]
    if len(silent) != 1 or silent[0] == 0:
        return None
    try:
        return silent[0] if reader.holds_run() else None
    except tf.errors.OpError:
        return None


def worker_choice(task, reader: Ps0Reader, timeout: float,
                  expect=lambda down: None) -> int | None:
    """The chief's choice, once every ps it uses answers (till then read
    again: the chief may not have chosen yet). Calls expect(k) while one
    ps k, not ps 0, does not answer: the chief will likely do without it."""
    deadline, said = time.monotonic() + timeout, 0.0
    while True:
        try:
            down = reader.ps_down()
        except tf.errors.OpError:
            down = None
        missing = [i for i in range(task.cluster.num_ps)
                   if i != down and not port_open(task, i)]
        if len(missing) == 1 and missing[0] != 0:
            expect(missing[0])
        now = time.monotonic()
        if not missing or now > deadline:
            return down   # if late, wait_for_ps then says which, and fails
        if now - said > 5:
            logging.info("waiting for ps %s, or for the chief to do "
                         "without it", ", ".join(map(str, missing)))
            said = now
        time.sleep(0.25)


class PsWatch(BackgroundThread):
    """The chief's eye on the ps ports, stopping once it calls either:
    with every ps serving, down(k) once ps k (not ps 0) refused at two
    looks in a row (a run blocked on a push would not see it); doing
    without ps k, back() once it answers."""

    def __init__(self, task, ps_down: int | None, down, back):
        every = timing.PS_PORT_CHECK_SECS
        super().__init__("ps-watch", every, every * 4)
        self._task, self._ps_down = task, ps_down
        self._down, self._back = down, back
        self._refused = set()   # refused at the last look

    def run_once(self) -> bool:
        if self._ps_down is not None:
            if port_open(self._task, self._ps_down):
                self._back()
                return False
            return True
        ps = self._task.cluster.ps
        refused = {i for i in range(1, len(ps)) if ports.answer(
            ps[i], timing.PS_PORT_CHECK_SECS, "--ps_hosts") == ports.REFUSED}
        twice, self._refused = refused & self._refused, refused
        if twice:
            self._down(min(twice))
            return False
        return True


def ps_watch(chief):
    """The chief's PsWatch, or a null context manager without --ps_mirrors."""
    if not chief.config.ps_mirrors:
        return contextlib.nullcontext()

    def down(k: int) -> None:
        chief.machine.post(Event(Kind.PS_DOWN, f"ps {k} refuses connections"))

    def back() -> None:
        chief.machine.post(Event(Kind.PS_UP, (
            f"ps {chief.g.ps_down} answers again: halted at a step boundary "
            "to take it back")))

    return PsWatch(chief.task, chief.g.ps_down, down, back)


def ps_tasks(task, down: int | None) -> list[int] | None:
    """The ps tasks a session uses: None (every one), or all but `down`."""
    return None if down is None else [
        i for i in range(task.cluster.num_ps) if i != down]


def changed(error: Exception) -> bool:
    """A push refused: the chief's graph serves the shards otherwise."""
    return (isinstance(error, tf.errors.InvalidArgumentError)
            and state_lib.SERVING_CHANGED in str(error))
