"""Every write the chief makes on a ps task, in its loop and in each other
op it runs, is refused to a deposed chief or harmless (trainer/roles/
takeover.py lists them), checked on the graph itself:
the loop is a While op whose body, and the conds in it, are functions, so
this walks them, following each resource argument back to its variable or
queue, and sorts each write by whether a guard's cond (the name scope
takeover.GUARD, made by ChiefLock.guarded and .if_current) encloses it."""

import dataclasses

import pytest
import tensorflow as tf

from trainer.cluster.spec import make_cluster, make_task
from trainer.common.config import TrainConfig
from trainer.roles import graph as graph_lib
from trainer.roles import takeover

WRITES = ("Assign", "Scatter", "Enqueue", "Dequeue", "ResourceApply")
CALLS = {"If": ("then_branch", "else_branch"),
         "StatelessIf": ("then_branch", "else_branch"),
         "While": ("cond", "body"), "StatelessWhile": ("cond", "body")}

# What the loop may write unguarded, as takeover.py's list says, and why.
UNGUARDED = {
    "sync/chief_lock": "the lock's own take and put",
    "sync/chief": "the beat of a round planned under the lock",
    "sync/events": "its own push's PUSHED; an event taken, and put back "
                   "if its act is refused",
    "sync/stats": "its own push (rows of its own)",
    "sync/pushed_slices": "its own push",
    "sync/grads_0": "its own push", "sync/grads_1": "its own push",
    "sync/pull_turn_0_1": "a pull turn passed on or RELEASEd",
    "sync/pull_turn_1_0": "a pull turn passed on or RELEASEd",
}


def _loop_writes(graph: tf.Graph, loop_outputs: dict) -> list:
    """[(guarded, op type, resource name)] for each write on a ps task in
    the While loops that `loop_outputs` come from."""
    return _writes(graph, loop_outputs, loops_only=True)


def _writes(graph: tf.Graph, fetches, loops_only: bool = False) -> list:
    """[(guarded, op type, resource name)] for each write on a ps task
    that running `fetches` (ops or tensors, nested) can make: at the top
    level and in every function a node there calls (loops_only: only
    those the While nodes call)."""
    gd = graph.as_graph_def()
    funcs = {f.signature.name: f for f in gd.library.function}
    nodes = {n.name: n for n in gd.node}
    found = []

    def top(name):   # a top-level input -> its variable's or queue's name
        n = nodes[name.lstrip("^").split(":")[0]]
        if n.op == "Identity":
            return top(n.input[0])
        shared = n.attr["shared_name"].s.decode() if (
            "shared_name" in n.attr) else ""
        return shared or n.name

    def visit(node, guarded, resolve):
        data = [i for i in node.input if not i.startswith("^")]
        if node.op in CALLS:   # an If's first input is its condition
            args = [resolve(i) for i in data[node.op.endswith("If"):]]
            for attr in CALLS[node.op]:
                inside = guarded or (attr == "then_branch"
                                     and takeover.GUARD in node.name)
                visit_function(node.attr[attr].func.name, inside, args)
        if node.op.startswith(("Queue", "Resource", "Assign")) and any(
                w in node.op for w in WRITES) and "/job:ps" in node.device:
            found.append((guarded, node.op, resolve(data[0])))

    def visit_function(name, guarded, args):
        f = funcs[name]
        local = dict(zip((a.name for a in f.signature.input_arg), args))
        body = {n.name: n for n in f.node_def}

        def resolve(x):
            base = x.split(":")[0]
            if base in local:
                return local[base]
            if base in body and body[base].op == "Identity":
                return resolve(body[base].input[0])
            return f"?{name}/{base}"   # not followed: the test fails
        for n in f.node_def:
            visit(n, guarded, resolve)

    stack = [getattr(t, "op", t).name for t in tf.nest.flatten(fetches)]
    seen = set()
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            if not loops_only or nodes[name].op in ("While",
                                                    "StatelessWhile"):
                visit(nodes[name], takeover.GUARD in name, top)
            stack += [i.lstrip("^").split(":")[0] for i in nodes[name].input]
    return found


