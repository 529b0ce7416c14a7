"""Traced steps as a Chrome trace and as a per-step time breakdown.

`breakdown` gives each instant of the step to the highest-priority category
of the events active then, so the parts partition the step exactly.
Priority (CATEGORIES order): compute > aggregate_apply > pull_params >
push_grads > wait_others > other (the chief computing while it waits for
arrivals: compute; a transfer during a wait: that transfer).

Categories, first match wins (resources are followed through Enter,
Identity, Switch and Merge to their variable or queue; names as sync.py):
  * QueueDequeue* (a non-chief's `sync_tokens_<k>`, the chief's
    `sync_arrivals` loop): wait_others. Control flow, constants, handles,
    NoOp: other. Any other op on the worker device: compute.
  * On a ps: apply kernels, ops under an optimizer scope (Adam,
    GradientDescent, Momentum) or on its slots (`params/shard_<i>/<slot>`,
    `beta<n>_power`): aggregate_apply. Writes into `sync/grads_<s>` or
    `sync/stats` and the enqueue on `sync_arrivals`: push_grads, as are the
    ps ops they depend on (unpacking the received gradient) and the
    transfers feeding those. Other uses of `sync/*`, setting `global_step`,
    filling `sync_tokens_*`: aggregate_apply. Reading `params/shard_<i>`:
    pull_params. Other ops inherit pull_params or aggregate_apply from an
    input (packing shard 0 with the step; summing the rows), else other.
  * A transfer (RecvTensor, _Recv, _Send, ...) of 0 bytes is a control edge
    or a dead tensor of the loop's untaken iteration: other. Else
    push_grads if it feeds a push, else its producer's category if that is
    pull_params, aggregate_apply or wait_others, else other (loop
    predicates, fed values). Times are each task's clock (mind the skew).
"""

import collections
import dataclasses
import re

from absl import logging

from trainer.observe import results
from trainer.observe.overlap import overlap_ns
from trainer.common.errors import UserError

CATEGORIES = ("compute", "aggregate_apply", "pull_params", "push_grads",
              "wait_others", "other")
STEP_GAP_US = 200  # gap between consecutive steps in a trace file
_STRUCTURAL = frozenset(
    "Const NoOp ControlTrigger Enter Exit Merge Switch NextIteration LoopCond "
    "VarHandleOp FIFOQueueV2 PaddingFIFOQueueV2".split())
_PASS_THROUGH = frozenset("Enter Identity Switch Merge".split())
_TRANSFER_OPS = frozenset("_Send _Recv _HostSend _HostRecv RecvTensor".split())
_OPTIMIZER_SCOPES = frozenset(("Adam", "GradientDescent", "Momentum"))
_RESOURCE_RULES = (  # (resource name, op type, category)
    (r"params/shard_\d+/.+|beta\d_power", r".", "aggregate_apply"),
    (r"sync/(grads_\d+|stats)", r"Scatter(Update|Add)|Assign", "push_grads"),
    (r"sync_arrivals", r"Enqueue", "push_grads"),
    (r"sync/.*", r".", "aggregate_apply"),
    (r"global_step|sync_tokens_\d+", r"Assign|Enqueue", "aggregate_apply"),
    (r"params/shard_\d+", r"Read", "pull_params"))
_INHERITED = ("pull_params", "aggregate_apply")
_LABEL = re.compile(r"^(?:\[.*?\] )*(\S+) = (\w+)\((.*)\)$")  # [memory] op
_RECV_LABEL = re.compile(
    r"^\[([\d.]+)(M?)B\].*? edge_\d+_(\S+) from (\S+) to (\S+)$")
_RECV_NODE_SUFFIX = re.compile(r"_S\d+$")  # "<tensor>_S<n>": the _Recv node


@dataclasses.dataclass
class _Event:
    device: str
    name: str
    op: str                # op type; "RecvTensor" for a gRPC transfer
    start_ns: int
    end_ns: int
    label: str
    inputs: tuple = ()     # data inputs: node names on the same device
    tensor: str = ""       # transfers: the node that produced the tensor
    src: str = ""          # transfers: the sending device, if known
    size: int = -1         # transfers: bytes, if known
    category: str = "other"
    is_transfer: bool = False

    def to_json(self, shift_ns: int, pid: int, label) -> dict:
        args = dict(op=self.op, label=self.label, step=label)
        if self.is_transfer:
            args.update(transfer=1, bytes=self.size, src=self.src)
        return _span(f"{self.op} {self.tensor}" if self.is_transfer else
                     self.name, self.category, pid, self.start_ns + shift_ns,
                     self.end_ns + shift_ns, **args)


