"""A task's graphs on standby (--ps_mirrors), built and warmed before a ps
goes down or comes back: a starved host takes long to build and place a
graph, and the run would stand still as long (choice: without_ps.py)."""

import dataclasses
import threading
import time
from typing import Callable

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.common.tf_session import error_summary, make_callable
from trainer.roles import sessions, timing
from trainer.roles.background import ThreadCall
from trainer.roles.without_ps import Ps0Reader, chief_choice, worker_choice
from trainer.sync import mirrors


class Graphs:
    """A task's graphs by the ps they do without (None: every ps serves),
    each built once. build(ps_down) -> a WorkerGraph; warm(graph, ps_down)
    -> a Warmed or None (warm None: none is warmed); ahead: the chief's,
    which warms those without a ps beforehand (docs/how-it-works.md)."""

    def __init__(self, task, config, build, warm=None, ahead=False):
        self._task, self._config, self._build = task, config, build
        self._warm, self._ahead = warm, ahead
        self._lock = threading.Lock()
        self._built = {}    # ps_down -> WorkerGraph
        self._warmed = {}   # ps_down -> Warmed, of this era
        self._warming = {}  # ps_down -> a worker's warm, of this era
        # Connects so far: a session warmed before the last one may use a
        # ps started again since, so each connect closes the warmed ones.
        self._era = 0
        self._reader = None   # a Ps0Reader, from the first choice on

    def choose(self, target: str, as_chief: bool) -> tuple:
        """(the ps to do without now, on a worker the chief's choice; on the
        chief only, a ps the last chief did without that it uses), or None."""
        if self._reader is None:
            self._reader = Ps0Reader(target, self._task, self._config)
        reader, task, config = self._reader, self._task, self._config
        if not as_chief:
            return worker_choice(task, reader, config.startup_timeout_secs,
                                 self._warm_now), None
        try:
            before = reader.ps_down()
        except tf.errors.OpError:
            before = None
        down = chief_choice(task, reader)
        return down, (before if before not in (None, down) else None)

    def prebuild(self, current) -> ThreadCall | None:
        """With --ps_mirrors, at each connect: a thread that, after
        timing.BUILD_AHEAD_AFTER_SECS, builds the graphs not built yet, and
        warms those without a ps if `ahead` and every ps serves."""
        if not self._config.ps_mirrors:
            return None
        with self._lock:
            self._built[current.ps_down] = current
            era = self._era
        wanted = [d for d in [None, *range(1, self._task.cluster.num_ps)]
                  if d != current.ps_down]

        def build_all():
            # Not at once: the task's own start holds the interpreter long
            # on a starved host, and a build beside it would delay the beat.
            time.sleep(timing.BUILD_AHEAD_AFTER_SECS)
            for d in wanted:
                graph = self._graph(d)
                if self._ahead and d is not None and current.ps_down is None:
                    self._keep(d, era, self._warm(graph, d))

        return ThreadCall(build_all, "graphs-without-a-ps")

    def _warm_now(self, down: int) -> None:
        """A worker's, while the chief chooses: warms the graph without ps
        `down` on a thread, once a connect, if ps 0 holds a run (at a first
        start the chief waits for every ps)."""
        with self._lock:
            if self._warm is None or down in self._warming:
                return
        try:
            if not self._reader.holds_run():
                return
        except tf.errors.OpError:
            return
        with self._lock:
            if down in self._warming:
                return
            era = self._era
            self._warming[down] = ThreadCall(lambda: self._keep(
                down, era, self._warm(self._graph(down), down)),
                "warm-without-a-ps")

    def _graph(self, down: int | None):
        with self._lock:
            graph = self._built.get(down)
        if graph is None:   # built outside the lock: it takes long
            graph = self._build(down)
            with self._lock:
                graph = self._built.setdefault(down, graph)
        return graph

    def _keep(self, down: int, era: int, warmed) -> None:
        with self._lock:
            if warmed is not None and era == self._era:
                self._warmed[down], warmed = warmed, None
        if warmed is not None:   # a connect came meanwhile
            sessions.close_within(warmed.session)

    def switch(self, current, down: int | None) -> tuple:
        """(the graph without ps `down` (None: with every ps), a Warmed
        session on it or None), saying so; `current` is kept."""
        if down is None:
            logging.warning("every ps serves its own shards again (ps %d is "
                            "back): connecting with it", current.ps_down)
        else:
            copy = mirrors.copy_task(down, self._task.cluster.num_ps)
            logging.warning("ps %d is down: serving its shards from their "
                            "copies on ps %d", down, copy)
        with self._lock:
            self._built[current.ps_down] = current
            warming = self._warming.get(down)
        # A warm under way ends sooner than a session begun afresh beside it.
        if warming is not None:
            warming.done(self._config.startup_timeout_secs)
        with self._lock:
            warmed = self._warmed.pop(down, None)
        return self._graph(down), warmed

    def connected(self) -> None:
        """A connect is done: the sessions warmed before it are closed."""
        with self._lock:
            self._era += 1
            stale, self._warmed = list(self._warmed.values()), {}
            self._warming = {}
        for warmed in stale:
            sessions.close_within(warmed.session)


@dataclasses.dataclass
class Warmed:
    """A session opened beforehand (`warm`), its loop placed on every task:
    loop(token, count), a chief's loop(token, count, generation)."""
    session: tf.compat.v1.Session
    loop: Callable
    absorb: Callable | None = None   # a chief's absorb(generation), chief.py


def warm(config, task, server, graph, ps_tasks: list[int] | None = None,
         within: float | None = None) -> Warmed | None:
    """A session using `ps_tasks` (None: every one) on a worker's graph, its
    loop placed by a 0-step run (it only reads), a chief's start prepared.
    None if that failed or outlasted `within` s (a ps lost): connect then."""
    session = sessions.open_session(server.target, graph.graph, config, task,
                                    ps_tasks)
    # A chief's loop fed no chief's generation (-1) writes nothing.
    feeds, none = [graph.start_token, graph.num_steps], ()
    if graph.chief:
        feeds, none = [*feeds, graph.chief.generation], (-1,)
    def place() -> tuple:
        loop = make_callable(session, graph.loop_outputs, feeds)
        loop(np.zeros(4, np.int64), 0, *none)   # step 0's token
        return loop, _prepare_start(session, graph) if graph.chief else None
    try:   # bounded: a ps lost meanwhile blocks it until the close below
        loop, absorb = ThreadCall(place, "warm").result(
            within or config.startup_timeout_secs)
    except (tf.errors.OpError, TimeoutError) as e:
        logging.info("a loop was not placed beforehand: %s", error_summary(e))
        sessions.close_within(session)
        return None
    return Warmed(session, loop, absorb)


def _prepare_start(session, graph) -> Callable:
    """Runs the reads of the chief's start (chief.py _claim_and_start) once:
    a session keeps each run's placement (a starved host takes seconds to
    make one), even when a read fails on an unset variable. Returns the
    absorb's callable, made, not run."""
    for fetch in (graph.lock.recorded, graph.chief.uninitialized,
                  graph.handles.global_step, graph.chief.contributions,
                  graph.handles.round):
        try:
            session.run(fetch)
        except tf.errors.FailedPreconditionError:
            pass
    return make_callable(session, {"roster": graph.chief.absorb_op},
                         [graph.chief.generation])
