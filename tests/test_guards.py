"""Every write the chief's loop makes on a ps task is refused to a deposed
chief (trainer/roles/takeover.py lists them), checked on the graph itself:
the loop is a While op whose body, and the conds in it, are functions, so
this walks them, following each resource argument back to its variable or
queue, and sorts each write by whether a guard's cond (the name scope
takeover.GUARD, made by ChiefLock.guarded and .if_current) encloses it."""

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

    stack, seen = [t.op.name for t in tf.nest.flatten(loop_outputs)], set()
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            if nodes[name].op in ("While", "StatelessWhile"):
                visit(nodes[name], False, top)
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