@pytest.mark.parametrize("flags", [{}, {"ps_mirrors": True},
                                   {"ordered_pulls": True}],
                         ids=["plain", "ps_mirrors", "ordered_pulls"])
def test_every_write_of_the_chiefs_loop_on_a_ps_is_guarded_or_listed(flags):
    cluster = make_cluster(("localhost:1", "localhost:2"),
                           ("localhost:3", "localhost:4"), "test")
    g = graph_lib.build_worker(
        TrainConfig(logdir="unused", **flags),
        make_task(cluster, "worker", 0, "t"), 600, 100, 50, as_chief=True)
    writes = _loop_writes(g.graph, g.loop_outputs)
    guarded = {name for inside, _, name in writes if inside}
    unguarded = {name for inside, _, name in writes if not inside}
    assert unguarded <= UNGUARDED.keys(), unguarded - UNGUARDED.keys()
    # The step's update and the plan are among the guarded writes.
    assert {"global_step", "sync/round", "sync/roster",
            "sync/averaged_by_step"} <= guarded, guarded
    assert not [n for _, _, n in writes if n.startswith("?")], writes
    if flags.get("ps_mirrors"):
        assert {"ps_mirror/begun", "ps_mirror/global_step"} <= guarded


# Every ChiefOps field, by how a deposed chief is kept from writing with it
# (takeover.py's list). GUARDED: each write on a ps is under the lock or
# the record (guarded, if_current), but the lock's own take and put and
# an event taken (put back if its act is refused), as in the loop.
GUARDED = {"halt_op", "lost_op", "membership", "membership_log", "absorb_op"}
# Run only after Chief._check_still_chief (deposed_by) just before them:
# the start, a restore or a refill, and the stop.
CHECKED_FIRST = {"init_op", "transient_init_op", "transient_inits",
                 "start_op", "mark_ready_op", "set_record_from", "stop_op",
                 "saver", "refill"}
# Harmless without a check: the deadlines' take and LATE (of their round),
# and the end, which follows a loop run to the last step.
HARMLESS = {"deadlines", "late_op", "end_op", "take_finished",
            "shutdown_ops"}
# Reads, feeds and Python: no write at all.
READS = {"uninitialized", "roster", "slices", "last_push", "issued_round",
         "lost_in", "late_in", "generation", "checkpoint_shapes",
         "eval_outputs", "testset_init", "param_values", "contributions",
         "by_step", "record_from", "stop_reason_in", "shutdown_status"}


def _graph_parts(value) -> list:
    """The ops and tensors in a ChiefOps field's value."""
    if isinstance(value, (tf.Tensor, tf.Operation)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _graph_parts(v)]
    if isinstance(value, dict):
        return _graph_parts(list(value.values()))
    if dataclasses.is_dataclass(value):
        return _graph_parts([getattr(value, f.name)
                             for f in dataclasses.fields(value)])
    return []


def test_every_chief_op_is_guarded_checked_first_or_harmless():
    """Beside the loop: each op the chief runs is classed above, and the
    guarded and reading ones are checked on the graph."""
    cluster = make_cluster(("localhost:1", "localhost:2"),
                           ("localhost:3", "localhost:4"), "test")
    g = graph_lib.build_worker(
        TrainConfig(logdir="unused", ps_mirrors=True),
        make_task(cluster, "worker", 0, "t"), 600, 100, 50, as_chief=True)
    ops = g.chief
    fields = {f.name for f in dataclasses.fields(ops)}
    classes = (GUARDED, CHECKED_FIRST, HARMLESS, READS)
    assert fields == set().union(*classes), fields ^ set().union(*classes)
    assert sum(map(len, classes)) == len(fields)   # each in one class
    for name in GUARDED:
        writes = _writes(g.graph, _graph_parts(getattr(ops, name)))
        assert [w for w in writes if w[0]], name   # it writes, guarded
        bare = {n for inside, _, n in writes if not inside}
        assert bare <= {"sync/chief_lock", "sync/events"}, (name, bare)
    for name in READS:
        assert not _writes(g.graph, _graph_parts(getattr(ops, name))), name
    # What CHECKED_FIRST covers does write, unguarded: the check matters.
    assert [w for w in _writes(g.graph, ops.start_op) if not w[0]]
