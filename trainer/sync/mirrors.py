"""Mirrors (--ps_mirrors): a copy of every ps's shards and their optimizer
state on the next ps, updated by every step alike, so that a ps started
again after it died is refilled from the copies instead of a checkpoint.

Shard i, on ps p, has its copy `ps_mirror/shard_<i>` (float32 [n_i]) on ps
(p + 1) % P, with the slots and other state (Adam's beta powers) of a
second optimizer of the same rule. A step's averaged gradient of shard i
is applied to both, inside the chief's guarded write (sync/chief_lock.py),
so each copy holds its primary's bits. Copies are not in checkpoints:
after an initialize or a restore every copy is set from its primary
(`Refill.copy_all`).

ps 0's own state has a copy on ps 1 as well: `ps_mirror/global_step`, set
at the end of each step's write, and `ps_mirror/begun`, set to the step the
write brings the run to at its start, before anything on ps 1 is
written. Where the two differ, a write was cut
short on ps 1. So a ps 0 started again is refilled where ps 1's copies are
whole; its protocol state starts afresh (the workers join again), and so
do its counts of dropped gradients and of steps by worker, as after a
restore. The chief's generation has a copy too (sync/chief_lock.py).

A ps other than ps 0 killed inside a write may leave it half done on the
survivors; the chief lock tells (its generation was never put back), and the
chief restores the newest checkpoint then, as without mirrors; so it does
for a ps 0 lost inside a write, which the copies on ps 1 tell.
"""

from absl import logging
import tensorflow as tf

from trainer.learning import optim

# After "params/" in name order: Adam keeps its step state beside the
# first of its variables by name, so a graph serving a shard from its
# copy keeps it where the run's graph does (on the first primary's ps).
COPY_PREFIX = "ps_mirror/"
PS0_COPIES = 1   # the ps task that keeps the copies of ps 0's state


def copy_task(ps: int, num_ps: int) -> int:
    """The ps task that keeps the copies of ps `ps`'s shards."""
    return (ps + 1) % num_ps


def copy_name(primary_name: str) -> str:
    """`params/shard_1` -> `ps_mirror/shard_1`: its copy's variable."""
    return COPY_PREFIX + primary_name.split("/")[-1]


def serving_task(ps: int, ps_down: int | None, num_ps: int) -> int:
    """The ps task that serves ps `ps`'s shards: itself, or the one with
    their copies while it is down."""
    return copy_task(ps, num_ps) if ps == ps_down else ps


def served_by_copies(ps_down: int | None, num_ps: int) -> dict:
    """For FlatParams: {ps_down: (its shard's copy's name, device)}."""
    if ps_down is None:
        return {}
    return {ps_down: (copy_name(f"params/shard_{ps_down}"),
                      f"/job:ps/task:{copy_task(ps_down, num_ps)}")}


class Mirrors:
    """The copies of one chief graph, and the ops that refill them."""

    def __init__(self, primaries: list, ps_indices: list[int], num_ps: int,
                 update: optim.ScheduledUpdate, global_step: tf.Variable):
        """primaries: the shard variables (float32 [n_i]), shard i on ps
        ps_indices[i]; update: a second optimizer of the run's rule;
        global_step: int64 [] on ps 0."""
        self.primaries, self.update = primaries, update
        self.copies = []
        for v, p in zip(primaries, ps_indices):
            with tf.compat.v1.device(
                    f"/job:ps/task:{copy_task(p, num_ps)}"):
                self.copies.append(_copy(copy_name(v.op.name), v,
                                         trainable=True))
        self.global_step = global_step
        with tf.compat.v1.device(f"/job:ps/task:{PS0_COPIES}"):
            self.step_copy = _copy(COPY_PREFIX + "global_step", global_step)
            self.begun = _copy(COPY_PREFIX + "begun", global_step)

    def apply(self, step: tf.Tensor, mean_grads: list,
              update: optim.ScheduledUpdate) -> tf.Operation:
        """The step's update (mean_grads: float32 [n_i] per shard, on the
        primaries' ps tasks) applied by `update` to the primaries and by
        ours to the copies, each only once `begun` holds the step's end
        on ps 1."""
        with tf.device(self.begun.device):
            begun = self.begun.assign(step + 1, read_value=False)
        held = []
        for g in mean_grads:   # each where it is: no extra transfer
            with tf.device(g.device), tf.control_dependencies([begun]):
                held.append(tf.identity(g))
        return tf.group(
            update.apply(step, list(zip(held, self.primaries))),
            self.update.apply(step, list(zip(held, self.copies))))

    def advance(self, next_step: tf.Tensor) -> tf.Tensor:
        """After the step's write on ps 0 (next_step: int64 [], the new
        global step), its copy on ps 1: that write is whole there."""
        with tf.device(self.step_copy.device), \
                tf.control_dependencies([next_step]):
            copied = self.step_copy.assign(next_step, read_value=False)
        with tf.control_dependencies([copied]):
            return tf.identity(next_step)

    def whole(self) -> tf.Tensor:
        """bool []: no write was cut short on ps 1 (its copies of ps 0's
        state are at one step)."""
        with tf.device(self.begun.device):
            return tf.equal(self.begun.read_value(),
                            self.step_copy.read_value())

    def pairs(self, optimizer) -> list[tuple]:
        """(primary, copy) of each variable mirrored: the shards, their
        slots, then the optimizer's other state. Call after the step's
        updates are built (they make the slots)."""
        mine = self.update.optimizer
        pairs = list(zip(self.primaries, self.copies))
        for name in optimizer.get_slot_names():
            pairs += [(optimizer.get_slot(v, name), mine.get_slot(c, name))
                      for v, c in zip(self.primaries, self.copies)]
        theirs = _other_state(optimizer, self.primaries)
        ours = _other_state(mine, self.copies)
        assert [v.shape for v in theirs] == [v.shape for v in ours]
        return pairs + list(zip(theirs, ours)) + [
            (self.global_step, self.step_copy)]


