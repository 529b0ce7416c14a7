"""The benchmark's rows: one per configuration, from its median run, with
the columns that compare runs (E(N), S(N), x mwms, the link bounds)."""

from trainer.bench import dashboard
from trainer.bench import runs as runs_lib
from trainer.bench.simhosts import bound as bound_lib


def median_run(group: list[runs_lib.Run]) -> runs_lib.Run | None:
    """The run with the median images/s (the lower middle of an even
    count) of those that did not fail, so that every column of a row
    comes from one run; None if all failed."""
    ordered = sorted((r for r in group if r.error is None),
                     key=lambda r: r.results["images_per_sec"])
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def spread_columns(group: list[runs_lib.Run]) -> dict:
    """Over the runs of one configuration that did not fail (every seed
    and repeat): how many, their seeds, and the mean, min and max of the
    test accuracy and images/s, as columns <figure>_mean|_min|_max."""
    done = [r for r in group if r.error is None]
    columns = {"runs": len(done), "seeds": ";".join(
        str(s) for s in sorted({r.results["flags"]["seed"] for r in done}))}
    for column, key in (("test_accuracy", "final_test_accuracy"),
                        ("images_per_sec", "images_per_sec")):
        values = [r.results[key] for r in done]
        columns.update({f"{column}_mean": sum(values) / len(values),
                        f"{column}_min": min(values),
                        f"{column}_max": max(values)})
    return columns


def make_rows(s: runs_lib.Settings, grouped: list, target: float
              ) -> tuple[list, float]:
    """One row per configuration; returns rows and the E reference (the
    best single process, else the first run)."""
    medians = [median_run(g) for g in grouped]
    singles = [r for r in medians if r and r.kind == "single"]
    reference = (max(r.results["images_per_sec"] for r in singles)
                 if singles else medians[0].results["images_per_sec"])
    rows = []
    for run, group in zip(medians, grouped):
        if run is None:  # every repeat failed: the row says why
            rows.append({"run": group[0].name, "kind": group[0].kind,
                         "workers": group[0].workers,
                         "error": group[-1].error})
            continue
        row = run.row(target, reference)
        if len(group) > 1:
            row["images_per_sec_repeats"] = ";".join(
                f"{r.results['images_per_sec']:.0f}" for r in group)
            row.update(spread_columns(group))
        rows.append(row)
    _add_x_mwms(medians, rows)
    if s.sim or s.steps:  # one host (or node) per task: S(N) means scaling
        _add_speedup(medians, rows)
    if s.sim:
        _add_host_columns(s, medians, rows)
    return rows, reference


def _add_x_mwms(medians: list, rows: list) -> None:
    """x_mwms: images/s over the MultiWorkerMirroredStrategy run with the
    same worker count in this benchmark (none without one)."""
    mwms = {r.workers: r.results["images_per_sec"] for r in medians
            if r and r.kind == "mwms"}
    for run, row in zip(medians, rows):
        if run and run.workers in mwms and run.kind != "single":
            row["x_mwms"] = run.results["images_per_sec"] / mwms[run.workers]


def _add_speedup(medians: list, rows: list) -> None:
    """Speedup S(N) over the 1-worker ps run of the same benchmark (none
    without one) and the scaling efficiency S(N)/N, for the ps runs."""
    one = next((r for r in medians
                if r and r.kind == "ps" and r.workers == 1), None)
    for run, row in zip(medians, rows):
        if one and run and run.kind == "ps":
            speedup = (run.results["images_per_sec"]
                       / one.results["images_per_sec"])
            row.update(speedup=speedup,
                       scaling_efficiency=speedup / run.workers)


