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

With `--ps_placement=colocated`, ps task k shares worker k's host and
link, and no ps has a host of its own. Host k's link then carries, each
way and per step, its shard to (or its gradient from) the N - 1 other
workers plus its own worker's reads (or writes) of the other shards:
(N - 1) x S_k + (P - S_k) values. A host without a ps task carries P each
way. So no step can take less than

    bound = max over hosts of that count x W x 8 / R  seconds,

which with K = N equal shards is 2 (N - 1) / N x P x W x 8 / R: exactly
what a ring all-reduce moves over each worker's link (`ring_bound_ms`,
with float32), in two phases (pull, push) where the ring needs 2 (N - 1).

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


def _colocated_values(sizes: list[int], workers: int) -> int:
    """Values the busiest colocated host's link carries each way."""
    total = sum(sizes)
    counts = [(workers - 1) * s + (total - s) for s in sizes]
    if len(sizes) < workers:  # a host with a worker and no ps task
        counts.append(total)
    return max(counts)


def busiest_ps_link_bytes(config, num_ps: int, workers: int,
                          placement: str = "separate") -> int:
    """Bytes the busiest ps link carries each way per step: N x S x W
    (separate), or the colocated count of the docstring x W."""
    sizes = _shard_sizes(config, num_ps)
    values = (workers * max(sizes) if placement == "separate"
              else _colocated_values(sizes, workers))
    return values * wire_bytes_per_float(config)


def ps_link_bound_ms(config, num_ps: int, workers: int, rate_bps: int,
                     placement: str = "separate") -> float:
    """The least step time the links allow, in ms (module docstring):
    (N x S + P) x W x 8 / R with ps tasks on hosts of their own."""
    sizes = _shard_sizes(config, num_ps)
    if placement == "separate":
        values = workers * max(sizes) + sum(sizes)
    else:
        values = _colocated_values(sizes, workers)
    return _link_ms(config, values, rate_bps)


def _link_ms(config, values: int, rate_bps: int) -> float:
    """ms for `values` parameters or gradients on a link of rate_bps."""
    return 1000.0 * values * wire_bytes_per_float(config) * 8 / rate_bps


def ring_bound_ms(config, workers: int, rate_bps: int) -> float:
    """2 (N - 1) / N x P x 4 x 8 / R in ms: what a ring all-reduce of the
    float32 gradient moves over each worker's link, each way."""
    total = sum(_shard_sizes(config, 1))
    return 1000.0 * 2 * (workers - 1) / workers * total * 4 * 8 / rate_bps
