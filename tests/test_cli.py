"""The ``pareprop`` command dispatcher and ``pareprop demo``."""

import subprocess
import sys

import pytest

from pareprop.cli import main


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "bench", "plan", "demo"))


def test_no_command_and_unknown_command_fail_with_usage(capsys):
    assert main([]) == 2
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_demo_checks_every_engine_and_reports_memory(capsys):
    assert main(["demo", "--depth", "2", "--tokens", "4", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    for engine in ("autograd", "reversible", "pareprop"):
        assert engine in out
    # Worst relative errors of the reversible engines are printed in scientific notation.
    errors = [float(line.split()[4]) for line in out.splitlines() if "worst relative" in line]
    assert len(errors) == 2 and max(errors) < 1e-8


def test_demo_rejects_a_zero_depth():
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--depth", "0"])
    assert exc.value.code == 2


@pytest.mark.slow  # a fresh interpreter importing torch
def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "pareprop", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "pareprop <command>" in done.stdout


# -- issue 34.7: one line and exit 2, never a traceback ---------------------------------------

_TINY_VIT = [f"--model-arg={k}={v}" for k, v in dict(
    img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=1, num_heads=2).items()]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("files")
    (root / "dir").mkdir()
    (root / "empty.pth").write_bytes(b"")

    class Runs:  # unpickling it would call print: code from the file
        def __reduce__(self):
            return (print, ("ran code from the file",))

    torch.save({"x": Runs()}, root / "code.pth")
    torch.save({"stack.blocks.0.f.weight": torch.zeros(3)}, root / "other.pth")
    (root / "a_file").write_text("not a folder")
    (root / "mps.json").write_text('{"device": "mps"}')
    torch.save({"model": {"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, root / "timm.pth")
    # a model and a folder that evaluate: eval's own checks are what must refuse
    from PIL import Image

    import pareprop

    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2, num_classes=2)
    torch.save(model.state_dict(), root / "good.pth")
    for c in range(2):
        (root / "images" / f"c{c}").mkdir(parents=True)
        Image.new("RGB", (32, 32), (90 * c, 9, 9)).save(root / "images" / f"c{c}" / "0.png")
    return root


def _cases(root):
    out = ["--out", str(root / "run"), "--epochs", "1", "--max-steps", "1", "--no-progress"]
    conv = ["--convert-from", "vit_tiny_patch16_224", *_TINY_VIT]
    plan = ["--models", "rev_vit_tiny_patch4_32", "--device", "cpu", "--out", str(root / "plan")]
    ev = ["eval", "--model", "rev_vit_tiny_patch4_32", "--model-arg", "depth=2",
          "--model-arg", "num_classes=2", "--checkpoint", str(root / "good.pth"),
          "--data-dir", str(root / "images"), "--workers", "0", "--no-progress"]
    cases = {
        "train chunk-bytes 1e400": ["train", "--chunk-bytes", "1e400", *out],
        "plan chunk-bytes 1e400": ["plan", *plan, "--chunk-bytes", "1e400", "--batch-sizes", "2"],
        "plan memory 1e400": ["plan", *plan, "--memory", "1e400"],
        "bench chunk-bytes 1e400": ["bench", "--chunk-bytes", "1e400"],
        "model-arg not YAML": ["train", "--model-arg", "depth=[1", *out],
        "eval device cuda": [*ev, "--device", "cuda"] if not _has_cuda() else None,
        "eval device banana": [*ev, "--device", "banana"],
        "eval json missing folder": [*ev, "--json", str(root / "nope" / "r.json")],
        "eval limit 0": [*ev, "--limit", "0"],
        "num-classes vs data": ["train", "--num-classes", "7", *out],
        "model with convert-from": ["train", "--model", "rev_vit_tiny_patch4_32", *conv, *out],
        "pretrained with pretrained-file": ["train", "--pretrained", "--pretrained-file",
                                            str(root / "other.pth"), *out],
        "coupling-steps without convert-from": ["train", "--coupling-steps", "5", *out],
        "chunk-bytes with autograd": ["train", "--chunk-bytes", "1MiB", "--engine", "autograd",
                                      *out],
        "timm layout: a hint": ["train", "--pretrained-file", str(root / "timm.pth"), *out],
        # issue 39.6
        "train device mps": ["train", "--device", "mps", *out],
        "train config device mps": ["train", "--config", str(root / "mps.json"), *out],
        "train seed 1e20": ["train", "--seed", "99999999999999999999", *out],
        "bench device banana": ["bench", "--device", "banana", "--out", str(root / "bench")],
        "plan out is a file": ["plan", *plan[:-1], str(root / "a_file"), "--batch-sizes", "2"],
        "plan out under a file": ["plan", *plan[:-1], str(root / "a_file" / "plan"),
                                  "--batch-sizes", "2"],
        "plan amp fp8": ["plan", *plan, "--batch-sizes", "2", "--amp", "fp8"],
        "plan coupling beta -1": ["plan", *plan, "--batch-sizes", "2", "--coupling", "1", "-1"],
        "plan coupling of no converted model": ["plan", *plan, "--batch-sizes", "2",
                                                "--coupling", "0", "1"],
        "eval checkpoint missing": [*ev[:ev.index("--checkpoint") + 1], str(root / "nope.pth"),
                                    *ev[ev.index("--checkpoint") + 2:]],
    }
    for name in ("missing.pth", "dir", "empty.pth", "code.pth", "other.pth", "timm.pth"):
        for kind, pre in (("registered", []), ("converted", conv)):
            cases[f"pretrained-file {name} ({kind})"] = [
                "train", *pre, "--pretrained-file", str(root / name), *out]
    return {k: v for k, v in cases.items() if v is not None}


def _has_cuda():
    import torch

    return torch.cuda.is_available()


_CASE_NAMES = list(_cases(__import__("pathlib").Path("x")))


@pytest.mark.parametrize("case", _CASE_NAMES)
def test_bad_input_is_one_line_and_exit_2(case, bad_files, capsys):
    argv = _cases(bad_files)[case]
    rc = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "error" in lines[0], captured.err
    assert "Traceback" not in captured.err and "ran code from the file" not in captured.out
    if case.startswith("timm layout"):
        assert "--convert-from" in lines[0]  # the hint
    for part in _NAMED.get(case, ()):  # contradictions name both values
        assert part in lines[0]


_NAMED = {
    "eval limit 0": ("--limit",),
    "eval device banana": ("banana",),
    "eval json missing folder": ("does not exist",),
    "num-classes vs data": ("--num-classes 7", "'digits'", "10 classes"),
    "model with convert-from": ("--model rev_vit_tiny_patch4_32",
                                "--convert-from vit_tiny_patch16_224"),
    "pretrained with pretrained-file": ("--pretrained ", "--pretrained-file "),
    "coupling-steps without convert-from": ("--coupling-steps 5", "--convert-from"),
    "chunk-bytes with autograd": ("--chunk-bytes 1MiB", "--engine autograd"),
    "train device mps": ("--device", "'mps'", "cpu, cuda or cuda:N"),
    "train config device mps": ("--device", "'mps'"),
    "train seed 1e20": ("--seed", "99999999999999999999", "4294967295"),
    "bench device banana": ("--device", "'banana'", "cpu, cuda or cuda:N"),
    "plan out is a file": ("--out", "a_file", "is a file"),
    "plan out under a file": ("--out", "is under the file"),
    "plan amp fp8": ("--amp", "fp8"),
    "eval checkpoint missing": ("--checkpoint", "nope.pth", "does not exist"),
}


@pytest.mark.parametrize("command", ["train", "eval", "bench", "plan", "demo"])
def test_help_shows_what_it_means(command, capsys):
    # argparse %-formats an option's help, not the description: a "%%" there is printed as is
    try:
        rc = main([command, "--help"])
    except SystemExit as e:  # demo lets argparse exit
        rc = e.code
    out = capsys.readouterr().out
    assert rc == 0 and "%%" not in out and "%(" not in out
    if command == "train":
        assert ">= 95% validation accuracy" in " ".join(out.split())


@pytest.mark.parametrize("clip", [
    ["--num-frames", "3"], pytest.param(["--img-size", "30"], marks=pytest.mark.slow)])
def test_plan_of_mvit_v1_b_at_a_clip_size_off_its_strides(clip, tmp_path, capsys):
    # 3 frames through the patch embedding (kernel 3, stride 2, padding 1) are 2 time steps,
    # not 3 // 2; 30 px (kernel 7, stride 4, padding 3) are 8 rows, not 30 // 4
    size = {"--num-frames": "4", "--img-size": "32", **dict([clip])}
    rc = main(["plan", "--models", "mvit_v1_b", *[x for kv in size.items() for x in kv],
               "--engines", "plain", "--batch-sizes", "1", "--device", "cpu",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0 and "mvit_v1_b" in captured.out, captured.err


def test_eval_of_the_case_files_works(bad_files, capsys):
    # the eval cases above fail by their option alone
    argv = _cases(bad_files)["eval limit 0"]
    assert argv[-2:] == ["--limit", "0"] and main(argv[:-2]) == 0


def test_ctrl_c_while_a_command_loads_is_one_line(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr("pareprop.cli.importlib.import_module", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "pareprop train: interrupted"


def test_every_size_parser_takes_the_same_forms():
    import math

    import pareprop
    from pareprop.engine.chunk_cost import parse_chunking
    from pareprop.memory import parse_memory
    from pareprop.memory.budget import parse_budget

    forms = {"268435456": 2**28, "256MiB": 2**28, " 256 mib ": 2**28, "2.5e8": 250_000_000,
             "1.5GB": 1_500_000_000, "2TiB": 2 * 2**40, 2**28: 2**28, 2.5e8: 250_000_000}
    for text, size in forms.items():
        assert parse_memory(text) == size
        assert parse_chunking(max_bytes=text).max_bytes == size
        if not isinstance(text, float):  # a float budget is a fraction of autograd's memory
            assert parse_budget(text) == ("bytes", float(size))
    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=2)
    for bad in ("1e400", "-1MiB", "0", "12 parsecs", math.inf, math.nan, -5):
        for parse in (parse_memory, lambda t: parse_chunking(max_bytes=t)):
            with pytest.raises(ValueError, match="size"):
                parse(bad)
        with pytest.raises(ValueError, match="size"):
            pareprop.set_chunking(model, max_bytes=bad)
    for bad in (math.inf, math.nan, 1.5, True):
        with pytest.raises(ValueError, match="chunk count"):
            pareprop.set_chunking(model, chunks=bad)


def test_train_help_reads_in_sections():
    from pareprop.cli.train import build_parser

    parser = build_parser()
    text = parser.format_help()
    sections = ["model:", "fine-tuning a converted model:", "engine and memory:", "data:",
                "optimization:", "the run:"]
    assert [text.index(s) for s in sections] == sorted(text.index(s) for s in sections)
    # Every option but --config and --help sits in a section.
    grouped = {a.dest for g in parser._action_groups[2:] for a in g._group_actions}
    loose = {a.dest for a in parser._actions} - grouped
    assert loose == {"help", "config"}
