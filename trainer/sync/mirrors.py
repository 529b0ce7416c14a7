"""Mirrors (--ps_mirrors): a copy of every ps's shards and optimizer state
on the next ps, updated alike inside the chief's guarded write, so that a
ps started again is refilled from them (docs/how-it-works.md, "A lost ps,
and its mirrors"). ps 0's step has two copies on ps 1: `begun`, set before
a write touches ps 1, and `global_step`, set at its end; where they differ
a write was cut short, and ps 0 is not refilled (the chief restores)."""

from absl import logging
import tensorflow as tf

from trainer.learning import optim

# After "params/" by name: Adam keeps its step state beside its first
# variable by name, so a graph serving a shard from its copy keeps it put.
COPY_PREFIX = "ps_mirror/"
PS0_COPIES = 1   # the ps task that keeps the copies of ps 0's state


def copy_task(ps: int, num_ps: int) -> int:
    """The ps task that keeps the copies of ps `ps`'s shards."""
    return (ps + 1) % num_ps


def copy_name(primary_name: str) -> str:
    """`params/shard_1` -> `ps_mirror/shard_1`: its copy's variable."""
    return COPY_PREFIX + primary_name.split("/")[-1]


def serving_task(ps: int, ps_down: int | None, num_ps: int) -> int:
    """The ps task serving ps `ps`'s shards: itself, or its copies' one."""
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
        """primaries: the shards (float32 [n_i]), shard i on ps
        ps_indices[i]; update: a second optimizer of the run's rule;
        global_step: int64 [] on ps 0."""
        self.primaries, self.update = primaries, update
        self.global_step, self.copies = global_step, []
        for v, p in zip(primaries, ps_indices):
            with tf.compat.v1.device(f"/job:ps/task:{copy_task(p, num_ps)}"):
                copy = _copy(copy_name(v.op.name), v, trainable=True)
            self.copies.append(copy)
        with tf.compat.v1.device(f"/job:ps/task:{PS0_COPIES}"):
            self.step_copy = _copy(COPY_PREFIX + "global_step", global_step)
            self.begun = _copy(COPY_PREFIX + "begun", global_step)

    def apply(self, step: tf.Tensor, mean_grads: list,
              update: optim.ScheduledUpdate) -> tf.Operation:
        """`update` (to the primaries) and ours (to the copies) of mean_grads
        (float32 [n_i], where the primaries are), once `begun` is set."""
        with tf.device(self.begun.device):
            begun = self.begun.assign(step + 1, read_value=False)
        held = []
        for g in mean_grads:   # each where it is: no extra transfer
            with tf.device(g.device), tf.control_dependencies([begun]):
                held.append(tf.identity(g))
        return tf.group(update.apply(step, list(zip(held, self.primaries))),
                        self.update.apply(step, list(zip(held, self.copies))))

    def advance(self, next_step: tf.Tensor) -> tf.Tensor:
        """next_step (int64 [], the new global step) once copied to ps 1,
        after the step's write on ps 0: that write is whole there."""
        with tf.device(self.step_copy.device):
            copied = self.step_copy.assign(next_step, read_value=False)
        with tf.control_dependencies([copied]):
            return tf.identity(next_step)

    def whole(self) -> tf.Tensor:
        """bool []: no write was cut short on ps 1 (`begun` == its copy of
        the step: its copies of ps 0's state are at one step)."""
        with tf.device(self.begun.device):
            return tf.equal(self.begun.read_value(),
                            self.step_copy.read_value())

    def pairs(self, optimizer) -> list[tuple]:
        """(primary, copy) per mirrored variable; call once the step's
        updates (which make the slots) are built."""
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
    # By name, in which the two optimizers differ by a suffix (beta1_power_1)
    slots = {optimizer.get_slot(v, n).op.name for v in slotted
             for n in optimizer.get_slot_names()}
    return sorted((v for v in optimizer.variables()
                   if v.op.name not in slots), key=lambda v: v.op.name)


class Refill:
    """The chief's side: refills a ps from the partners of its variables."""

    def __init__(self, mirrors: Mirrors, pairs: list[tuple], afresh: list):
        """pairs: mirrors.pairs(); afresh: variables that start afresh."""
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
        self.copy_all = tf.group([self.fill[b.op.name] for _, b in pairs]
                                 + [self.fill[mirrors.begun.op.name]])

    def after_restart(self, session, uninitialized: tf.Tensor) -> bool:
        """Fills the variables a ps started again lost (uninitialized:
        string [n]) if each has a live partner, whole. Returns whether ps
        0's state was refilled (the step record then starts afresh)."""
        missing = [m.decode() for m in session.run(uninitialized)]
        fills = self.ops_for(missing)
        if not fills:
            return False
        ps0 = self._ps0_step in missing
        if ps0 and not session.run(self._whole):
            logging.warning("ps 0 was lost inside a step's write: its "
                            "copies on ps 1 are not whole")
            return False
        session.run(fills)
        # Copies whose primary lived may be behind: none were written while
        # a ps was done without (trainer/roles/without_ps.py).
        session.run(self.copy_all)
        logging.warning("refilled %s from the mirrors: nothing restored",
                        ", ".join(sorted({self.device[m] for m in missing})))
        return ps0

    def take_back(self, session, device: str) -> None:
        """Sets every variable on `device` from its partner, whatever it
        holds (a ps done without may hold the step it was cut off at)."""
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
        """The fills for `missing` (names), or None if one has no fill or
        its partner is missing too."""
        gone = set(missing)
        if any(m not in self.fill or self.partner.get(m) in gone
               for m in gone):
            return None
        return [self.fill[m] for m in sorted(gone)]
