"""The step-time model: it recovers known coefficients, reads benchmark
folders, and refuses what it cannot use with one line."""

import dataclasses
import json

import numpy as np

from trainer.bench import stepmodel
from trainer.common.config import TrainConfig

TRUE = np.array([0.09, 0.01, 1.3, 0.4, 2.5])  # a_cnn, a_mlp, b, c, d


def _points() -> list[stepmodel.Point]:
    cnn = TrainConfig(logdir="unused", model="cnn")
    mlp = dataclasses.replace(cnn, model="mlp")
    points = []
    for workers, num_ps, cpu, rate, config in [
            (1, 1, 0.2, 10**9, cnn), (2, 1, 0.2, 10**9, cnn),
            (4, 1, 0.2, 10**9, cnn), (8, 1, 0.2, 10**9, cnn),
            (16, 1, 0.1, 10**9, cnn), (4, 2, 0.3, 10**8, cnn),
            (1, 1, 0.3, 10**8, mlp), (2, 1, 0.3, 10**8, mlp),
            (4, 1, 0.3, 10**8, mlp)]:
        p = stepmodel.Point(f"{config.model}{workers}w{num_ps}ps", config,
                            workers, num_ps, cpu, 0.2, rate, "separate")
        points.append(dataclasses.replace(
            p, step_ms=float(p.features(("cnn", "mlp")) @ TRUE)))
    return points


def test_the_fit_recovers_the_coefficients_of_exact_steps():
    model = stepmodel.fit(_points())
    assert model.models == ("cnn", "mlp")
    np.testing.assert_allclose(model.coef, TRUE, rtol=1e-6)
    lines = stepmodel.report(_points(), model)
    assert lines[0] == model.formula()
    # Every point is matched, and each predicted size has two rows.
    assert sum("+0.0%" in line or "-0.0%" in line for line in lines) == 9
    assert sum(line.startswith("| 128 |") for line in lines) == 2


def _write_benchmark(folder, points, straggler=False):
    rows = []
    for p in points:
        run = folder / p.label
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({
            "flags": dataclasses.asdict(p.config), "num_ps": p.num_ps}))
        rows.append({"run": p.label, "kind": "ps", "workers": p.workers,
                     "host_cpu": p.host_cpu, "ps_cpu": p.ps_cpu,
                     "link_rate": {10**9: "1gbit", 10**8: "100mbit"}[p.rate_bps], "ps_placement":
                     p.placement, "mean_step_time_ms": p.step_ms})
    rows.append({"run": "single", "kind": "single", "workers": 1})
    (folder / "results.json").write_text(json.dumps({
        "rows": rows, "provenance": {"simulated_hosts": {
            "straggler": straggler}}}))


def test_it_reads_benchmark_folders_and_skips_stragglers(tmp_path, capsys):
    _write_benchmark(tmp_path / "even", _points())
    _write_benchmark(tmp_path / "slow", _points()[:2], straggler=True)
    # A run of the retired pipelined protocol ran another protocol's step.
    chunked = _points()[5]
    _write_benchmark(tmp_path / "chunked", [dataclasses.replace(
        chunked, config=dataclasses.replace(chunked.config, chunk_kb=32))])
    points = stepmodel.load_points([str(tmp_path / "even"),
                                    str(tmp_path / "slow"),
                                    str(tmp_path / "chunked")])
    assert [p.workers for p in points] == [1, 2, 4, 8, 16, 4, 1, 2, 4]
    assert stepmodel.main([str(tmp_path / "even")]) == 0
    assert "step ms = " in capsys.readouterr().out


def test_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert stepmodel.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no results.json" in err[0]
    _write_benchmark(tmp_path / "few", _points()[:3])
    assert stepmodel.main([str(tmp_path / "few")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs at least 4" in err[0]
