"""Mirrors (--ps_mirrors): a copy of every ps's shards and their optimizer
state on the next ps, updated by every step alike, so that a ps started
again after it died is refilled from the copies instead of a checkpoint.

Shard i, on ps p, has its copy `mirror/shard_<i>` (float32 [n_i]) on ps
(p + 1) % P, with the slots and other state (Adam's beta powers) of a
second optimizer of the same rule. A step's averaged gradient of shard i
is applied to both, inside the chief's guarded write (sync/chief_lock.py),
so each copy holds its primary's bits. Copies are not in checkpoints:
after an initialize or a restore every copy is set from its primary
(`Refill.copy_all`).

A ps killed inside a write may leave it half done on the survivors; the
chief lock tells (its epoch was never put back), and the chief restores
the newest checkpoint then, as without mirrors. ps 0's own state (the
global step, the lock, the protocol's counts) has no copy: a ps 0 started
again is restored from a checkpoint too.
"""

from absl import logging
import tensorflow as tf

from trainer.learning import optim

COPY_PREFIX = "mirror/"


class Mirrors:
    """The copies of one chief graph, and the ops that refill them."""

    def __init__(self, primaries: list, ps_indices: list[int], num_ps: int,
                 update: optim.ScheduledUpdate):
        """primaries: the shard variables (float32 [n_i]), shard i on ps
        ps_indices[i]; update: a second optimizer of the run's rule."""
        self.primaries, self.update = primaries, update
        self.copies = []
        for v, p in zip(primaries, ps_indices):
            with tf.compat.v1.device(f"/job:ps/task:{(p + 1) % num_ps}"):
                self.copies.append(tf.compat.v1.get_variable(
                    COPY_PREFIX + v.op.name.split("/")[-1], v.shape,
                    v.dtype.base_dtype,
                    initializer=tf.compat.v1.zeros_initializer(),
                    use_resource=True))

    def apply(self, step: tf.Tensor, mean_grads: list) -> tf.Operation:
        """The step's update (mean_grads: float32 [n_i] per shard, on the
        primaries' ps tasks) applied to the copies."""
        return self.update.apply(step, list(zip(mean_grads, self.copies)))

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
        return pairs + list(zip(theirs, ours))


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

    def __init__(self, pairs: list[tuple], transient: list):
        self.fill, self.partner, self.device = {}, {}, {}
        for a, b in pairs:
            for to, source in ((a, b), (b, a)):
                with tf.device(to.device):
                    self.fill[to.op.name] = to.assign(source.read_value(),
                                                      read_value=False)
                self.partner[to.op.name] = source.op.name
                self.device[to.op.name] = to.device
        for v in transient:   # the protocol's state there starts afresh
            self.fill[v.op.name] = v.initializer
        # After an initialize or a restore: each copy from its primary.
        self.copy_all = tf.group([self.fill[b.op.name] for _, b in pairs])

    def after_restart(self, session, uninitialized: tf.Tensor) -> None:
        """Fills what a ps started again lost from the copies, where each
        variable it lost has a live one (then nothing is restored).

        uninitialized: string [n], the variables not set on the ps tasks.
        """
        missing = [m.decode() for m in session.run(uninitialized)]
        fills = self.ops_for(missing) if missing else None
        if fills:
            session.run(fills)
            where = sorted({self.device[m] for m in missing
                            if m in self.device})
            logging.warning("refilled %s from the mirrors: nothing restored",
                            ", ".join(where))

    def ops_for(self, missing: list[str]) -> list | None:
        """The fills for `missing` (variable names), or None where one has
        no fill or its partner is missing too."""
        gone = set(missing)
        if any(m not in self.fill or self.partner.get(m) in gone
               for m in gone):
            return None
        return [self.fill[m] for m in sorted(gone)]