def _parse_node(device: str, node) -> _Event:
    """A node_stats of an op ("[cpu 1MB 1MB] name = Op(input, ^ctl)") or
    a transfer ("[<n>B or <x>MB] [rate] edge_<k>_<op> from <dev> to <dev>")."""
    start, length = node.all_start_nanos, node.all_end_rel_nanos
    if not start:  # RecvTensor entries carry micros only
        start = node.all_start_micros * 1000
        length = node.all_end_rel_micros * 1000
    e = _Event(device, node.node_name, "", start, start + max(length, 0),
               node.timeline_label)
    recv, op = _RECV_LABEL.match(e.label), _LABEL.match(e.label)
    if recv or e.name == "RecvTensor":
        e.op = "RecvTensor"
        if recv:
            e.size = int(float(recv[1]) * (1 << 20 if recv[2] else 1))
            e.tensor, e.src = recv[3], recv[4]
    elif op:
        e.op, e.inputs = op[2], tuple(i.split(":")[0] for i in op[3].split(
            ", ") if i and not i.startswith("^"))
    e.is_transfer = e.op in _TRANSFER_OPS
    return e


def _parse(run_metadata, what: str) -> list[_Event]:
    events = [_parse_node(dev.device, node)
              for dev in run_metadata.step_stats.dev_stats
              for node in dev.node_stats]
    if not events:
        raise UserError(f"{what} holds no step stats; run the step with "
                        "RunOptions(trace_level=FULL_TRACE)")
    return events


def _device_matches(device: str, pattern: str) -> bool:
    """If each /key:value of `pattern` is in `device` (task:1, not task:10)."""
    wanted = re.findall(r"([a-z_]+):([^/]+)", pattern)
    parts = set(re.findall(r"([a-z_]+):([^/]+)", device))
    return bool(wanted) and all(w in parts for w in wanted)


class _Classifier:
    """Sets the category of every event of one step (module doc)."""

    def __init__(self, events: list[_Event], worker_pattern: str):
        self.worker = worker_pattern
        self.nodes = {(e.device, e.name): e for e in events
                      if not e.is_transfer}
        self.received = {(e.device, e.tensor) for e in events if e.is_transfer}
        self.memo: dict = {}
        self.pushed: set = set()  # (device, node or received tensor)
        for key in list(self.nodes):
            if self.category(*key) == "push_grads":
                self.mark_push(*key)
        for e in events:
            e.category = self.transfer_category(e) if e.is_transfer else (
                "push_grads" if (e.device, e.name) in self.pushed
                else self.category(e.device, e.name))

    def resource(self, device: str, name: str, hops: int = 30) -> str:
        node = self.nodes.get((device, name))
        if hops and node and node.op in _PASS_THROUGH and node.inputs:
            return self.resource(device, node.inputs[0], hops - 1)
        return name

    def direct(self, e: _Event) -> str | None:  # None: inherit
        if e.op.startswith("QueueDequeue"):
            return "wait_others"
        if e.op in _STRUCTURAL or not e.op:
            return "other"
        if _device_matches(e.device, self.worker):
            return "compute"
        if "Apply" in e.op or _OPTIMIZER_SCOPES & set(e.name.split("/")):
            return "aggregate_apply"
        resources = [] if e.op in _PASS_THROUGH else [  # not a use of it
            self.resource(e.device, i) for i in e.inputs]
        return next((category for r in resources
                     for r_re, op_re, category in _RESOURCE_RULES
                     if re.fullmatch(r_re, r) and re.search(op_re, e.op)),
                    None)

    def category(self, device: str, name: str) -> str:
        key = (device, name)
        if key not in self.memo:
            self.memo[key] = "other"  # breaks cycles through loops
            e = self.nodes.get(key)
            found = self.direct(e) if e else "other"
            if found is None:
                inputs = [self.category(device, i) for i in e.inputs]
                found = next((c for c in inputs if c in _INHERITED), "other")
            self.memo[key] = found
        return self.memo[key]

    def mark_push(self, device: str, name: str) -> None:
        """Marks `name`, the ps ops (not handles) and transfers it needs."""
        recv = (device, _RECV_NODE_SUFFIX.sub("", name))  # input "<t>_S<n>"
        self.pushed |= {recv} & self.received  # the transfer of tensor t
        e = self.nodes.get((device, name))
        handle = self.nodes.get((device, self.resource(device, name)))
        if e is None or (device, name) in self.pushed or e.op in _STRUCTURAL \
                or (handle and handle.op in _STRUCTURAL):
            return
        self.pushed.add((device, name))
        for i in e.inputs:
            if self.category(device, i) == "other":
                self.mark_push(device, i)

    def transfer_category(self, e: _Event) -> str:
        if e.size == 0:
            return "other"
        if (e.device, e.tensor) in self.pushed:
            return "push_grads"
        found = self.category(e.src, e.tensor)  # other if src is unknown
        return found if found in _INHERITED + ("wait_others",) else "other"