def _copy(name: str, like: tf.Variable, trainable=False) -> tf.Variable:
    return tf.compat.v1.get_variable(
        name, like.shape, like.dtype.base_dtype,
        initializer=tf.compat.v1.zeros_initializer(), trainable=trainable,
        use_resource=True)


def _other_state(optimizer, slotted: list) -> list:
    """The optimizer's variables that are not slots of `slotted`, by name:
    the two optimizers name theirs alike but for a suffix (beta1_power,
    beta1_power_1), so the two orders match."""
    slots = {optimizer.get_slot(v, n).op.name for v in slotted
             for n in optimizer.get_slot_names()}
    return sorted((v for v in optimizer.variables()
                   if v.op.name not in slots), key=lambda v: v.op.name)


class Refill:
    """The chief's side: fills the variables a ps started again lost from
    their partners, and sets every copy from its primary."""

    def __init__(self, mirrors: Mirrors, pairs: list[tuple], afresh: list):
        """pairs: mirrors.pairs(); afresh: the variables that start afresh
        (the protocol's, and ps 0's count of dropped gradients)."""
        self.fill, self.partner, self.device = {}, {}, {}
        for v in afresh:
            self.fill[v.op.name] = v.initializer
            self.device[v.op.name] = v.device
        for a, b in pairs:
            self._fill_from(a, b)
            self._fill_from(b, a)
        # One way: the global step comes back from its copy, not `begun`.
        self._fill_from(mirrors.begun, mirrors.global_step)
        self._ps0_step = mirrors.global_step.op.name
        self._whole = mirrors.whole()
        # After an initialize or a restore: each copy from its primary.
        self.copy_all = tf.group(
            [self.fill[b.op.name] for _, b in pairs] +
            [self.fill[mirrors.begun.op.name]])

    def after_restart(self, session, uninitialized: tf.Tensor) -> bool:
        """Fills what a ps started again lost from the copies, where each
        variable it lost has a live one whole (then nothing is restored).
        Returns whether ps 0's state was refilled: the step record then
        starts afresh, as after a restore.

        uninitialized: string [n], the variables not set on the ps tasks.
        """
        missing = [m.decode() for m in session.run(uninitialized)]
        fills = self.ops_for(missing) if missing else None
        ps0 = self._ps0_step in missing
        if fills and ps0 and not session.run(self._whole):
            logging.warning("ps 0 was lost inside a step's write: its "
                            "copies on ps 1 are not whole")
            return False
        if fills:
            session.run(fills)
            # Copies whose primary lived may be behind: none were written
            # while a ps was done without (trainer/roles/without_ps.py).
            session.run(self.copy_all)
            where = sorted({self.device[m] for m in missing
                            if m in self.device})
            logging.warning("refilled %s from the mirrors: nothing restored",
                            ", ".join(where))
        return bool(fills) and ps0

    def take_back(self, session, device: str) -> None:
        """Sets every variable on `device` from its partner, whatever it
        holds: a ps that was done without (trainer/roles/without_ps.py) may
        have been cut off, not restarted, and hold the step it was cut
        off at. Then every copy is set from its primary."""
        session.run([self.fill[name] for name, on in self.device.items()
                     if on == device])
        session.run(self.copy_all)
        logging.warning("refilled %s from the mirrors: nothing restored "
                        "(it was done without)", device)

    def _fill_from(self, to: tf.Variable, source: tf.Variable) -> None:
        with tf.device(to.device):
            self.fill[to.op.name] = to.assign(source.read_value(),
                                              read_value=False)
        self.partner[to.op.name] = source.op.name
        self.device[to.op.name] = to.device

    def ops_for(self, missing: list[str]) -> list | None:
        """The fills for `missing` (variable names), or None where one has
        no fill or its partner is missing too."""
        gone = set(missing)
        if any(m not in self.fill or self.partner.get(m) in gone
               for m in gone):
            return None
        return [self.fill[m] for m in sorted(gone)]
