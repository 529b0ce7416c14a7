"""The 16-bit wire against a NumPy reference: the rows are the workers'
gradients rounded to the wire dtype, the step and statistics cross
bit-exact, and the bytes crossing between ps and worker are those of the
wire dtype."""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.sync_protocol import (  # noqa: F401 (cluster: a fixture)
    SHARDS, LEARNING_RATE, Protocol, random_push, round_tokens, cluster)
from trainer.common.errors import UserError
from trainer.sync import transport as transport_lib


# --- The wire dtype: 16-bit parameters and gradients between ps and worker.

# An int64 whose four 16-bit chunks read as NaN or inf in bfloat16 and
# float16 (and a float32 whose low half does): bits must cross untouched.
NAN_CHUNKS_STEP = 0x7FC1_FF81_7F80_FFFF
NAN_LOW_HALF = np.array([0x4040_FFC1], np.uint32).view(np.float32)[0]


def round_like_wire(values, dtype):
    """float32 -> wire -> float32 in NumPy: round to nearest even."""
    values = np.asarray(values, np.float32)
    if dtype == tf.float16:
        return values.astype(np.float16).astype(np.float32)
    bits = values.view(np.uint32).astype(np.uint64)  # bfloat16; finite only
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).astype(np.uint32).view(np.float32)


def test_round_like_wire_rounds_ties_to_even():
    ties = np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-9)])
    np.testing.assert_array_equal(round_like_wire(ties, tf.bfloat16),
                                  [1.0, 1 + 2**-6, -(1 + 2**-7)])


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_16_bit_wire_rounds_values_and_keeps_token_and_stats_exact(
        cluster, dtype):
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=2, wire_dtype=dtype, batch=63)
    params = [rng.normal(size=n).astype(np.float32) for n in SHARDS]
    protocol.set_values(params)
    odd_token = np.array([NAN_CHUNKS_STEP, 7, 3, NAN_CHUNKS_STEP], np.int64)
    token, values = protocol.read_on_worker(odd_token)
    np.testing.assert_array_equal(token, odd_token)
    for value, exact in zip(values, params):
        assert not np.array_equal(round_like_wire(exact, dtype), exact)
        np.testing.assert_array_equal(value, round_like_wire(exact, dtype))
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    pushes = [random_push(rng, n) for n in (32, 31)]
    pushes[1][1][1] = NAN_LOW_HALF
    for k, (grads, stats) in enumerate(pushes):
        protocol.push(k, tokens[k], grads, stats)
    assert protocol.admit(tokens[0])[0]
    next_step, step_stats = protocol.apply(0)
    assert next_step == 1
    rows = protocol.read(protocol.shared.stats)
    np.testing.assert_array_equal(rows.view(np.uint32),
                                  np.stack([p[1] for p in pushes]).view(
                                      np.uint32))
    assert step_stats[0] == 63
    for shard, value in enumerate(protocol.values()):
        received = [round_like_wire(p[0][shard], dtype) for p in pushes]
        # The ps holds exactly the rounded gradient, in float32...
        np.testing.assert_array_equal(
            protocol.read(protocol.shared.grads[shard]), received)
        # ...and applies their float32 mean to its float32 parameters.
        expected = params[shard] - LEARNING_RATE * sum(received) / 63
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)


# A fed tensor enters the graph on the client's task (worker 0) and travels
# to its placeholder's device from there: the step fed for read_params
# (on ps 0) is such a transfer of the test, not of the protocol.
_FEED = re.compile(r"_recv_read_token")


def _bytes_between_tasks(run_metadata) -> dict:
    """{(from task, to task): [bytes of each nonempty tensor received]},
    feeds left out."""
    moved = {}
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            if _FEED.search(node.timeline_label):
                continue
            match = re.match(r"\[(\d+)B\] .* from /job:(\w+)/replica:0/"
                             r"task:(\d)\S* to /job:(\w+)/replica:0/"
                             r"task:(\d)", node.timeline_label)
            if match and int(match[1]) > 0:
                key = (f"{match[2]}{match[3]}", f"{match[4]}{match[5]}")
                moved.setdefault(key, []).append(int(match[1]))
    return moved


def _cross_task_send_dtypes(run_metadata) -> set:
    """dtypes of the tensors the partitioned graphs send between tasks,
    except control messages (empty float32) and the test's step feed."""
    sent = set()
    for graph in run_metadata.partition_graphs:
        for node in graph.node:
            source, attrs = node.input[0] if node.input else "", node.attr
            if node.op == "_Send" and "/ctrl_" not in source and (
                    not _FEED.search(source)) and (
                    attrs["send_device"].s.split(b"/device")[0] !=
                    attrs["recv_device"].s.split(b"/device")[0]):
                sent.add(tf.as_dtype(attrs["T"].type))
    return sent


@pytest.mark.parametrize("dtype,width", [(tf.float32, 4), (tf.bfloat16, 2),
                                         (tf.float16, 2)])
def test_bytes_crossing_between_ps_and_worker(cluster, dtype, width):
    protocol = Protocol(cluster, num_workers=1, wire_dtype=dtype)
    token = np.array([7, 1, 0, 64], np.int64)
    feed = protocol.push_feed(token, [np.ones(n, np.float32)
                                      for n in SHARDS],
                              np.ones(3, np.float32))
    feed[protocol.read_token_in] = token
    # Parameters out (shard 0 with the 32-byte token), gradients back
    # (shard 0 with the token and three float32 stats): nothing else but
    # 0-byte control messages crosses.
    expected = {
        ("ps0", "worker0"): [5 * width + 32], ("ps1", "worker0"): [3 * width],
        ("worker0", "ps0"): [5 * width + 32 + 12],
        ("worker0", "ps1"): [3 * width]}
    # The trace's record of a transfer can come too late for its step's
    # statistics (seen about one run in ten on a loaded machine), so a run
    # missing a transfer is retried; one with wrong sizes fails every time.
    for _ in range(5):
        metadata = tf.compat.v1.RunMetadata()
        protocol.session.run(
            [protocol.read_params, protocol.pushes[0]], feed,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                output_partition_graphs=True),
            run_metadata=metadata)
        moved = _bytes_between_tasks(metadata)
        if moved == expected:
            break
    assert moved == expected
    # The same from the partitioned graphs: only the wire dtype crosses.
    assert _cross_task_send_dtypes(metadata) == {dtype}


@pytest.mark.parametrize("bad", [tf.int8, "float64", "bf16"])
def test_other_wire_dtypes_are_refused(bad):
    with tf.Graph().as_default(), pytest.raises(UserError, match="bfloat16"):
        transport_lib.Transport(None, bad)