def _sweep(events: list[_Event]) -> list[list]:
    """The step as [start_ns, end_ns, category] segments: each instant goes
    to the highest-priority category active then (else other)."""
    changes = collections.defaultdict(lambda: [0] * len(CATEGORIES))
    for e in events:
        if e.end_ns > e.start_ns:
            changes[e.start_ns][CATEGORIES.index(e.category)] += 1
            changes[e.end_ns][CATEGORIES.index(e.category)] -= 1
    times = sorted(set(changes) | {min(e.start_ns for e in events),
                                   max(e.end_ns for e in events)})
    active, segments = [0] * len(CATEGORIES), []
    for now, later in zip(times, times[1:]):
        if now in changes:
            active = [a + d for a, d in zip(active, changes[now])]
        winner = next((c for c, a in zip(CATEGORIES, active) if a), "other")
        if not segments or segments[-1][2] != winner:
            segments.append([now, later, winner])
        segments[-1][1] = later
    return segments or [[times[0], times[0], "other"]]  # all of length 0


def _with_shares(step_ms: float, ms: dict, overlap_ms: float = 0.0) -> dict:
    share = {c: (v / step_ms if step_ms > 0 else 0.0) for c, v in ms.items()}
    return {"step_ms": step_ms, "ms": ms, "share": share,
            "overlap_ms": overlap_ms}


def breakdown(run_metadata, worker_device_substring: str,
              is_chief: bool) -> dict:
    """Splits one traced step's wall time into CATEGORIES (module doc).

    `worker_device_substring`: /key:value parts of the worker's device name
    ("/job:worker/task:1"); `is_chief` is only checked against the trace.
    Returns {"step_ms": first event start to last event end, all devices,
    "ms": {category: ms}, "share": {category: fraction}, "overlap_ms": the
    time pushes and pulls were both on the way (overlap_ns)}: ms sum to
    step_ms.
    """
    events = _parse(run_metadata, "the RunMetadata")
    if not any(_device_matches(e.device, worker_device_substring)
               for e in events):
        devices = ", ".join(sorted({e.device for e in events}))
        raise UserError(f"no device in the trace matches worker "
                        f"{worker_device_substring!r} (it has {devices}); "
                        "pass /job:worker/task:<index>")
    _Classifier(events, worker_device_substring)
    segments = _sweep(events)  # summed in integer ns, then made ms
    ms = {c: sum(e - b for b, e, k in segments if k == c) / 1e6
          for c in CATEGORIES}
    if not is_chief and ms["aggregate_apply"] > 0:
        logging.warning("The trace of non-chief %s shows %.3f ms of "
                        "aggregation/apply; is it the chief's trace?",
                        worker_device_substring, ms["aggregate_apply"])
    return _with_shares((segments[-1][1] - segments[0][0]) / 1e6, ms,
                        overlap_ns(events) / 1e6)


