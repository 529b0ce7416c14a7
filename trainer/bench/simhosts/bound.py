"""The ps-link bound: the least step time a ps task's link allows.

In every step each of the N workers reads every parameter shard from its
ps task and writes its gradient for that shard back. So the link of the ps
task that holds the largest shard, S floats of W bytes each on the wire
(4 for float32, 2 for bfloat16 or float16, `--wire_dtype`), carries
N x S x W bytes out (parameters) and as many in (gradients) per step.
Every link moves R bits/s each way, both ways at once (the simulated hosts
shape each direction with tbf on both ends of the veth).

However the ps orders its sends, the last worker has all its parameters
no earlier than N x S x W x 8 / R after the step starts. Only then can it
compute its gradient, P x W bytes for all P parameters (P = S with one ps
task), which leaves through that worker's own link: P x W x 8 / R more.
So no step can take less than

    bound = (N x S + P) x W x 8 / R  seconds,

which is (N + 1) x S x W x 8 / R with one ps task. (tbf lets a link that
was idle send a burst of 10 ms of data at line speed, so a step can come
in a little under it.)

Why it matters: measured steps also pay the compute, the latency of a few
round trips and gRPC's framing, so measured / bound says how close to the
link's limit a configuration runs. Reaching the bound takes one pull at a
time (`--ordered_pulls`, trainer/sync/pull_turns.py): when TCP shares the
ps link among all N pulls, they all end near N transfer times, and then
the N gradients share the way in, up to 2N transfer times in all instead
of N + 1.
"""

from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib


def wire_bytes_per_float(config) -> int:
    """W: bytes of one parameter or gradient value on a ps link."""
    return 2 if getattr(config, "wire_dtype", "float32") in (
        "bfloat16", "float16") else 4


def _shard_sizes(config, num_ps: int) -> list[int]:
    """Floats per ps shard, as the trainer cuts the model's parameters."""
    return params_lib.FlatLayout(params_lib.plan_shards(
        replica_lib.model_specs(config), num_ps)).sizes


def busiest_ps_link_bytes(config, num_ps: int, workers: int) -> int:
    """N x S x W: bytes the busiest ps link carries each way per step."""
    return (workers * max(_shard_sizes(config, num_ps))
            * wire_bytes_per_float(config))


def ps_link_bound_ms(config, num_ps: int, workers: int,
                     rate_bps: int) -> float:
    """(N x S + P) x W x 8 / R, in ms: the least step time the links allow
    (see the module's docstring)."""
    sizes = _shard_sizes(config, num_ps)
    in_turn = (workers * max(sizes) + sum(sizes)) * wire_bytes_per_float(
        config)
    return 1000.0 * in_turn * 8 / rate_bps
