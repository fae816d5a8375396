"""benchmarks/gpu.sh and benchmarks/gpu_sweep.py: order of the steps, time shares, hard stops.

gpu.sh runs here with a fake ``python`` first on PATH, which records how it was called and
returns at once (or hangs, for the hard-stop test), so the script's control flow is checked in
seconds, GPU mode included. The real steps run in CI through ``gpu.sh --dry-run``.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from pareprop.bench import stop as bench_stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.sh")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


sweep = _load("gpu_sweep")

# ---------------------------------------------------------------------------------------------
# gpu_sweep.py


def test_engine_share_splits_what_is_left_and_is_never_negative():
    assert sweep.engine_share(100.0, 4) == 25.0
    assert sweep.engine_share(-3.0, 2) == 0.0
    with pytest.raises(ValueError, match="at least one engine"):
        sweep.engine_share(10.0, 0)


def test_overrun_reserve_is_a_share_of_the_budget_with_a_cap():
    assert sweep.overrun_reserve(50.0) == pytest.approx(5.0)
    assert sweep.overrun_reserve(500.0) == sweep.OVERRUN_MAX_S


def test_soft_budget_is_a_fraction_and_never_zero():
    # pareprop bench reads --time-budget 0 as "no budget": the soft budget stays >= 1 s.
    assert sweep.soft_budget(50.0) == pytest.approx(sweep.SOFT_FRACTION * 50.0)
    assert sweep.soft_budget(0.0) == 1.0


def test_bench_argv_uses_existing_bench_flags():
    from pareprop.cli.bench import build_parser

    argv = sweep.bench_argv("rev_vit_tiny_patch4_32", "pareprop", 12.5, "/tmp/x",
                            ["--device", "cpu", "--batch-sizes", "2", "4"])
    args = build_parser().parse_args(argv[1:])  # raises SystemExit for an unknown flag
    assert argv[0] == "bench"
    assert (args.models, args.engines, args.time_budget, args.out) == (
        ["rev_vit_tiny_patch4_32"], ["pareprop"], 12.5, "/tmp/x")


def test_chunked_engines_run_their_base_engine_with_the_chunk_size():
    from pareprop.cli.bench import build_parser

    argv = sweep.bench_argv("rev_vit_tiny_patch4_32", "pareprop_chunked", 5.0, "/tmp/x",
                            ["--device", "cpu"], chunk_bytes="1GiB")
    args = build_parser().parse_args(argv[1:])
    assert (args.engines, args.chunk_bytes) == (["pareprop"], "1GiB")
    # whole-branch engines ignore the size
    assert "--chunk-bytes" not in sweep.bench_argv("m", "pareprop", 5.0, "/tmp/x", [], "1GiB")
    with pytest.raises(ValueError, match="needs a chunk size"):
        sweep.bench_argv("m", "reversible_chunked", 5.0, "/tmp/x", [])


def test_chunked_engines_follow_the_whole_ones_only_with_a_chunk_size(tmp_path, monkeypatch,
                                                                      capsys):
    calls = []
    monkeypatch.setattr("pareprop.cli.main", lambda argv: calls.append(argv) or 0)
    monkeypatch.setattr(sweep, "STARTED", time.monotonic())
    monkeypatch.setattr(sweep, "MIN_SHARE_S", 0.0)
    rc = sweep.main(["--out", str(tmp_path / "vit"), "--budget", "60", "--label", "L",
                     "--model", "rev", "--baseline", "std", "--chunk-bytes", "1GiB",
                     "--", "--device", "cpu"])
    assert rc == 0
    ran = [(a[a.index("--engines") + 1], a[a.index("--out") + 1].rsplit("/", 1)[1],
            "--chunk-bytes" in a) for a in calls]
    assert ran[-2:] == [("reversible", "reversible_chunked", True),
                        ("pareprop", "pareprop_chunked", True)]
    assert not any(chunked for _, _, chunked in ran[:-2])
    meta = json.loads((tmp_path / "vit" / "sweep.json").read_text())
    assert meta["engines"] == list(sweep.ENGINE_ORDER) and meta["chunk_bytes"] == "1GiB"
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(tmp_path / "x"), "--budget", "9", "--label", "L", "--model",
                    "m", "--baseline", "b", "--engines", "pareprop_chunked"])
    assert "need --chunk-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(tmp_path / "x"), "--budget", "9", "--label", "L", "--model",
                    "m", "--baseline", "b", "--chunk-bytes", "lots"])
    assert "--chunk-bytes: " in capsys.readouterr().err


def test_flags_the_driver_sets_itself_are_refused(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--out", "x", "--budget", "9", "--label", "L", "--model", "m",
                    "--baseline", "b", "--", "--engines", "plain"])
    assert "--engines is set by gpu_sweep.py" in capsys.readouterr().err


def test_driver_gives_each_engine_its_share_and_cuts_off_an_overrun(tmp_path, monkeypatch):
    calls = []

    def fake_bench(argv):
        engine = argv[argv.index("--engines") + 1]
        calls.append((time.monotonic(), argv))
        if engine == "autograd":  # overruns its share: SIGALRM must end it
            try:  # as run_bench does: stop at the next safe point, keep the records
                for _ in range(50):
                    bench_stop.check()
                    time.sleep(0.1)
            except KeyboardInterrupt:
                return 0
        if engine == "reversible":
            raise RuntimeError("broken")
        return 0

    monkeypatch.setattr("pareprop.cli.main", fake_bench)
    monkeypatch.setattr(sweep, "STARTED", time.monotonic())
    monkeypatch.setattr(sweep, "MIN_SHARE_S", 0.05)
    monkeypatch.setattr(sweep, "WRITE_MARGIN_S", 0.0)
    monkeypatch.setattr(sweep, "OVERRUN_MAX_S", 0.0)
    out = tmp_path / "vit"
    t0 = time.monotonic()
    rc = sweep.main(["--out", str(out), "--budget", "2", "--label", "Rev-ViT-B",
                     "--model", "rev", "--baseline", "std",
                     "--engines", "pareprop", "autograd", "reversible", "plain", "checkpointed",
                     "--", "--device", "cpu"])
    took = time.monotonic() - t0
    assert rc == 1  # reversible raised
    engines = [argv[argv.index("--engines") + 1] for _, argv in calls]
    assert engines == ["plain", "checkpointed", "autograd", "reversible", "pareprop"]
    models = [argv[argv.index("--models") + 1] for _, argv in calls]
    assert models == ["std", "std", "rev", "rev", "rev"]
    assert all(argv[-2:] == ["--device", "cpu"] for _, argv in calls)
    # autograd's share: what plain and checkpointed left (almost all of 2 s) over three
    autograd_at, pareprop_at = calls[2][0], calls[4][0]
    assert 0.4 < pareprop_at - autograd_at < 1.2, "autograd was not cut off at its share"
    assert took < 2.5
    meta = json.loads((out / "sweep.json").read_text())
    whole = [e for e in sweep.ENGINE_ORDER if e not in sweep.CHUNKED_ENGINES]
    assert meta["engines"] == whole and meta["label"] == "Rev-ViT-B"
    assert meta["chunk_bytes"] is None
    # the handlers it installed are gone again
    import signal

    assert signal.getsignal(signal.SIGALRM) is not sweep._on_alarm


# ---------------------------------------------------------------------------------------------
# gpu.sh

FAKE_PYTHON = r"""#!/usr/bin/env bash
# Records each call; the environment step reports CUDA as $FAKE_CUDA.
echo "$*|DROP=${PAREPROP_DROP_WAIT:-}" >>"$FAKE_LOG"
case "$1" in
  -) cat >/dev/null; echo "device: fake"; echo "cuda_available: $FAKE_CUDA" ;;
  -c) echo "recover-after-grads join" ;;
  -m)
    if [[ -n ${FAKE_HANG:-} && -z ${PAREPROP_DROP_WAIT:-} ]]; then
      trap '' TERM  # ignores the polite stop: only SIGKILL ends it
      sleep 100
    fi
    if [[ $FAKE_CUDA == no ]]; then
      echo "18 skipped in 0.01s"
      exit 0
    fi
    case ${PAREPROP_DROP_WAIT:-} in
      join)  # caught
        echo "FAILED tests/test_pareprop_gpu.py::test_final_join - AssertionError: off by nan"
        echo "FAILED tests/test_cuda_graphs_gpu.py::test_bf16[pareprop] - RuntimeError: x"
        echo "PAREPROP_DROP_WAIT=join: dropped 2 times"
        echo "2 failed, 2 passed, 9 skipped in 0.01s" ;;
      recover-after-grads)  # not caught, never reached
        echo "PAREPROP_DROP_WAIT=recover-after-grads: dropped 0 times"
        echo "3 passed in 0.01s" ;;
      *) echo "3 passed in 0.01s" ;;
    esac ;;
  *) echo "ran $1" ;;
