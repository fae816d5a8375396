"""The summary of benchmarks/gpu.sh, on synthetic records of the kind `pareprop bench` writes."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gs = _load("gpu_summary")

GiB = 2**30


def rec(engine, bs, status="ok", rate=None, model=None, **extra):
    """One record; throughput defaults to something that grows with the batch."""
    model = model or ("std" if engine in ("plain", "checkpointed") else "rev")
    r = {"model": model, "engine": engine, "batch_size": bs, "status": status,
         "device": "cuda", "dtype": "bfloat16-amp", "peak_mem_bytes": None,
         "samples_per_s": None}
    if status == "ok":
        r["samples_per_s"] = float(rate if rate is not None else bs)
        r["peak_mem_bytes"] = bs * GiB // 8
    r.update(extra)
    return r


def sweep(records, name="mvit", label="Rev-MViTv2-B"):
    return gs.Sweep(name, label, "rev", "std", list(gs.ENGINES), records)


def typical():
    """plain and autograd run out of memory at 128; the reversible engines reach 256."""
    return [
        rec("plain", 32, rate=100), rec("plain", 64, rate=120), rec("plain", 128, "oom"),
        rec("checkpointed", 32, rate=80), rec("checkpointed", 64, rate=90),
        rec("checkpointed", 128, rate=95), rec("checkpointed", 256, rate=96),
        rec("autograd", 32, rate=100), rec("autograd", 64, rate=125), rec("autograd", 128, "oom"),
        rec("reversible", 32, rate=70), rec("reversible", 64, rate=80),
        rec("reversible", 128, rate=90), rec("reversible", 256, rate=85),
        rec("pareprop", 32, rate=75, peak_reserved_bytes=5 * GiB, planned_peak_bytes=4 * GiB),
        rec("pareprop", 64, rate=115, peak_reserved_bytes=9 * GiB, planned_peak_bytes=8 * GiB),
        rec("pareprop", 128, rate=110), rec("pareprop", 256, rate=100),
        rec("pareprop", 512, "oom"),
    ]


def test_figures_of_a_typical_sweep():
    f = gs.analyse(sweep(typical()))
    assert f.equal_batch == 64  # the largest batch all five engines ran
    assert {e: r["samples_per_s"] for e, r in f.at_equal.items()} == {
        "plain": 120, "checkpointed": 90, "autograd": 125, "reversible": 80, "pareprop": 115}
    assert f.best["pareprop"]["batch_size"] == 64 and f.best["reversible"]["batch_size"] == 128
    assert f.speedup == pytest.approx(115 / 90)
    assert f.vs_autograd == (pytest.approx(115 / 125), 64)
    # exact: a larger batch ran out of memory; otherwise a lower bound
    assert f.largest == {"plain": (64, True), "checkpointed": (256, False),
                         "autograd": (64, True), "reversible": (256, False),
                         "pareprop": (256, True)}
    # reversible never ran out at 256, so the reversible engines' 256 is a lower bound
    assert f.batch_ratio == (4.0, "lower")
    assert f.counts == {"ok": 16, "oom": 3}


def test_verdicts_of_the_targets():
    sweeps = [sweep(typical())]
    verdicts = gs.targets(sweeps, [gs.analyse(s) for s in sweeps])
    assert [v for v, _ in verdicts] == ["met", "met", "met"]
    assert "1.28x (bs 64 vs 128)" in verdicts[0][1]
    assert "0.92x at bs 64" in verdicts[1][1]
    assert ">=4.0x" in verdicts[2][1]

    slow = [r for r in typical() if r["engine"] != "pareprop"]
    slow += [rec("pareprop", 64, rate=100), rec("pareprop", 128, "oom")]
    # no speedup target on a ViT sweep; 100/125 < 0.9; both reversible engines' largest:
    # reversible 256 (never ran out) -> lower bound 4.0 >= 4: met
    vit = sweep(slow, name="vit", label="Rev-ViT-B")
    verdicts = gs.targets([vit], [gs.analyse(vit)])
    assert [v for v, _ in verdicts] == ["NOT MET", "met"]


def test_retries_pareprop_against_reprop_and_against_checkpointing():
    records = typical()
    for r in records:  # what bench records carry since the PaReprop fallback
        if r["status"] == "ok":
            r["alloc_retries"] = {("pareprop", 256): 7, ("reversible", 256): 0,
                                  ("checkpointed", 256): 2}.get((r["engine"], r["batch_size"]),
                                                                 1)
            if r["engine"] == "pareprop":
                r["schedule"] = "reversible" if r["batch_size"] == 256 else "pareprop"
    f = gs.analyse(sweep(records))
    # at each engine's largest batch that ran: plain 64, checkpointed 256, autograd 64, ...
    assert f.retries == {"plain": 1, "checkpointed": 2, "autograd": 1, "reversible": 0,
                         "pareprop": 7}
    # both ran 32, 64, 128, 256: smallest, middle, largest; step time = inverse throughput
    assert f.vs_reprop == [(32, pytest.approx(70 / 75), "pareprop"),
                           (128, pytest.approx(90 / 110), "pareprop"),
                           (256, pytest.approx(85 / 100), "reversible")]
    # checkpointed, reversible and pareprop all ran 256: step time over checkpointed's there
    assert f.vs_checkpointed == (256, pytest.approx(96 / 85), pytest.approx(96 / 100))

    text = gs.format_summary([sweep(records)])
    tables = {t.split("\n")[0]: t.splitlines() for t in text.split("\n\n")}
    retries = next(v for k, v in tables.items() if k.startswith("allocator retries"))
    assert retries[-1].split() == ["Rev-MViTv2-B", "1", "2", "1", "0", "7"]
    reprop = next(v for k, v in tables.items() if k.startswith("pareprop/reversible step"))
    assert reprop[-1].split()[1:] == ["32:", "0.93", "pareprop", "128:", "0.82", "pareprop",
                                      "256:", "0.85", "reversible"]
    ckpt = next(v for k, v in tables.items() if k.startswith("against timm's checkpointed"))
    assert ckpt[-1].split() == ["Rev-MViTv2-B", "256", "1.13", "0.96", ">=256", ">=256", "256"]


def test_records_without_the_new_fields_and_engines_missing_print_dashes():
    # Records written before alloc_retries and schedule existed (or on the CPU: None).
    records = [r for r in typical() if r["engine"] != "checkpointed"]
    f = gs.analyse(sweep(records))
    assert set(f.retries.values()) == {None}
    assert [s for _, _, s in f.vs_reprop] == [None, None, None]
    assert f.vs_checkpointed is None
    only_rev = gs.analyse(sweep([rec("reversible", 8), rec("checkpointed", 8, rate=4)]))
    assert only_rev.vs_reprop == [] and only_rev.vs_checkpointed == (8, 0.5, None)
    text = gs.format_summary([sweep(records)])
    ckpt = next(t for t in text.split("\n\n") if t.startswith("against timm's checkpointed"))
    assert ckpt.splitlines()[-1].split() == ["Rev-MViTv2-B", "-", "-", "-", "-", ">=256", "256"]
    two = gs.format_summary([sweep([rec("reversible", 2), rec("pareprop", 2, rate=4),
                                    rec("reversible", 4), rec("pareprop", 4, rate=2)])])
    row = next(t for t in two.split("\n\n") if t.startswith("pareprop/reversible step"))
    assert row.splitlines()[-1].split() == ["Rev-MViTv2-B", "2:", "0.50", "-", "4:", "2.00"]
    assert gs.three_batches([8, 2, 4, 2]) == [2, 4, 8]
    assert gs.three_batches([1, 2, 3, 4, 5, 6]) == [1, 4, 6]


@pytest.mark.parametrize("ours_oom,plain_oom,expected", [
    (True, True, "NOT MET"),  # 2x, both exact
    (False, True, "unknown"),  # at least 2x: might still reach 4x
    (True, False, "NOT MET"),  # at most 2x
    (False, False, "unknown"),
])
def test_largest_batch_target_is_decided_only_when_the_sweep_can(ours_oom, plain_oom, expected):
    records = [rec("plain", 32), rec("reversible", 32), rec("reversible", 64)]
    if plain_oom:
        records.append(rec("plain", 64, "oom"))
    if ours_oom:
        records.append(rec("reversible", 128, "oom"))
    s = sweep(records, name="text", label="Rev-RoBERTa-B")
    verdicts = dict((text.split(":")[1].strip(), v) for v, text in
                    gs.targets([s], [gs.analyse(s)]))
    assert verdicts["largest batch >= 4x std plain"] == expected
    assert verdicts["PaReprop >= 0.9x autograd at equal batch"] == "unknown"


def test_summary_has_one_line_per_model_per_table_and_dashes_for_missing_fields():
    sweeps = [sweep(typical()), sweep([rec("autograd", 8, "error: RuntimeError: boom")],
                                      name="text", label="Rev-RoBERTa-B")]
    text = gs.format_summary(sweeps, [("tests", "0", "31", ""), ("vit", "124", "80", "")])
    tables = text.split("\n\n")
    for title in ("configurations", "samples/s at equal batch", "samples/s at each engine's best",
                  "largest batch", "peak memory", "allocator retries", "pareprop/reversible step",
                  "against timm's checkpointed"):
        table = next(t for t in tables if t.startswith(title))
        assert sum(line.startswith("Rev-MViTv2-B ") for line in table.splitlines()) == 1
        assert sum(line.startswith("Rev-RoBERTa-B ") for line in table.splitlines()) == 1
    memory = next(t for t in tables if t.startswith("peak memory")).splitlines()
    mvit = next(line for line in memory if line.startswith("Rev-MViTv2-B"))
    # all allocated 8 GiB at bs 64; only pareprop's records have the reserved and planned bytes
    assert mvit.split()[2:] == ["8.00G/-", "(-)"] * 4 + ["8.00G/9.00G", "(8.00G)"]
    problems = next(t for t in tables if t.startswith("problems"))
    assert "Rev-RoBERTa-B rev autograd bs 8: error: RuntimeError: boom" in problems
    assert "step vit: exit status 124" in problems
    assert gs.has_problems(sweeps, [])
    assert not gs.has_problems(sweeps[:1], [("tests", "0", "1", ""), ("x", "skipped", "0", "")])


def _write_sweep(out, name, label, engines_records, partial=None):
    folder = out / name
    folder.mkdir()
    (folder / "sweep.json").write_text(json.dumps(
        {"label": label, "model": "rev", "baseline": "std", "engines": list(engines_records)}))
    for engine, records in engines_records.items():
        (folder / engine).mkdir()
        lines = "".join(json.dumps(r) + "\n" for r in records)
        if engine == partial:  # cut off: a broken results.json, a half-written last line
            (folder / engine / "results.json").write_text("[{\"model\": ")
            lines += '{"model": "rev", "eng'
        else:
            (folder / engine / "results.json").write_text(json.dumps(records))
        (folder / engine / "results.jsonl").write_text(lines)


def test_main_reads_sweep_folders_and_falls_back_to_the_stream(tmp_path, capsys):
    by_engine = {}
    for r in typical():
        by_engine.setdefault(r["engine"], []).append(r)
    _write_sweep(tmp_path, "mvit", "Rev-MViTv2-B", by_engine, partial="pareprop")
    (tmp_path / "steps.tsv").write_text("tests\t0\t30\t\nsanitizer\t0\t40\tCSAN\n")
    sweeps = gs.load_sweeps(str(tmp_path))
    assert len(sweeps[0].records) == len(typical())
    assert any("read results.jsonl instead" in n for n in sweeps[0].notes)

    assert gs.main([str(tmp_path)]) == 0  # an engine cut off is no error: a note says so
    out = capsys.readouterr().out
    assert "notes\n  Rev-MViTv2-B: " in out and "problems\n  none" in out
    assert "Rev-MViTv2-B: PaReprop >= 1.15x Reprop at best batch: 1.28x" in out
    assert (tmp_path / "summary.txt").read_text().strip() == out.strip()


def test_main_is_clean_when_everything_ran(tmp_path, capsys):
    by_engine = {}
    for r in typical():
        by_engine.setdefault(r["engine"], []).append(r)
    _write_sweep(tmp_path, "mvit", "Rev-MViTv2-B", by_engine)
    assert gs.main([str(tmp_path)]) == 0
    assert "problems\n  none" in capsys.readouterr().out


def test_main_without_results_and_bad_usage(tmp_path, capsys):
    assert gs.main([str(tmp_path)]) == 0
    assert "no sweep left any results" in capsys.readouterr().out
    assert gs.main([str(tmp_path / "missing")]) == 2
    assert "usage" in capsys.readouterr().err


def test_chunked_runs_are_compared_with_the_same_engine_on_whole_branches(tmp_path, capsys):
    by_engine = {}
    for r in typical():
        by_engine.setdefault(r["engine"], []).append(r)
    # As gpu_sweep.py leaves them: records name the engine they ran, the folder says chunked.
    by_engine["pareprop_chunked"] = [
        rec("pareprop", 128, rate=100, chunk_bytes="1GiB", peak_mem_bytes=8 * GiB),
        rec("pareprop", 256, rate=80, chunk_bytes="1GiB", peak_mem_bytes=16 * GiB),
        rec("pareprop", 512, rate=70, chunk_bytes="1GiB"), rec("pareprop", 1024, "oom")]
    _write_sweep(tmp_path, "mvit", "Rev-MViTv2-B", by_engine)
    (s,) = gs.load_sweeps(str(tmp_path))
    fig = gs.analyse(s)
    # whole pareprop at 256: rate 100, peak 32 GiB; chunked: rate 80, peak 16 GiB
    bs, time_ratio, peak, chunk, largest = fig.vs_whole["pareprop"]
    assert (bs, chunk, largest) == (256, "1GiB", (512, True))
    assert time_ratio == pytest.approx(100 / 80) and peak == pytest.approx(0.5)
    assert "reversible" not in fig.vs_whole  # no chunked run of it
    # the chunked run is not one of the engines the other tables compare
    assert fig.largest["pareprop"] == (256, True) and fig.equal_batch == 64
    assert gs.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = out.split("chunked branches against whole ones")[1].split("\n\n")[0]
    row = table.splitlines()[-1].split()
    assert row == ["Rev-MViTv2-B", "pareprop", "1GiB", "256", "1.25", "0.50", "256", "512"]


def test_no_chunked_table_without_chunked_runs():
    assert "chunked branches" not in gs.format_summary([sweep(typical())])