def _add_host_columns(s: runs_lib.Settings, medians: list,
                      rows: list) -> None:
    """The hosts' limits and the link bounds (bound.py)."""
    for run, row in zip(medians, rows):
        if run is None:
            continue
        row.update(host_cpu=(",".join(f"{c:g}" for c in
                                      s.sim.worker_cpus[:run.workers])
                             if s.sim.worker_cpus else s.sim.host_cpu),
                   ps_cpu=s.sim.ps_cpu, link_rate=s.sim.link_rate,
                   cpu_period_ms=s.sim.cpu_period_ms)
        if run.kind == "mwms":
            row["ring_bound_ms"] = bound_lib.ring_bound_ms(
                s.config, run.workers, s.sim.link_rate_bps)
        if run.kind != "ps":
            continue
        row["ps_placement"] = s.sim.ps_placement
        bound = bound_lib.ps_link_bound_ms(
            s.config, s.num_ps, run.workers, s.sim.link_rate_bps,
            s.sim.ps_placement)
        step_ms = run.results["mean_step_time_ms"]
        row.update(
            ps_link_bytes_per_step=bound_lib.busiest_ps_link_bytes(
                s.config, s.num_ps, run.workers, s.sim.ps_placement),
            ps_link_bound_ms=bound,
            # No link traffic at all (one worker beside its ps): no bound.
            step_over_bound=step_ms / bound if bound else None,
            # The share of the step the links explain: the bound over the
            # measured step.
            link_share=bound / step_ms if bound and step_ms else None)


def dashboard_spec(s: runs_lib.Settings, plan: list, grouped: list,
                   rows: list) -> dict:
    """TensorBoard HParams, one session per configuration (its median;
    none where every repeat failed), as JSON for results.json and replots:
    {"domains": {hparam: [values]}, "sessions": [{"name", "hparams",
    "metrics"}]}."""
    pairs = [(median_run(g), row) for g, row in zip(grouped, rows)]
    pairs = [(run, row) for run, row in pairs if run is not None]
    medians = [run for run, _ in pairs]
    domains = {"kind": sorted({k for k, _ in plan}),
               "workers": sorted({r.workers for r in medians}),
               "ps_tasks": sorted({r.ps_tasks for r in medians}),
               "model": [s.config.model], "batch": [s.config.batch_size]}
    if s.sim:
        domains.update(host_cpu=[s.sim.host_cpu], link_rate=[s.sim.link_rate])
    sessions = []
    for run, row in pairs:
        hparams = {"kind": run.kind, "workers": run.workers,
                   "ps_tasks": run.ps_tasks, "model": s.config.model,
                   "batch": s.config.batch_size}
        if s.sim:
            hparams.update(host_cpu=s.sim.host_cpu,
                           link_rate=s.sim.link_rate)
        sessions.append({"name": run.name, "hparams": hparams, "metrics": {
            "final_test_accuracy": row["test_accuracy"],
            "images_per_sec": row["images_per_sec"],
            # The dashboard's label for it follows host_cpu (dashboard.py).
            "efficiency": (row.get("scaling_efficiency", row["efficiency"])
                           if s.sim else row["efficiency"]),
            "time_to_target_secs": row["time_to_target_secs"]}})
    return {"domains": domains, "sessions": sessions}


def write_dashboard(out, spec: dict) -> None:
    """Writes dashboard_spec's experiment and sessions into out."""
    dashboard.write_experiment(out, spec["domains"])
    for session in spec["sessions"]:
        dashboard.write_run(out, session["name"], session["hparams"],
                            session["metrics"])


def deterministic_note(rows: list[dict]) -> str:
    """The line under the table (fixed-point sums, the default): whether
    the ps rows' test accuracies are equal to the last digit, as
    fixed-point sums promise, or which differ. (The single process sums
    in fixed point too, but applies its update in another graph, so it is
    not promised the ps trainer's bits.)"""
    same_sum = [r for r in rows if r["kind"] == "ps"
                and "test_accuracy" in r]
    values = {r["test_accuracy"] for r in same_sum}
    names = ", ".join(r["run"] for r in same_sum)
    if len(values) == 1:
        return (f"the ps rows' test accuracies are equal to the last "
                f"digit: {values.pop():.4%} in every one ({names}), as "
                "fixed-point sums promise")
    listed = ", ".join(f"{r['run']} {r['test_accuracy']:.4%}"
                       for r in same_sum)
    return (f"fixed-point sums, yet the test accuracies differ: {listed}; "
            "see docs/how-it-works.md#bit-identical-training")
