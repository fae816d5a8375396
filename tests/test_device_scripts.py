"""The device scripts' own logic, without a device: the largest-batch search, the stream
overlap arithmetic and their usage errors. The scripts run end to end (tiny models, CPU) in
CI through ``benchmarks/gpu.sh --dry-run``."""

import argparse
import json
import os
import sys
import time

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
sys.path.insert(0, BENCHMARKS)

import _steps  # noqa: E402
import peak_operator  # noqa: E402
import profile_steps  # noqa: E402
import real_largest_batch  # noqa: E402
import small_batch  # noqa: E402


class FakeCase(real_largest_batch.Case):
    """A case whose step fits at ``limit`` images or fewer, recording the batches tried."""

    def __init__(self, planned, limit, steps=8):
        self.spec = argparse.Namespace(model="m", engine="reversible", chunk_bytes=None,
                                       grad_checkpointing=False)
        self.args = argparse.Namespace(steps=steps, trace_oom=False)
        self.device = argparse.Namespace(type="cpu")
        self.planned, self.limit, self.tried = planned, limit, []

    def step(self, batch):
        self.tried.append(batch)
        fits = batch <= self.limit
        return dict(batch=batch, fits=fits, peak_gib=1.0 if fits else None, chunks={})


def test_search_checks_five_percent_above_a_plan_that_fits():
    case = FakeCase(planned=100, limit=102)
    result = case.search()
    assert case.tried[:2] == [100, 105]  # the plan, then 5% more
    assert result["real"] == 102 and result["bracket"] == [102, 103]
    assert result["real_over_planned"] == pytest.approx(1.02)


def test_search_bisects_below_a_plan_that_does_not_fit():
    case = FakeCase(planned=1000, limit=613, steps=20)
    result = case.search()
    assert case.tried[0] == 1000 and case.tried[1] == 500
    assert result["real"] <= 613 < result["bracket"][1]
    assert result["bracket"][1] - result["real"] <= 10  # within 1% of the plan


def test_search_stops_after_the_plan_and_five_percent_both_fit():
    case = FakeCase(planned=100, limit=10_000)
    result = case.search()
    assert case.tried == [100, 105] and result["real"] == 105 and result["bracket"] == [105, None]


def test_usage_errors_name_what_was_expected(capsys):
    with pytest.raises(SystemExit):
        real_largest_batch.parse_cases(["--cap", "40GiB", "--case", "m", "reversible", "lots"])
    assert "expected a planned batch (an integer) or 'plan'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        real_largest_batch.parse_cases(["--cap", "forty", "--case", "m", "reversible", "3"])
    assert "--cap" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        real_largest_batch.parse_cases(["--cap", "40GiB"])
    assert "expected at least one --case" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        small_batch.parse(["--pair", "a", "b", "--device", "cpu", "--batch-sizes", "0"])
    assert "batch sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_steps.parse(["--device", "cpu"])
    assert "--overlap and/or --kernels" in capsys.readouterr().err


def test_cases_keep_their_own_options():
    args = real_largest_batch.parse_cases([
        "--cap", "1GiB", "--device", "cpu", "--case", "a", "reversible", "7", "--chunk-bytes",
        "1MiB", "--case", "b", "checkpointed", "plan", "--depth", "2"])
    assert args.cap_bytes == 2**30 and args.device == "cpu"
    a, b = args.cases
    assert (a.model, a.planned, a.chunk_bytes, a.depth) == ("a", "7", "1MiB", None)
    assert (b.model, b.planned, b.chunk_bytes, b.depth) == ("b", "plan", None, 2)


def _kernel(stream, ts, dur):
    return dict(cat="kernel", ts=ts, dur=dur, args=dict(stream=stream))


