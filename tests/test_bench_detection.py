"""The detector step of ``pareprop bench``'s default run: a tiny Mask R-CNN trains a step on
the CPU, its peak is split and its plan matches it."""

import json

from pareprop.bench.config import default_config
from pareprop.bench.detection import bench_detector, format_detector_table
from pareprop.cli import bench as bench_cli
from pareprop.memory.detection import SPLIT_PARTS


def test_detector_step_is_measured_and_planned():
    (record,) = bench_detector(engines=("reversible",), plan=True)
    assert record["model"] == "maskrcnn:rev_mvitv2_tiny" and record["engine"] == "reversible"
    assert record["step_s"] > 0 and record["peak_bytes"] > 0
    assert set(record["split"]) == set(SPLIT_PARTS)
    assert sum(record["split"].values()) == record["peak_bytes"]
    assert record["split"]["backbone"] > 0 and record["split"]["heads"] > 0
    assert abs(record["planned_peak_bytes"] - record["peak_bytes"]) <= 0.05 * record["peak_bytes"]
    table = format_detector_table([record])
    assert "maskrcnn:rev_mvitv2_tiny" in table and "backbone MiB" in table


def test_default_bench_runs_the_detector_step(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(bench_cli, "bench_detector",
                        lambda plan=True: calls.append(plan) or [dict(
                            model="m", engine="reversible", batch_size=2, img_size=64,
                            step_s=0.1, peak_bytes=2**20, planned_peak_bytes=None,
                            split=dict.fromkeys(SPLIT_PARTS, 0))])
    config = default_config()
    bench_cli._detector(config, str(tmp_path))
    assert calls == [config.plan]
    assert "detector step" in capsys.readouterr().out
    assert json.loads((tmp_path / "detector.json").read_text())[0]["model"] == "m"
    assert bench_cli.build_parser().parse_args(["--no-detector"]).no_detector
