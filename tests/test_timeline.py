"""trainer.observe.timeline: the sweep on hand-made step stats, then real traces of
a toy step shaped like the trainer's on an in-process ps cluster."""

import json

import pytest
import tensorflow as tf

from tests import helpers
from trainer.observe import timeline
from trainer.common.errors import UserError

WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
PS = "/job:ps/replica:0/task:0/device:CPU:0"
T0_US = 1_700_000_000_000_000  # an absolute start, like TensorFlow's clock


def _op(dev, label, start_ms, end_ms):
    """An op's node_stats as TensorFlow writes it: nanosecond fields, and
    the label may start with the memory the op allocated ("[cpu 1MB 1MB]")."""
    node = dev.node_stats.add(node_name=label.split(" = ")[0].split("] ")[-1],
                              timeline_label=label)
    node.all_start_nanos = T0_US * 1000 + round(start_ms * 1e6)
    node.all_end_rel_nanos = round((end_ms - start_ms) * 1e6)
    node.all_start_micros = node.all_start_nanos // 1000
    node.all_end_rel_micros = node.all_end_rel_nanos // 1000


def _recv(dev, tensor, size, src, start_ms, end_ms):
    """A RecvTensor entry of a transfer into `dev` as TensorFlow writes it:
    microseconds only, sizes from 0.1 MiB on in MB."""
    text = f"{size / (1 << 20):.1f}MB" if size >= 0.1 * (1 << 20) \
        else f"{size}B"
    dev.node_stats.add(
        node_name="RecvTensor", all_start_micros=T0_US + round(start_ms * 1e3),
        all_end_rel_micros=round((end_ms - start_ms) * 1e3),
        timeline_label=f"[{text}] [1.0Mb/s] edge_7_{tensor} from {src} "
                       f"to {dev.device}")


def _hand_made_step() -> tf.compat.v1.RunMetadata:
    """One step of 30 ms whose exact breakdown is known (see the test);
    its step_stats is a tensorflow.core.framework.StepStats proto."""
    metadata = tf.compat.v1.RunMetadata()
    worker = metadata.step_stats.dev_stats.add(device=WORKER)
    ps = metadata.step_stats.dev_stats.add(device=PS)
    transfers_in = metadata.step_stats.dev_stats.add(device=PS)
    _op(ps, "sync_tokens_1 = FIFOQueueV2()", 0, 0.001)
    _op(ps, "tokens = QueueDequeueV2(sync_tokens_1)", 0, 10)
    _op(ps, "enter/_1 = Enter(params/shard_0)", 9, 9.5)
    _op(ps, "Read/ReadVariableOp = ReadVariableOp(enter/_1, ^tokens)",
        10, 10.5)
    _op(ps, "[cpu 0.4MB 0.4MB] concat = ConcatV2(Read/ReadVariableOp, step)",
        10.5, 11)
    _recv(worker, "concat", 400_000, PS, 11, 14)
    _op(worker, "[cpu 0.4MB 0.4MB] MatMul = MatMul(x, concat_S2)", 13, 20)
    _op(worker, "Relu = Relu(MatMul)", 15, 18)  # overlaps MatMul
    _op(worker, "grad = Reshape(Relu, shape)", 19.5, 20)
    _recv(transfers_in, "grad", 4096, WORKER, 20, 23)
    # 0 bytes: the dead parameters of the loop's untaken iteration.
    _recv(worker, "concat", 0, PS, 20, 30)
    _op(ps, "arrival = QueueDequeueV2(sync_arrivals)", 22, 27)
    _op(ps, "slice = StridedSlice(grad_S3, begin, end)", 23, 23.25)
    _op(ps, "write = ResourceScatterUpdate(sync/grads_0, row, slice)", 23.25,
        24)
    _op(ps, "Gather = ResourceGather(sync/grads_0, rows, ^write)", 24, 25)
    _op(ps, "Sum = Sum(Gather, axis)", 25, 26)
    _op(ps, "GradientDescent/update_params/shard_0/ResourceApplyGradient"
        "Descent = ResourceApplyGradientDescent(params/shard_0, lr, Sum)",
        26, 28)
    return metadata


def test_sweep_gives_each_instant_to_the_highest_priority_category():
    result = timeline.breakdown(_hand_made_step(), "/job:worker/task:0",
                                is_chief=True)
    # [0, 10) token wait; [10, 14) read + transfer of the parameters;
    # [14, 20) matmul (its overlap with the transfer counts as compute);
    # [20, 24) gradient transfer and row write (over the arrival wait and
    # a 0-byte transfer); [24, 28) gather, sum, apply (over the wait);
    # [28, 30) only the 0-byte transfer: other.
    expected = {"compute": 7, "aggregate_apply": 4, "pull_params": 3,
                "push_grads": 4, "wait_others": 10, "other": 2}
    assert result["step_ms"] == pytest.approx(30, abs=1e-9)
    assert result["ms"] == pytest.approx(expected, abs=1e-9)
    assert result["share"]["wait_others"] == pytest.approx(10 / 30)
    assert sum(result["share"].values()) == pytest.approx(1)