def test_lane_busy_unions_each_stream_and_intersects_the_two_busiest():
    events = [_kernel(7, 0, 100), _kernel(7, 50, 100),  # stream 7 busy 0-150
              _kernel(13, 120, 60), _kernel(13, 300, 10),  # stream 13 busy 120-180, 300-310
              _kernel(20, 400, 1),  # a third, idle stream
              dict(cat="cpu_op", ts=0, dur=5000, tid=1)]  # host work is ignored with kernels
    out = profile_steps.lane_busy(events)
    assert out["lanes"] == "CUDA streams"
    assert out["busy_ms"] == {"stream 7": 0.15, "stream 13": 0.07, "stream 20": 0.001}
    assert out["both_busy_ms"] == pytest.approx(0.03)  # 120-150
    assert out["span_ms"] == pytest.approx(0.401)


def test_lane_busy_without_kernels_reads_host_threads():
    out = profile_steps.lane_busy([dict(cat="cpu_op", ts=0, dur=10, tid=1),
                                   dict(cat="cpu_op", ts=5, dur=10, tid=2)])
    assert out["lanes"].startswith("host threads")
    assert out["both_busy_ms"] == pytest.approx(0.005)


def test_small_batch_graphs_rows_say_why_they_did_not_run():
    args = small_batch.parse(["--pair", "a", "b", "--device", "cpu", "--graphs"])
    assert small_batch.graphs_run(args) == small_batch.NO_CUDA
    assert "not asked" in small_batch.graphs_run(small_batch.parse(
        ["--pair", "a", "b", "--device", "cpu"]))


def test_engine_names_with_graphs():
    assert _steps.base_engine("pareprop+graphs") == "pareprop"
    assert _steps.base_engine("pareprop-fallback") == "pareprop"
    assert _steps.base_engine("checkpointed") == "checkpointed"
    import pareprop

    net = pareprop.create_model("rev_vit_tiny_patch4_32", img_size=8, embed_dim=8, depth=1,
                                num_heads=1, num_classes=2)
    _steps.configure(net, "reversible+graphs")
    assert net.stack.engine == "reversible" and net.stack.cuda_graphs
    _steps.configure(net, "pareprop-fallback")
    assert net.stack.engine == "pareprop" and not net.stack.cuda_graphs
    assert pareprop.chosen_schedule(net) == "pareprop"  # on the CPU: nothing to measure


def test_small_batch_ratios_with_and_without_graphs(capsys):
    ms = {"autograd": 50.0, "reversible": 100.0, "pareprop": 80.0, "pareprop-fallback": 100.0,
          "timm checkpointed": 100.0, "autograd+graphs": 25.0, "reversible+graphs": 40.0,
          "pareprop+graphs": 32.0}
    row = dict(fallback_choice="pareprop", fallback_why=[], graphs=None)
    small_batch._ratios(ms, row)
    assert row["reversible_over_autograd"] == 2.0
    g = row["graphs"]
    assert g["reversible_over_autograd"] == 1.6 and g["reversible_over_eager_autograd"] == 0.8
    assert g["pareprop_throughput_over_reprop"] == 1.25
    assert g["eager_over_graphed"] == {"autograd": 2.0, "reversible": 2.5, "pareprop": 2.5}
    small_batch._print_row("m", 8, ms, row)
    assert "with graphs: reversible/autograd 1.60" in capsys.readouterr().out
    row = dict(fallback_choice="pareprop", fallback_why=[], graphs=small_batch.NO_CUDA)
    small_batch._ratios({k: v for k, v in ms.items() if "+graphs" not in k}, row)
    small_batch._print_row("m", 8, ms, row)
    assert "with graphs: not run (no CUDA" in capsys.readouterr().out


SMALL = ["--device", "cpu", "--img-size", "32", "--depth", "1", "--warmup", "0", "--rounds",
         "1", "--pair", "rev_vit_tiny_patch4_32", "vit_tiny_patch16_224"]


