"""The push/pull overlap of a traced step: how long gradients going up
and parameters coming down were on the way at the same time. The step
breakdown (trainer/observe/timeline.py) gives each instant to one part,
so it cannot show this. Within one worker whole shards pull, then push;
across workers (one pushing while another still pulls, as with
--ordered_pulls) the two can overlap.
"""


def _union(spans: list[tuple[int, int]]) -> list[list[int]]:
    """Sorted, disjoint [start, end) covering the given spans."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap_ns(events: list) -> int:
    """How long (ns) a push_grads transfer and a pull_params transfer were
    both on the way, on any links. `events`: timeline's classified
    events (start_ns, end_ns, is_transfer, size, category). Whole shards
    pull, then push, so theirs is near 0. Times are each task's clock."""
    def spans(category):
        return _union([(e.start_ns, e.end_ns) for e in events
                       if e.is_transfer and e.size != 0
                       and e.category == category and e.end_ns > e.start_ns])
    push, pull, total = spans("push_grads"), spans("pull_params"), 0
    for a_start, a_end in push:
        for b_start, b_end in pull:
            total += max(0, min(a_end, b_end) - max(a_start, b_start))
    return total