def test_hand_made_trace_puts_categories_and_overlaps_on_their_own_rows(
        tmp_path):
    path = tmp_path / "trace.json"
    timeline.write_chrome_trace(str(path), [_hand_made_step()] * 2, [7, 8])
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]

    def rows_of(name, step):
        return {(processes[e["pid"]], rows[(e["pid"], e["tid"])])
                for e in spans if e["name"] == name
                and e["args"]["step"] == step}

    assert rows_of("RecvTensor concat", 8) == {
        (WORKER, "pull_params transfers"), (WORKER, "other transfers")}
    assert rows_of("RecvTensor grad", 7) == {(PS, "push_grads transfers")}
    assert rows_of("tokens", 7) == {(PS, "wait_others")}
    assert rows_of("Sum", 8) == {(PS, "aggregate_apply")}
    assert rows_of("concat", 7) == {(PS, "pull_params")}
    assert rows_of("MatMul", 7) == {(WORKER, "compute")}
    assert rows_of("Relu", 7) == {(WORKER, "compute 2")}
    breakdown_rows = [e for e in spans if processes[e["pid"]] == "steps"]
    first = [e for e in breakdown_rows if e["args"]["step"] == 7]
    second = [e for e in breakdown_rows if e["args"]["step"] == 8]
    assert sum(e["dur"] for e in first) == pytest.approx(30_000)
    assert min(e["ts"] for e in second) == pytest.approx(
        30_000 + timeline.STEP_GAP_US)
    assert not list(tmp_path.glob("*.tmp"))


def test_mean_breakdown_averages_and_formats():
    zero = dict.fromkeys(timeline.CATEGORIES, 0.0)
    steps = [{"step_ms": 10.0, "ms": dict(zero, compute=2.0, other=8.0)},
             {"step_ms": 20.0, "ms": dict(zero, compute=4.0, other=16.0)}]
    mean = timeline.mean_breakdown(steps)
    assert mean["step_ms"] == 15.0 and mean["num_steps"] == 2
    assert mean["ms"]["compute"] == 3.0 and mean["ms"]["other"] == 12.0
    assert mean["share"]["compute"] == pytest.approx(0.2)
    text = timeline.format_breakdown(mean)
    assert "step 15.000 ms (mean of 2 steps)" in text
    assert "compute 3.000 ms (20.0%)" in text


def test_overlap_counts_only_pushes_and_pulls_on_the_way_together():
    # The hand-made step pulls [11, 14), then pushes [20, 23): no overlap.
    assert timeline.breakdown(_hand_made_step(), "/job:worker/task:0",
                              is_chief=True)["overlap_ms"] == 0.0
    # A second pull on another link [21, 22.5) and a 0-byte transfer over
    # the push: 1.5 ms with the push. Two pushes at once count once.
    metadata = _hand_made_step()
    more = metadata.step_stats.dev_stats.add(device=WORKER)
    _recv(more, "concat", 400_000, PS, 21, 22.5)
    _recv(more, "concat", 0, PS, 19, 24)
    extra_push = metadata.step_stats.dev_stats.add(device=PS)
    _recv(extra_push, "grad", 4096, WORKER, 21.5, 22)
    result = timeline.breakdown(metadata, "/job:worker/task:0", True)
    assert result["overlap_ms"] == pytest.approx(1.5)
    mean = timeline.mean_breakdown([result, dict(result, overlap_ms=0.5)])
    assert mean["overlap_ms"] == pytest.approx(1.0)
    assert "push/pull overlap 1.000 ms" in timeline.format_breakdown(mean)


def test_aggregation_in_a_non_chief_trace_is_warned_about(caplog):
    timeline.breakdown(_hand_made_step(), "/job:worker/task:0",
                       is_chief=False)
    assert "is it the chief's trace?" in caplog.text


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no device in the trace matches"):
        timeline.breakdown(_hand_made_step(), "/job:worker/task:1", False)
    with pytest.raises(UserError, match="FULL_TRACE"):
        timeline.breakdown(tf.compat.v1.RunMetadata(), "/job:worker", False)
    with pytest.raises(UserError, match="one per step"):
        timeline.write_chrome_trace(str(tmp_path / "t.json"),
                                    [_hand_made_step()], [1, 2])
    with pytest.raises(UserError, match="no traced steps"):
        timeline.mean_breakdown([])


# --- A real trace: a toy step shaped like the trainer's ---

SIZE = 64  # the toy's parameters are a SIZE x SIZE matrix