def test_small_batch_graphed_engines_that_fail_leave_the_eager_rows(tmp_path, monkeypatch):
    # Graphs forced on the CPU: each graphed engine fails at its capture (CUDA graphs need a
    # CUDA device), as a capture error would on the device; the eager figures must survive.
    monkeypatch.setattr(small_batch, "graphs_run", lambda args: None)
    out = tmp_path / "small.json"
    assert small_batch.main(SMALL + ["--batch-sizes", "2", "--graphs", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert set(row["ms"]) == {*small_batch.ENGINES, small_batch.CHECKPOINTED}
    assert set(row["errors"]) == set(small_batch.GRAPHED)
    assert all(e.startswith("ValueError: cuda_graphs=True captures") for e in
               row["errors"].values()), row["errors"]
    assert row["reversible_over_autograd"] > 0
    assert row["graphs"]["reversible_over_autograd"] is None  # said, not guessed
    assert row["graphs"]["eager_over_graphed"] == {}


def test_small_batch_an_engine_that_raises_is_dropped_and_the_others_go_on(tmp_path,
                                                                            monkeypatch, capsys):
    engine_of = {}
    configure, step = small_batch.configure, small_batch.training_step

    def remember(net, engine):
        engine_of[id(net)] = engine
        return configure(net, engine)

    def failing_step(net, *args):
        if engine_of.get(id(net)) == "pareprop":
            raise RuntimeError("boom\nthe rest of the message")
        return step(net, *args)

    monkeypatch.setattr(small_batch, "configure", remember)
    monkeypatch.setattr(small_batch, "training_step", failing_step)
    out = tmp_path / "small.json"
    assert small_batch.main(SMALL + ["--batch-sizes", "2", "3", "--json", str(out)]) == 0
    first, second = json.loads(out.read_text())
    assert first["errors"] == {"pareprop": "RuntimeError: boom"}
    assert "pareprop" not in first["ms"] and "pareprop-fallback" in first["ms"]
    assert first["pareprop_throughput_over_reprop"] is None
    assert first["reversible_over_autograd"] > 0
    assert second["batch"] == 3 and second["errors"] == {}
    assert second["not_run"] == {"pareprop": "failed at batch 2"}
    assert set(second["ms"]) == {"autograd", "reversible", "pareprop-fallback",
                                 small_batch.CHECKPOINTED}
    log = capsys.readouterr().out
    assert "pareprop failed: RuntimeError: boom" in log
    assert "pareprop not run: failed at batch 2" in log


class TracingCase(FakeCase):
    """A FakeCase on a "CUDA" device with --trace-oom, recording the batches it traced."""

    def __init__(self, planned, limit):
        super().__init__(planned, limit)
        self.args.trace_oom = True
        self.device = argparse.Namespace(type="cuda")
        self.traced = []

    def trace(self, batch):
        self.traced.append(batch)
        return [f"traced {batch}"]


def test_memory_is_traced_only_when_the_planned_batch_fails():
    case = TracingCase(planned=100, limit=102)  # the +5% probe fails, as expected
    case.search()
    assert case.tried[:2] == [100, 105] and case.traced == []
    case = TracingCase(planned=100, limit=60)  # the plan itself fails: traced once, at the plan
    result = case.search()
    assert case.traced == [100] and len(case.tried) > 2
    assert result["steps"][0]["trace"] == ["traced 100"]


def test_trace_keeps_python_stacks_a_bounded_history_and_snapshots_at_the_oom(monkeypatch):
    calls, events = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: events.append("snapshot") or {
        "segments": [{"blocks": [{"state": "active_allocated", "size": 3 * 2**30, "frames": [
            {"filename": "/x/pareprop/engine/rebuild.py", "line": 7, "name": "_recover"}]}]}]})

    class OomCase(FakeCase):
        def step(self, batch, on_oom=None):
            events.append("step")
            on_oom()  # as Case.step does inside its except block
            events.append("cleaned up")
            return dict(batch=batch, fits=False, peak_gib=None)

    alive = OomCase(planned=10, limit=0).trace(10)
    assert alive == ["3.00 GiB  rebuild.py:7 _recover"]
    assert events == ["step", "snapshot", "cleaned up"]  # the tensors of the failed step alive
    assert calls == [dict(max_entries=real_largest_batch.TRACE_ENTRIES, stacks="python"),
                     dict(enabled=None)]


def _tiny_args(*cases, head=()):
    argv = ["--cap", "1GiB", "--device", "cpu", "--img-size", "32", "--steps", "2", *head]
    for model, planned in cases:
        argv += ["--case", model, "reversible", str(planned), "--depth", "1"]
    return argv


def test_step_reports_out_of_memory_while_the_failed_step_is_alive(monkeypatch):
    args = real_largest_batch.parse_cases(_tiny_args(("rev_vit_tiny_patch4_32", 2)))
    case = real_largest_batch.Case(args.cases[0], args)
    seen = []
    for err in (torch.cuda.OutOfMemoryError("CUDA out of memory."),
                RuntimeError("CUDA error: out of memory"),
                RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")):
        def oom(*a, err=err, **kw):
            raise err

        monkeypatch.setattr(real_largest_batch, "memory_report", oom)
        record = case.step(2, on_oom=lambda: seen.append(True))
        assert record["fits"] is False and record["peak_gib"] is None
    assert seen == [True, True, True]
    monkeypatch.setattr(real_largest_batch, "memory_report",
                        lambda *a, **kw: (_ for _ in ()).throw(ValueError("not memory")))
    with pytest.raises(ValueError, match="not memory"):  # not taken for out of memory
        case.step(2)


def test_each_largest_batch_case_is_written_when_it_ends(tmp_path, monkeypatch):
    # The first case fails to build (recorded with its error), the second runs, the third is
    # killed in its second step: the JSON keeps the first two and the third's first step.
    out = tmp_path / "largest.json"
    step = real_largest_batch.Case.step

    def killed(self, batch, on_oom=None):
        if self.planned == 4 and batch != 4:  # the third case, after its first step
            raise KeyboardInterrupt  # as a kill would: no except clause of the script sees it
        return step(self, batch, on_oom)

    monkeypatch.setattr(real_largest_batch.Case, "step", killed)
    argv = _tiny_args(("no_such_model", 2), ("rev_vit_tiny_patch4_32", 2),
                      ("rev_vit_tiny_patch4_32", 4), head=["--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        real_largest_batch.main(argv)
    failed, done, cut = json.loads(out.read_text())
    assert failed["model"] == "no_such_model" and failed["error"].split(":")[0] in (
        "KeyError", "ValueError", "RuntimeError")
    assert done["finished"] is True and done["real"] == 3 and len(done["steps"]) == 2
    assert cut["finished"] is False and [s["batch"] for s in cut["steps"]] == [4]


def test_profile_parts_fail_alone(tmp_path, monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("CUDA error: an illegal memory access\nmore")

    monkeypatch.setattr(profile_steps, "overlap", broken)
    monkeypatch.setattr(profile_steps, "kernel_table", lambda args: {"rows": 3})
    out = tmp_path / "profile.json"
    assert profile_steps.main(["--device", "cpu", "--overlap", "m", "2", "--kernels", "a", "b",
                               "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "overlap": {"error": "RuntimeError: CUDA error: an illegal memory access"},
        "kernels": {"rows": 3}}
    assert "overlap failed: RuntimeError: CUDA error" in capsys.readouterr().out


def test_small_batch_builds_nothing_for_a_pair_past_its_time_limit(monkeypatch, capsys):
    monkeypatch.setattr(small_batch, "_build", lambda *a: pytest.fail("built past the limit"))
    args = small_batch.parse(SMALL + ["--time-limit", "0"])
    rows = []
    small_batch.measure_pair("rev", "std", args, time.monotonic() - 1.0, rows)
    assert rows == [] and "rev: skipped (time limit)" in capsys.readouterr().out


def test_peak_operator_runs_on_a_chunked_plan(monkeypatch, capsys):
    # Chunk costs are measured while planning a chunked step, and the counter sets the storages
    # made then aside: its subclass looked them up among the counted ones (a KeyError).
    import pareprop.memory.measure as measure

    monkeypatch.setattr(measure, "_step_tracker", measure._step_tracker)  # the script sets it
    rc = peak_operator.main(["rev_vit_tiny_patch4_32", "reversible", "2", "--depth", "2",
                             "--img-size", "32", "--device", "cpu", "--chunk-bytes", "64KiB",
                             "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0 and "in chunks of" in out and "operator at the peak" in out
    assert "largest tensors alive then" in out
