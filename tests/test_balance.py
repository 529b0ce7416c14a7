"""Balanced slices on simulated hosts: a slow host gets less of the global
batch, and every step still averages all of it.

One ps and two workers (one per host, started by the scripts, as in
tests/test_multihost.py). Worker 1's host is cut to a fifth of its budget:

- from the start (a heterogeneous cluster), or
- once the run is past step 100 (a straggler).

Checked for any timing: every task exits 0, the examples averaged add up
to the global batch of every step (results.json's `averaged_examples`),
the slow worker's share is the smaller one, and the two runs, whose
slices differ step by step, end with the same parameters to float
rounding. How fast they run is the benchmark's business (docs/peers.md).
"""

import pytest

from tests.test_cluster_runs import differing, final_parameters
from tests.test_multihost import (  # noqa: F401 (fixtures)
    CPUS, HostCluster, assert_finished, cluster, data_dir, sim)

pytestmark = pytest.mark.hosts

STEPS = 800
BATCH = 64     # as tests/test_multihost.py's FLAGS
SLOW_CPU = 0.1
CUT_STEP = 100
LATEST_CUT = STEPS // 2   # a later cut leaves too few steps to tell


def run(make, name: str, cut_at_step: int | None) -> tuple[dict, int, dict]:
    """A balanced run with worker 1's host slowed at `cut_at_step` (None:
    as soon as worker 1 asks to join, before the first step). Returns the
    results, the step the cut came at (0: before training) and the final
    parameters."""
    c: HostCluster = make(CPUS, f"--train_steps={STEPS}",
                          f"--eval_every={STEPS}",
                          f"--checkpoint_every={STEPS}", "--slices=balanced",
                          name=name)
    c.start_all()
    if cut_at_step is None:
        # --min_workers=2: the chief waits for worker 1 before step 0.
        c.wait_for_line("worker1", "asked the chief to take it in")
        cut = 0
    else:
        cut = c.wait_for_step(cut_at_step)
    c.hosts["worker1"].set_cpu(SLOW_CPU)
    try:
        results = assert_finished(c, STEPS)
    finally:
        c.hosts["worker1"].set_cpu(CPUS[2])   # the hosts serve other tests
    return results, cut, final_parameters(c.logdir)


def test_a_slow_host_gets_less_of_the_batch_and_training_stays_exact(
        cluster):
    runs = {"heterogeneous": run(cluster, "heterogeneous", None),
            "straggler": run(cluster, "straggler", CUT_STEP)}
    for label, (results, cut, _) in runs.items():
        examples = {int(k): v
                    for k, v in results["averaged_examples"].items()}
        print(f"{label}: cut at step {cut}; examples averaged per worker "
              f"{examples}; membership {results['membership']}")
        # Every applied step averaged the whole global batch.
        assert sum(examples.values()) == STEPS * BATCH, results
        if cut > LATEST_CUT:
            continue   # the machine was too slow to tell; nothing to say
        assert examples[1] < examples[0], results
    assert not differing(runs["heterogeneous"][2], runs["straggler"][2])