esac
"""


def _run(tmp_path, *args, cuda="yes", **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "FAKE_LOG": str(log), "FAKE_CUDA": cuda, **env}
    proc = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=full_env,
                          timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls


def _steps(out):
    return [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]


def _scripts(calls):
    return [c.split()[0] for c in calls if c.startswith("benchmarks/")]


def test_gpu_mode_runs_the_steps_in_order_then_the_summary(tmp_path):
    out = tmp_path / "out"
    proc, calls = _run(tmp_path, str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _scripts(calls) == ["benchmarks/real_largest_batch.py", "benchmarks/small_batch.py",
                               "benchmarks/profile_steps.py"]
    largest, small, profile = (c for c in calls if c.startswith("benchmarks/"))
    assert all(c.startswith(f"{s} --device cuda --json {out}/") for c, s in zip(
        (largest, small, profile), _scripts(calls)))
    assert "--cap 40GiB" in largest
    assert "--case rev_vit_base_patch16_224 reversible 9313 --chunk-bytes 1GiB" in largest
    assert "--case vit_base_patch16_224 checkpointed 2767" in largest
    assert "--case swin_tiny_patch4_window7_224 checkpointed" in largest
    assert largest.index("--case vit_base_patch16_224 plain") > largest.index("swin_tiny")
    assert "--pair rev_vit_large_patch16_224 vit_large_patch16_224" in small
    assert "--batch-sizes 8 16 32 --graphs" in small  # the targets' range, with CUDA graphs
    for script in (largest, small):  # 3/4 of the step's allowance
        limit = int(script.split("--time-limit ")[1].split()[0])
        assert 0 < limit < 480
    assert "--time-limit" not in profile
    assert "--overlap rev_vit_large_patch16_224 32" in profile
    pytest_calls = [c for c in calls if c.startswith("-m pytest")]
    tests = [c for c in pytest_calls if c.endswith("|DROP=")]
    controls = [c for c in pytest_calls if not c.endswith("|DROP=")]
    # one process per GPU test file, the lane tests first, the graphed ones last
    assert all("-m gpu" in c for c in pytest_calls)
    assert [c.split("|")[0].split()[-1] for c in tests] == [
        "tests/test_pareprop_gpu.py", "tests/test_engine_gpu.py", "tests/test_cuda_graphs_gpu.py"]
    assert pytest_calls[:3] == tests
    # one control per wait the engine names (the fake python names two), each dropping it,
    # each running the lane tests, the slowed engine tests and the graphed PaReprop tests
    assert [c.rsplit("DROP=", 1)[1] for c in controls] == ["recover-after-grads", "join"]
    for c in controls:
        assert ("tests/test_pareprop_gpu.py tests/test_engine_gpu.py::test_slowed_blocks_give"
                "_autograd_gradients tests/test_cuda_graphs_gpu.py -k pareprop and not warn") in c
    steps = _steps(out)
    assert [s[0] for s in steps] == ["largest", "small", "profile", "tests", "controls"]
    assert all(s[1] == "0" for s in steps)
    lines = proc.stdout.rstrip().splitlines()
    assert "summary:" in lines and lines[-1].startswith("total: ")
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == "summary:" and summary == lines[lines.index("summary:"):]
    assert "  gpu tests: tests/test_cuda_graphs_gpu.py: 3 passed in 0.01s" in lines
    assert ("  control join: caught by tests/test_pareprop_gpu.py::test_final_join; under CUDA "
            "graphs by tests/test_cuda_graphs_gpu.py::test_bf16[pareprop]") in lines
    # a control the tests do not catch says whether they reached the wait, and names the test
    # built to catch it
    assert ("  control recover-after-grads: NOT caught (the tests passed; no test reached the "
            "wait); the test built to catch it: test_lifetime_guard_keeps_memory_a_slowed_"
            "reader_still_needs") in lines


def test_dry_run_uses_the_cpu_and_tiny_models(tmp_path):
    out = tmp_path / "out"
    proc, calls = _run(tmp_path, "--dry-run", str(out), cuda="no")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scripted = [c for c in calls if c.startswith("benchmarks/")]
    assert len(scripted) == 3 and all("--device cpu" in c for c in scripted)
    assert "rev_vit_tiny_patch4_32" in scripted[0] and "--img-size 32" in scripted[0]
    assert "--graphs" in scripted[1]  # small_batch.py says itself that it ran none on the CPU
    # without CUDA the tests skip: one control shows it, the others start no pytest
    controls = [c for c in calls if c.startswith("-m pytest") and not c.endswith("|DROP=")]
    assert [c.rsplit("DROP=", 1)[1] for c in controls] == ["recover-after-grads"]
    assert ("control recover-after-grads: not run (the GPU tests skipped: no CUDA device)"
            in proc.stdout)
    assert "control join: not run (the GPU tests skip without a CUDA device, as above)" in (
        proc.stdout)


def test_gpu_mode_without_cuda_and_bad_usage_are_refused(tmp_path):
    proc, _ = _run(tmp_path, str(tmp_path / "out"), cuda="no")
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    proc, _ = _run(tmp_path)
    assert proc.returncode == 2 and "usage" in proc.stderr
    proc, _ = _run(tmp_path, str(tmp_path / "out"), GPU_SH_TOTAL_S="10")
    assert proc.returncode == 2 and "GPU_SH_TOTAL_S" in proc.stderr


@pytest.mark.slow
def test_a_step_that_ignores_sigterm_is_killed_inside_its_allowance(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc, calls = _run(tmp_path, str(out), GPU_SH_TOTAL_S="100", FAKE_HANG="1")
    took = time.monotonic() - t0
    steps = _steps(out)
    # 100 s - 10 s for the summary; the scripts before return at once, so the tests get
    # 115 / (115 + 105) of 90 s: 47 s, SIGKILL included, shared by three files that each hang
    assert steps[3][:2] == ["tests", "137"] and int(steps[3][2]) <= 48
    assert [s[1] for s in steps[:3]] == ["0"] * 3
    files = (out / "gpu_tests.log").read_text().splitlines()
    assert len(files) == 3 and all(": timed out after " in f for f in files), files
    assert steps[4][0] == "controls" and steps[4][1] == "0"  # the later step still ran
    assert proc.returncode == 1
    assert proc.stdout.rstrip().splitlines()[-1].startswith("total: ") and took < 65


# ---------------------------------------------------------------------------------------------
# tests/conftest.py: PAREPROP_DROP_WAIT, the controls' switch

def test_dropping_a_wait_skips_only_that_wait_and_counts_it(monkeypatch):
    import conftest
    from pareprop.engine.lanes import _Lanes

    waited = []
    monkeypatch.setattr(_Lanes, "wait", lambda self, i, event, n: waited.append(n))
    monkeypatch.setattr(conftest, "_DROPPED", [0])
    lanes = _Lanes(torch.device("cpu"), [False, False])
    lanes.enabled = True  # as on CUDA; the stand-in wait above touches no stream
    with conftest._dropping("recover-after-recover"):
        lanes.wait(0, object(), "recover-after-recover")  # dropped
        lanes.wait(0, None, "recover-after-recover")  # no event: nothing to drop
        lanes.wait(0, object(), "grads-after-grads")  # another wait: kept
    assert waited == ["grads-after-grads"] and conftest._DROPPED == [1]
    lanes.wait(0, object(), "recover-after-recover")  # after the block: waits again
    assert waited[-1] == "recover-after-recover"
    with conftest._dropping("join"):
        lanes.join()
    assert conftest._DROPPED == [2]


def test_drop_wait_names_are_checked_and_the_count_is_printed(monkeypatch):
    import conftest

    monkeypatch.setenv("PAREPROP_DROP_WAIT", "no-such-wait")
    with pytest.raises(pytest.UsageError, match="PAREPROP_DROP_WAIT: expected one of "
                                                "recover-after-recover, "):
        conftest._drop_wait_name()
    monkeypatch.setenv("PAREPROP_DROP_WAIT", "join")
    monkeypatch.setattr(conftest, "_DROPPED", [3])
    lines = []
    conftest.pytest_terminal_summary(type("Reporter", (), {"write_line": lambda self, line:
                                                           lines.append(line)})())
    assert lines == ["PAREPROP_DROP_WAIT=join: dropped 3 times"]


def test_a_control_skips_the_rest_of_a_group_after_its_first_failure(monkeypatch):
    import conftest

    def item(nodeid):
        return type("Item", (), {"nodeid": nodeid})()

    def failed(nodeid, when="call"):
        return type("Report", (), {"nodeid": nodeid, "failed": True, "when": when})()

    monkeypatch.setattr(conftest, "_CAUGHT", {})
    monkeypatch.delenv("PAREPROP_DROP_WAIT", raising=False)
    conftest.pytest_runtest_logreport(failed("tests/test_pareprop_gpu.py::test_join"))
    conftest.pytest_runtest_setup(item("tests/test_engine_gpu.py::test_slowed"))  # no control
    monkeypatch.setenv("PAREPROP_DROP_WAIT", "join")
    conftest.pytest_runtest_logreport(failed("tests/test_pareprop_gpu.py::test_a", "setup"))
    conftest.pytest_runtest_setup(item("tests/test_engine_gpu.py::test_slowed"))  # undecided
    conftest.pytest_runtest_logreport(failed("tests/test_pareprop_gpu.py::test_join"))
    with pytest.raises(pytest.skip.Exception, match="caught already, by tests/test_pareprop"):
        conftest.pytest_runtest_setup(item("tests/test_engine_gpu.py::test_slowed"))
    conftest.pytest_runtest_setup(item("tests/test_cuda_graphs_gpu.py::test_x"))  # runs
    conftest.pytest_runtest_logreport(failed("tests/test_cuda_graphs_gpu.py::test_x"))
    with pytest.raises(pytest.skip.Exception, match="test_cuda_graphs_gpu.py::test_x"):
        conftest.pytest_runtest_setup(item("tests/test_pareprop_gpu.py::test_graphed_lanes"))


def test_the_controls_read_the_engines_waits_from_its_source():
    # gpu.sh reads _Lanes.WAITS without importing pareprop (no torch import to wait for)
    text = open(SCRIPT).read()
    snippet = text.split("waits=$(python -c '", 1)[1].split("') || return 1", 1)[0]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    from pareprop.engine.lanes import _Lanes

    assert done.stdout.split() == list(_Lanes.WAITS), done.stderr
