"""``pareprop plan``: the table, plan.json, the plot, the largest batch and bad options."""

from __future__ import annotations

import json

import pytest

from pareprop.cli import main
from pareprop.memory import plan_memory

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--models", "rev_vit_tiny_patch4_32", "--depth", "1", "--device", "cpu"]


@pytest.mark.slow  # 16 plans; the quick tier writes plan.json and plan.png below
def test_plan_writes_json_and_plot_with_the_largest_batch(tmp_path, capsys):
    # Deep enough that autograd's kept activations outgrow one block's rebuilt graph.
    memory = plan_memory("rev_vit_tiny_patch4_32", 8, "autograd", device="cpu", depth=6).peak
    rc = main(["plan", *SMALL, "--depth", "6", "--engines", "autograd", "reversible",
               "--batch-sizes", "2", "4", "--memory", str(memory), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["memory_bytes"] == memory
    for r in plan["records"]:
        for key in ("model", "engine", "batch_size", "parameters", "gradients",
                    "optimizer_state", "activations", "peak", "fits"):
            assert key in r
        assert r["fits"] == (r["peak"] <= memory)
    assert {(r["engine"], r["batch_size"]) for r in plan["records"]} >= {
        ("autograd", 2), ("autograd", 4), ("reversible", 2), ("reversible", 4)}
    largest = {x["engine"]: x["largest_batch"] for x in plan["largest_batch"]}
    assert largest["autograd"] >= 8  # the memory is autograd's peak at batch 8
    assert largest["reversible"] > largest["autograd"]
    assert (tmp_path / "plan.png").read_bytes()[:8] == PNG_MAGIC
    assert "largest batch in" in out and "reversible" in out


@pytest.mark.parametrize("argv, message", [
    (["--memory", "80 gigs"], "expected a memory size such as 80GiB"),
    (["--memory", "80GiB", "--engines", "warp"], "expected an engine that applies"),
    ([], "expected --batch-sizes, --memory or both"),
    (["--batch-sizes", "2", "--coupling", "0", "1"],
     "--coupling 0 1 sets the coupling of converted models, and --models "
     "rev_vit_tiny_patch4_32 has none"),
    (["--batch-sizes", "2", "--coupling", "1", "-0.5"], "expected finite alpha and beta >= 0"),
    (["--batch-sizes", "2", "--coupling", "1", "inf"], "expected finite alpha and beta >= 0"),
    (["--batch-sizes", "2", "--coupling", "half", "1"], "expected numbers alpha and beta"),
])
def test_plan_refuses_bad_options(argv, message, tmp_path, capsys):
    rc = main(["plan", *SMALL, *argv, "--out", str(tmp_path / "x")])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_plan_refuses_an_unknown_model_and_batch_zero(tmp_path, capsys):
    assert main(["plan", "--models", "no_such_model_xyz", "--batch-sizes", "2",
                 "--out", str(tmp_path)]) == 2
    assert "unknown model 'no_such_model_xyz'" in capsys.readouterr().err
    assert main(["plan", *SMALL, "--batch-sizes", "0", "--out", str(tmp_path)]) == 2
    assert "expected a positive integer, got 0" in capsys.readouterr().err


# --- memory budgets --------------------------------------------------------------------------


def test_planned_budgets_span_reversible_to_autograd_and_match_a_real_step():
    import torch

    import pareprop
    from pareprop.memory import memory_report

    kw = dict(device="cpu", depth=4, num_classes=10)
    acts = {b: plan_memory("rev_vit_tiny_patch4_32", 4, "reversible", memory_budget=b, **kw)
            for b in (0, 0.5, 1)}
    floor = plan_memory("rev_vit_tiny_patch4_32", 4, "reversible", **kw)
    full = plan_memory("rev_vit_tiny_patch4_32", 4, "autograd", **kw)
    assert acts[0].activations == floor.activations
    assert floor.activations < acts[0.5].activations < acts[1].activations
    assert acts[1].activations == full.activations
    # The plan of a budget is the real step with the blocks that budget stores.
    torch.manual_seed(0)
    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=4, num_classes=10,
                                  engine="reversible")
    x = torch.randn(4, 3, 32, 32)
    pareprop.set_memory_budget(model, 0.5, x, engine="reversible", cost="flops")
    real = memory_report(model, (x,))
    assert real.activations == pytest.approx(acts[0.5].activations, rel=0.02)
    assert real.peak == pytest.approx(acts[0.5].peak, rel=0.02)


def test_plan_cli_shows_what_each_budget_gives(tmp_path, capsys):
    rc = main(["plan", *SMALL, "--depth", "4", "--engines", "autograd", "reversible",
               "--memory-budgets", "0", "1", "--batch-sizes", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    got = {(r["engine"], r["memory_budget"]): r["activations"] for r in plan["records"]}
    assert set(got) == {("autograd", None), ("reversible", 0.0), ("reversible", 1.0)}
    assert got[("reversible", 0.0)] < got[("reversible", 1.0)] == got[("autograd", None)]
    assert "reversible@0" in out and "reversible@1" in out
    assert (tmp_path / "plan.png").read_bytes()[:8] == PNG_MAGIC


def test_a_budget_for_an_engine_without_stored_blocks_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="has none to choose"):
        plan_memory("rev_vit_tiny_patch4_32", 2, "autograd", device="cpu", memory_budget=0.5)
    assert main(["plan", *SMALL, "--memory-budgets", "3", "--batch-sizes", "2",
                 "--out", str(tmp_path)]) == 2
    assert "expected a memory budget from 0" in capsys.readouterr().err


def test_plan_cli_grad_checkpointing_labels_and_lowers_the_records(tmp_path, capsys):
    argv = ["plan", "--models", "rev_mvitv2_tiny_32", "--engines", "reversible",
            "--device", "cpu", "--batch-sizes", "2"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--grad-checkpointing", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "reversible+ckpt" in out
    (a,), (b,) = (json.loads((tmp_path / d / "plan.json").read_text())["records"]
                  for d in ("a", "b"))
    assert (a["grad_checkpointing"], b["grad_checkpointing"]) == (False, True)
    assert b["activations"] < a["activations"]


# --- converted models at a coupling ----------------------------------------------------------

CONVERTED = ["--models", "converted:vit_small_patch16_224", "vit_small_patch16_224",
             "--engines", "reversible", "plain", "--depth", "3", "--img-size", "32",
             "--device", "cpu", "--batch-sizes", "4"]


def _records(tmp_path, *coupling):
    out = tmp_path / "_".join(coupling)
    assert main(["plan", *CONVERTED, "--coupling", *coupling, "--out", str(out)]) == 0
    return {r["model"]: r for r in json.loads((out / "plan.json").read_text())["records"]}


def test_plan_cli_coupling_reaches_the_converted_models_only(tmp_path, capsys):
    # (1, 0) is timm's network: beta = 0 cannot be inverted, every block keeps its graph, and
    # the plan is the source's under plain autograd. Any beta > 0 rebuilds every block (a plan
    # has no precision guard), as (0, 1) does.
    pretrained, midway, reversible = (_records(tmp_path, *c) for c in
                                      (("1", "0"), ("0.5", "0.5"), ("0", "1")))
    source = pretrained["vit_small_patch16_224"]
    assert pretrained["converted:vit_small_patch16_224"]["activations"] == source["activations"]
    assert source["coupling"] is None
    for plan, coupling in ((pretrained, [1.0, 0.0]), (midway, [0.5, 0.5]),
                           (reversible, [0.0, 1.0])):
        assert plan["converted:vit_small_patch16_224"]["coupling"] == coupling
        assert plan["vit_small_patch16_224"] == dict(source, coupling=None)
    kept = {name: plan["converted:vit_small_patch16_224"]["activations"]
            for name, plan in (("pretrained", pretrained), ("midway", midway),
                               ("reversible", reversible))}
    assert kept["midway"] == kept["reversible"] < kept["pretrained"] / 4
    assert "--coupling ALPHA BETA" in _help(capsys)


def test_plan_reports_the_coupling_the_model_was_built_at():
    # Read from the built model: the catalog's default for converted:SOURCE, or the override.
    kw = dict(depth=3, img_size=32, device="cpu")
    assert plan_memory("converted:vit_small_patch16_224", 2, "reversible", **kw).coupling == (
        0.0, 1.0)
    assert plan_memory("converted:vit_small_patch16_224", 2, "reversible", coupling=(0.5, 0.5),
                       **kw).coupling == (0.5, 0.5)
    assert plan_memory("vit_small_patch16_224", 2, "plain", **kw).coupling is None


def _help(capsys):
    capsys.readouterr()
    assert main(["plan", "--help"]) == 0
    return capsys.readouterr().out


def test_plan_cli_refuses_a_budget_at_beta_zero(tmp_path, capsys):
    rc = main(["plan", *CONVERTED, "--coupling", "1", "0", "--memory-budgets", "0.5",
               "--out", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "beta = 0 cannot be inverted" in err