def mean_breakdown(breakdowns: list[dict]) -> dict:
    """`breakdown`s averaged: ms, step_ms, shares of the mean, num_steps."""
    if not breakdowns:
        raise UserError("no traced steps to average; check --trace_steps")
    count = len(breakdowns)
    ms = {c: sum(b["ms"][c] for b in breakdowns) / count for c in CATEGORIES}
    step_ms = sum(b["step_ms"] for b in breakdowns) / count
    overlap = sum(b.get("overlap_ms", 0.0) for b in breakdowns) / count
    return dict(_with_shares(step_ms, ms, overlap), num_steps=count)


def format_breakdown(result: dict) -> str:
    """One line: the step time, then each category's ms and share."""
    count = result.get("num_steps")
    mean = f" (mean of {count} steps)" if count else ""
    return " | ".join([f"step {result['step_ms']:.3f} ms{mean}"] + [
        f"{c} {result['ms'][c]:.3f} ms ({100 * result['share'][c]:.1f}%)"
        for c in CATEGORIES] + [
        f"push/pull overlap {result.get('overlap_ms', 0.0):.3f} ms"])


def _span(name: str, cat: str, pid: int, start_ns: int, end_ns: int,
          **args) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "args":
            args, "ts": start_ns / 1e3, "dur": (end_ns - start_ns) / 1e3}


def _meta(pid: int, tid: int, kind: str, **args) -> dict:
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": args}


def _assign_rows(ops: list[dict]) -> list[dict]:
    """Sets each event's row (tid) by device, category and kind (op or
    transfer), adding rows where events overlap; returns the row names."""
    ends, names = collections.defaultdict(list), {}
    for ev in sorted(ops, key=lambda ev: ev["ts"]):
        transfer = "transfer" in ev["args"]
        base = 1000 * (2 * CATEGORIES.index(ev["cat"]) + transfer)
        row = ends[(ev["pid"], base)]
        lane = next((i for i, end in enumerate(row) if end <= ev["ts"]),
                    len(row))
        row[lane:lane + 1] = [ev["ts"] + ev["dur"]]
        ev["tid"] = base + lane
        names[(ev["pid"], ev["tid"])] = ev["cat"] + (
            " transfers" if transfer else "") + (f" {lane + 1}" * bool(lane))
    return [_meta(pid, tid, "thread_name", name=name)
            for (pid, tid), name in sorted(names.items())]


def write_chrome_trace(path: str, run_metadatas: list,
                       step_labels: list[int] | None = None) -> None:
    """Writes the traced steps, one after another, as one Chrome trace.

    For chrome://tracing and Perfetto. Each device is a process with a row
    per category (module doc), ops and transfers apart; process "steps" has
    each step's breakdown (the category winning each instant). Steps are
    STEP_GAP_US apart; the file is written atomically.
    """
    labels = list(range(len(run_metadatas)) if step_labels is None
                  else step_labels)
    if not run_metadatas or len(labels) != len(run_metadatas):
        raise UserError(f"got {len(labels)} step labels for "
                        f"{len(run_metadatas)} RunMetadata; pass one per step")
    steps = [_parse(metadata, f"the RunMetadata of step {label}")
             for label, metadata in zip(labels, run_metadatas)]
    devices = sorted({e.device for s in steps for e in s}, key=lambda d: (
        not _device_matches(d, "/job:worker"), d))
    pids = {name: i for i, name in enumerate(["steps"] + devices)}
    ops, marks, cursor_ns = [], [], 0
    for label, events in zip(labels, steps):
        _Classifier(events, "/job:worker")
        segments = _sweep(events)
        shift = cursor_ns - segments[0][0]
        ops += [e.to_json(shift, pids[e.device], label) for e in events]
        marks += [_span(c, c, 0, b + shift, e + shift, step=label)
                  for b, e, c in segments]
        cursor_ns = segments[-1][1] + shift + STEP_GAP_US * 1000
    meta = [_meta(pid, 0, "process_name", name=name)
            for name, pid in pids.items()]
    meta += [_meta(0, 0, "thread_name", name="breakdown")] + _assign_rows(ops)
    # Compact (no indent): a trace holds tens of thousands of events.
    results.write_json(path, {"traceEvents": meta + marks + ops,
                               "displayTimeUnit": "ms"}, indent=None)
    logging.info("Wrote the trace of %d step(s) on %d device(s) to %s",
                 len(steps), len(devices), path)