@pytest.fixture(scope="module")
def session():
    """A session on the worker of an in-process 1 ps + 1 worker cluster.

    TensorFlow cannot stop a gRPC server; the two live until pytest exits,
    on free ports nobody else uses.
    """
    ports = helpers.free_ports(2)
    spec = tf.train.ClusterSpec({"ps": [f"localhost:{ports[0]}"],
                                 "worker": [f"localhost:{ports[1]}"]})
    servers = [tf.distribute.Server(spec, "ps", 0),
               tf.distribute.Server(spec, "worker", 0)]
    sess = tf.compat.v1.Session(servers[1].target, graph=tf.Graph())
    try:
        yield sess
    finally:
        sess.close()


def _toy_step(graph: tf.Graph):
    """Token wait, parameter read, compute, gradient row write, apply."""
    with graph.as_default():
        with tf.device("/job:ps/task:0"):
            params = tf.compat.v1.get_variable(
                "params/shard_0", [SIZE * SIZE], use_resource=True,
                initializer=tf.compat.v1.constant_initializer(0.01))
            grads = tf.compat.v1.get_variable(
                "sync/grads_0", [1, SIZE * SIZE], use_resource=True,
                initializer=tf.compat.v1.zeros_initializer())
            tokens = tf.queue.FIFOQueue(1000, [tf.int64], shapes=[[]],
                                        shared_name="sync/tokens_1",
                                        name="sync_tokens_1")
            with tf.control_dependencies([tokens.dequeue()]):
                values = params.read_value()
        with tf.device("/job:worker/task:0"):
            weights = tf.reshape(values, [SIZE, SIZE])
            hidden = tf.nn.relu(tf.matmul(tf.ones([256, SIZE]), weights))
            loss = tf.reduce_sum(tf.matmul(hidden, weights))
            grad = tf.reshape(tf.gradients(loss, weights)[0], [-1])
        with tf.device("/job:ps/task:0"):
            write = tf.raw_ops.ResourceScatterUpdate(
                resource=grads.handle, indices=[0], updates=grad[None])
            with tf.control_dependencies([write]):
                mean = tf.reduce_sum(grads.sparse_read([0]), axis=0)
            apply = tf.compat.v1.train.GradientDescentOptimizer(
                1e-6).apply_gradients([(mean, params)])
            fill = tokens.enqueue_many(tf.range(1000, dtype=tf.int64))
        init = tf.compat.v1.global_variables_initializer()
    return init, fill, apply


def _traced_steps(sess, count: int) -> list:
    init, fill, apply = _toy_step(sess.graph)
    sess.run(init)
    sess.run(fill)  # tokens queued: the dequeue does not block
    options = tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE, timeout_in_ms=30000)
    metadatas = []
    for _ in range(count):
        metadatas.append(tf.compat.v1.RunMetadata())
        sess.run(apply, options=options, run_metadata=metadatas[-1])
    return metadatas


def _measured_step_ms(metadata) -> float:
    """First start to last end over all devices, straight from the proto."""
    nodes = [n for d in metadata.step_stats.dev_stats for n in d.node_stats]
    start = min(n.all_start_micros for n in nodes)
    end = max(n.all_start_micros + n.all_end_rel_micros for n in nodes)
    return (end - start) / 1000


def test_real_trace_of_a_ps_step(session, tmp_path):
    metadatas = _traced_steps(session, 4)[1:]  # the first one warms up
    path = tmp_path / "trace_worker0.json"
    timeline.write_chrome_trace(str(path), metadatas, [201, 202, 203])
    events = json.loads(path.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X" and e["pid"]]
    jobs = {processes[e["pid"]].split("/")[1] for e in spans}
    assert jobs == {"job:worker", "job:ps"}
    transfers = {e["cat"] for e in spans if e["args"].get("transfer")}
    assert {"pull_params", "push_grads"} <= transfers
    assert {e["args"]["step"] for e in spans} == {201, 202, 203}

    results = [timeline.breakdown(m, "/job:worker/task:0", is_chief=True)
               for m in metadatas]
    for metadata, result in zip(metadatas, results):
        print(timeline.format_breakdown(result))
        assert all(ms >= 0 for ms in result["ms"].values())
        assert sum(result["ms"].values()) == pytest.approx(
            result["step_ms"], rel=1e-9)
        assert result["step_ms"] == pytest.approx(
            _measured_step_ms(metadata), rel=0.1)
        for part in ("compute", "pull_params", "push_grads",
                     "aggregate_apply"):
            assert result["ms"][part] > 0, part
    mean = timeline.mean_breakdown(results)
    print(timeline.format_breakdown(mean))
    assert mean["step_ms"] == pytest.approx(
        sum(r["step_ms"] for r in results) / 3)
    assert mean["ms"]["compute"] == pytest.approx(
        sum(r["ms"]["compute"] for r in results) / 3)
