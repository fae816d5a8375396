"""Chunked branches (pareprop.set_chunking): every family under every reversible engine equals
plain autograd in float64 with chunk counts 1, 2, 3 and 7, dropout and drop-path on; chunked
dropout draws exactly the whole branch's masks; the top block's outputs are left alone; a block
that cannot split is refused by name."""

import re

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import pareprop
import test_grad_checkpointing as gc_tests
from pareprop import chunking
from pareprop.engine import backward, chunk_cost, chunked, recompute
from pareprop.engine.testing import engine_errors, relative_error, worst_error
from test_engine import DIM, TOL, Model

pytestmark = pytest.mark.usefixtures("float64_seeded")  # tests/conftest.py

ENGINES = ("reversible", "pareprop")
COUNTS = (1, 2, 3, 7)
BATCH = 8  # F splits over samples: 7 chunks of 8 samples leave an uneven last one


def _tiny_models():
    """One model of each family with enough tokens for 7 uneven chunks, dropout and drop-path
    on."""
    vit = pareprop.create_model(
        "rev_vit_tiny_patch4_32", img_size=16, embed_dim=16, depth=3, num_heads=8,
        num_classes=5, drop_path_rate=0.3, attn_drop_rate=0.1, proj_drop_rate=0.1,
    )
    mvit = pareprop.create_model(
        "rev_mvitv2_tiny_32", img_size=16, embed_dim=16, num_heads=4, num_classes=5,
        drop_path_rate=0.3, last_block_indexes=(0, 3),
    )
    swin = pareprop.create_model(
        "rev_swin_tiny_32", embed_dim=16, depths=(2, 3), num_heads=(4, 8), window=4,
        patch_size=2, img_size=16, num_classes=5, drop_path_rate=0.2, attn_drop_rate=0.1,
        proj_drop_rate=0.1,
    )
    text = pareprop.create_model(
        "rev_roberta_small", vocab_size=20, max_position_embeddings=16, example_seq_len=12,
        embed_dim=16, depth=3, num_heads=8, mlp_dim=32, num_classes=3, attn_drop_rate=0.1,
        drop_rate=0.1, drop_path_rate=0.2,
    )
    rev_mvit = pareprop.create_model(
        "rev_mvit_base", img_size=32, embed_dim=8, depth=4, transition_blocks=(2,),
        num_classes=5, drop_path_rate=0.3,
    )
    return {"vit": vit, "mvit": mvit, "swin": swin, "text": text, "rev_mvit": rev_mvit,
            "converted": _converted()}


def _converted(fused=False, **overrides):
    """A converted timm ViT (class and register token, layer scale) with every dropout on,
    coupled so that no block is stored. ``fused``: timm's fused attention, whose attention
    dropout draws inside the kernel (F then runs whole)."""
    kw = dict(img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=3, num_classes=5,
              reg_tokens=1, init_values=0.5, drop_path_rate=0.3, proj_drop_rate=0.1,
              attn_drop_rate=0.1)
    source = VisionTransformer(**{**kw, **overrides})
    for block in source.blocks:
        block.attn.fused_attn = fused
    model = pareprop.convert(source, tolerance=None)
    pareprop.set_coupling(model, 0.3, 0.5)
    assert model.stack.stored_blocks == ()
    return model


def _model(family):
    torch.manual_seed(0)
    model = _tiny_models()[family].double()
    if family in ("mvit", "rev_mvit"):  # the key norm's bias has an exact zero gradient
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("norm_k.bias"))
    return model


def _spy_chunks(monkeypatch):
    """Record (size, count) of every chunked branch the engine runs."""
    seen = []
    real = chunked.chunks

    def spy(size, count):
        seen.append((size, count))
        return real(size, count)

    monkeypatch.setattr(chunked, "chunks", spy)
    return seen


def test_chunks_cover_every_unit_the_first_ones_longer():
    assert [(c.start, c.stop) for c in chunking.chunks(10, 3)] == [(0, 4), (4, 7), (7, 10)]
    assert [c.length for c in chunking.chunks(3, 7)] == [1, 1, 1]  # at most one per unit


@pytest.mark.parametrize("count", [2, 3, 7])
@pytest.mark.parametrize("dim,rows", [(0, 1), (0, 3), (1, 1), (2, 1)])
def test_chunked_dropout_and_drop_path_draw_the_whole_mask(count, dim, rows):
    # rows=3: three rows per unit along the batch, as Swin's windows (B * nW, N, C)
    x = torch.randn(9 * rows if dim == 0 else 3, 9, 10)
    units = x.shape[dim] // rows
    drop = pareprop.layers.DropPath(0.5).train()
    for name, whole_fn, chunk_fn in [
        ("dropout", lambda t: F.dropout(t, 0.4),
         lambda t, c: chunking.dropout(t, 0.4, True, c, dim)),
        ("drop_path", drop, lambda t, c: drop(t, c, dim)),
    ]:
        torch.manual_seed(5)
        whole = whole_fn(x)
        after_whole = torch.get_rng_state()
        parts = []
        for chunk in chunking.chunks(units, count):
            torch.manual_seed(5)  # the engine restores the branch's state before every chunk
            parts.append(chunk_fn(chunk.take(x, dim, rows), chunk))
            # the generator moved exactly as the whole draw moved it: later draws agree too
            assert torch.equal(torch.get_rng_state(), after_whole), name
        assert torch.equal(torch.cat(parts, dim), whole), name
    # A chunk that drew only its own part would not match: the test can fail.
    last = chunking.chunks(units, count)[-1]
    torch.manual_seed(5)
    whole = F.dropout(x, 0.4)
    torch.manual_seed(5)
    assert not torch.equal(F.dropout(last.take(x, dim, rows), 0.4), last.take(whole, dim, rows))


@pytest.mark.parametrize("family", ["vit", "mvit", "swin", "text", "rev_mvit", "converted"])
@pytest.mark.parametrize("count", COUNTS)
def test_every_family_and_engine_equals_autograd_with_chunks(family, count, monkeypatch):
    model = _model(family)
    pareprop.set_chunking(model, chunks=count)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, model.example_inputs(BATCH, dtype=torch.float64),
                           engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"{family} chunks={count}: {engine} {key} relative error {err:.3e}"
    if count == 1:  # whole branches through the chunked (in-place) schedule
        assert seen == []
    else:  # both splits ran (samples and tokens), and some with an uneven last chunk
        assert seen and all(c == min(count, size) for size, c in seen)
        assert {size for size, _ in seen} >= {BATCH}
        if count == 7:
            assert any(size % c for size, c in seen)


@pytest.mark.parametrize("engine", ENGINES)
def test_forward_runs_each_branch_in_chunks(engine, monkeypatch):
    # NOTE [ Chunked forward ]: no whole-branch temporaries in forward either
    model = _model("vit")
    pareprop.set_engine(model, engine)
    pareprop.set_chunking(model, chunks=3)
    seen = _spy_chunks(monkeypatch)
    model(model.example_inputs(BATCH, dtype=torch.float64)[0])  # forward only
    depth = len(model.stack.blocks)
    assert sorted(seen) == sorted([(BATCH, 3)] * depth + [(16, 3)] * depth)  # F: samples, G: tokens


@pytest.mark.parametrize("stored", [[0], [1], [2], [0, 2]])
def test_stored_blocks_with_chunks(stored):
    # Under PaReprop a chunked block's X1 is rebuilt by the recover of the block below
    # (NOTE [ Chunked backward ]): a stored block below, above or at the bottom breaks that
    # chain, and gradients stay exact.
    model = _model("vit")
    model.stack.store_blocks(stored)
    pareprop.set_chunking(model, chunks=3)
    report = engine_errors(model, model.example_inputs(4, dtype=torch.float64),
                           engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"stored {stored}: {engine} {key} relative error {err:.3e}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("stored", [[], [1]])
def test_debug_reconstruction_checks_every_recomputed_block_with_chunks(engine, stored):
    # Every recomputed block is checked, stored ones mixed in, under both reversible engines.
    model = _model("vit")
    pareprop.set_engine(model, engine)
    model.stack.store_blocks(stored)
    pareprop.set_chunking(model, chunks=3)
    pareprop.debug_reconstruction(model, tolerance=1e-9)
    model(model.example_inputs(4, dtype=torch.float64)[0]).sum().backward()
    errors = model.stack.last_reconstruction_errors
    for index, (e1, e2) in enumerate(errors):
        if index in stored:
            continue
        assert e1 < 1e-12 and e2 < 1e-12, (index, e1, e2)  # a NaN (never checked) fails too


def test_chunked_pareprop_runs_reprops_schedule_and_says_why(monkeypatch):
    # NOTE [ Chunking runs Reprop ]: a chunked stack under "pareprop" runs Reprop's schedule,
    # so it calls its branches' chunks as often as "reversible" does (the old chunked PaReprop
    # rebuilt each block once more: 22 calls against 12 on this model), holds what it holds,
    # and never creates lanes.
    calls = {}
    count_lanes = []
    run_chunks = chunked._run_chunks
    monkeypatch.setattr(backward, "_Lanes",
                        lambda *a, **k: count_lanes.append(1) or pytest.fail("lanes created"))

    def counting(plan, branch, to):
        calls[plan.engine] = calls.get(plan.engine, 0) + (1 if branch.whole else branch.count)
        return run_chunks(plan, branch, to)

    monkeypatch.setattr(chunked, "_run_chunks", counting)
    torch.manual_seed(0)
    model = pareprop.create_model("rev_vit_tiny_patch4_32", embed_dim=32, depth=3,
                                  num_heads=4, num_classes=10)
    pareprop.set_chunking(model, chunks=2)
    x = torch.randn(8, 3, 32, 32)
    peaks = {}
    for e in ("reversible", "pareprop"):
        pareprop.set_engine(model, e)
        peaks[e] = pareprop.memory_report(model, x, optimizer="sgd").peak
    assert calls["pareprop"] == calls["reversible"] == 3 * 2 * 2 * 2  # fwd + bwd, F and G
    assert peaks["pareprop"] == peaks["reversible"]
    assert not count_lanes
    assert pareprop.chosen_schedule(model) == "reversible"
    (state, why), = pareprop.schedule_reasons(model).values()
    assert state == "reversible" and "chunking is for memory" in why
    pareprop.set_chunking(model)
    assert pareprop.chosen_schedule(model) == "pareprop"


def test_a_block_without_a_split_is_refused_by_name():
    # It used to run whole without a word: --chunk-bytes then did nothing on Rev-MViT (v1) and
    # converted ViTs while `pareprop plan` printed a chunk size beside an unchanged peak.
    model = Model(3)
    for call in (lambda: pareprop.set_chunking(model, chunks=4),
                 lambda: pareprop.set_chunking(model, max_bytes="1MiB"),
                 lambda: model.stack.set_chunking(chunks=4)):
        with pytest.raises(ValueError, match=r"block(s\.| )0 \(MixerBlock\) declares no split"):
            call()
    assert model.stack.chunking is None
    pareprop.set_chunking(model)  # off is always fine


def test_a_block_that_declares_no_split_for_an_input_runs_whole():
    # A class that defines f_split may answer None for an input (a converted block with fused
    # attention dropout does): that branch runs whole, exactly, through the chunked schedule.
    class Whole(type(Model(1).stack.blocks[0])):
        def f_split(self, x, **kwargs):
            return None

    model = Model(3)
    model.stack = pareprop.ReversibleStack([Whole(DIM) for _ in range(3)])
    pareprop.set_chunking(model, chunks=4)
    report = engine_errors(model, torch.randn(2, 5, DIM), engines=ENGINES, scale=torch.tensor(0.5))
    engine, key, err = worst_error(report)
    assert err < TOL, f"{engine} {key} relative error {err:.3e}"


def test_converted_vit_with_fused_attention_dropout_chunks_g_only(monkeypatch):
    # NOTE [ timm's layers in chunks ]: SDPA's dropout cannot be sliced, so F runs whole.
    torch.manual_seed(0)
    model = _converted(fused=True).double()
    pareprop.set_chunking(model, chunks=3)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, model.example_inputs(BATCH, dtype=torch.float64),
                           engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"{engine} {key} relative error {err:.3e}"
    tokens = 16 + 2  # patches, class and register token
    assert seen and {size for size, _ in seen} == {tokens}  # G only
    model.eval()  # no attention dropout to draw: F splits over samples again
    x = model.example_inputs(BATCH, dtype=torch.float64)[0]
    assert model.stack.blocks[0].f_split(model.patch_embed(x)) == chunking.Split.samples(BATCH)


def test_converted_vit_with_timms_swiglu_mlp_equals_autograd_with_chunks():
    # Any of timm's token-wise MLPs chunks: its dropouts take their slice of the whole mask.
    from timm.layers import SwiGLU

    torch.manual_seed(0)
    model = _converted(mlp_layer=SwiGLU).double()
    pareprop.set_chunking(model, chunks=3)
    report = engine_errors(model, model.example_inputs(BATCH, dtype=torch.float64),
                           engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"{engine} {key} relative error {err:.3e}"


@pytest.mark.slow
def test_plan_with_chunk_bytes_plans_less_on_rev_mvit():
    # Rev-MViT (v1) chunks its reversible blocks and, checkpointed, its transitions: the plan
    # with a chunk size is lower (it once printed the same peak beside the chunk size).
    from pareprop.memory import plan_memory

    torch.set_default_dtype(torch.float32)  # planned as trained (the fixture puts it back)
    kw = dict(device="cpu", num_classes=10, img_size=32, embed_dim=8, depth=7,
              grad_checkpointing=True)
    whole = plan_memory("rev_mvit_base", 16, "reversible", **kw)
    chunked = plan_memory("rev_mvit_base", 16, "reversible", chunk_bytes="128KiB", **kw)
    assert chunked.chunk_bytes == 128 * 2**10
    assert chunked.peak < 0.9 * whole.peak, (chunked.peak, whole.peak)


def test_plan_with_chunk_bytes_refuses_a_block_that_cannot_split(monkeypatch, capsys):
    # A block that cannot split: one line naming it, exit 2, no chunk size printed.
    from pareprop.cli import plan as plan_cli
    from pareprop.models.rev_mvit import RevMViTv1Block

    monkeypatch.setattr(RevMViTv1Block, "f_split", pareprop.ReversibleBlock.f_split)
    monkeypatch.setattr(RevMViTv1Block, "g_split", pareprop.ReversibleBlock.g_split)
    code = plan_cli.main(["--models", "rev_mvit_base", "--engines", "reversible",
                          "--batch-sizes", "2", "--img-size", "32", "--device", "cpu",
                          "--chunk-bytes", "128KiB", "--out", "/nonexistent/never"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert "RevMViTv1Block) declares no split" in out.err and len(out.err.splitlines()) == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_chunking_by_bytes_picks_counts_and_stays_exact(engine, monkeypatch):
    model = _model("vit")
    seen = _spy_chunks(monkeypatch)
    pareprop.set_chunking(model, max_bytes=10**12)  # everything fits: whole branches
    engine_errors(model, model.example_inputs(2, dtype=torch.float64), engines=(engine,))
    assert seen == []
    pareprop.set_chunking(model, max_bytes="4KiB")
    report = engine_errors(model, model.example_inputs(2, dtype=torch.float64),
                           engines=(engine,))
    engine_, key, err = worst_error(report)
    assert err < TOL, f"{engine_} {key} relative error {err:.3e}"
    assert seen and any(count > 1 for _, count in seen)
    assert model.stack._chunk_costs  # measured once, then reused
    pareprop.set_chunking(model)  # off again
    assert model.stack.chunking is None


@pytest.mark.parametrize("engine", ENGINES)
def test_outputs_are_left_alone_and_a_second_backward_is_refused(engine):
    model = _model("vit")
    pareprop.set_engine(model, engine)
    pareprop.set_chunking(model, chunks=3)
    x = model.example_inputs(2, dtype=torch.float64)[0]
    tokens = (model.patch_embed(x) + model.pos_embed).detach()
    y1, y2 = model.stack(tokens, tokens)
    kept = (y1.detach().clone(), y2.detach().clone())
    loss = (y1 * 1.5).sum() + (y2 * y2).sum()
    loss.backward(retain_graph=True)
    assert torch.equal(y1, kept[0]) and torch.equal(y2, kept[1])  # the caller's outputs
    with pytest.raises(RuntimeError, match="chunked ReversibleStack a second time"):
        loss.backward()
    # An output changed in place before backward is refused, not silently used.
    y1, y2 = model.stack(tokens, tokens)
    loss = (y1 * 1.5).sum() + y2.sum()
    with torch.no_grad():
        y2.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_bf16_autocast_is_replayed_in_chunks():
    model = _model("vit").float()
    x = model.example_inputs(2, dtype=torch.float32)
    errors = {}
    for count in (None, 3):
        pareprop.set_chunking(model, chunks=count)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            errors[count] = worst_error(engine_errors(model, x, engines=ENGINES))[2]
    # bf16 rounding of head and token slices differs a little; a missed autocast replay
    # (float32 recomputation of a bf16 forward) or a wrong mask is far off.
    assert errors[3] < max(2 * errors[None], 2e-2), errors


@pytest.mark.parametrize("count", [None, 3])
def test_autocast_is_replayed_in_chunks_with_backward_outside_autocast(count):
    # The usual pattern: forward under autocast, backward after it. Recomputation must run
    # under the forward's autocast (NOTE [ Autocast in recomputation ]): then a rebuilt input
    # is the forward's up to float32 rounding (the streams are float32, the branch outputs
    # the very same bf16 values), and PaReprop's gradients, rebuilt apart from its recover,
    # equal Reprop's. A float32 recomputation of the bf16 forward misses both by ~1e-3; the
    # test above, backward inside autocast and a 2e-2 floor, cannot see it.
    model = _model("vit").float()
    pareprop.set_chunking(model, chunks=count)
    x = model.example_inputs(BATCH, dtype=torch.float32)[0]
    grads = {}
    for engine in ENGINES:
        pareprop.set_engine(model, engine)
        pareprop.debug_reconstruction(model, tolerance=1.0)  # record the errors, no warning
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng():
            torch.manual_seed(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().sum().backward()  # outside autocast
        errors = [e for pair in model.stack.last_reconstruction_errors for e in pair]
        assert len(errors) == 2 * len(model.stack.blocks) and max(errors) < 1e-5, errors
        grads[engine] = {n: p.grad for n, p in model.named_parameters()}
    worst = max(relative_error(grads["pareprop"][n], g) for n, g in grads["reversible"].items())
    assert worst < 1e-5, worst


def test_bad_chunking_is_refused_clearly():
    model = _model("vit")
    with pytest.raises(ValueError, match="chunk count >= 1"):
        pareprop.set_chunking(model, chunks=0)
    with pytest.raises(ValueError, match="exactly one"):
        pareprop.set_chunking(model, chunks=2, max_bytes=1000)
    with pytest.raises(ValueError, match="256MiB"):
        pareprop.set_chunking(model, max_bytes="12 parsecs")
    assert model.stack.chunking is None
    assert "chunks=3" in repr(pareprop.set_chunking(model, chunks=3).stack)


BAD_SIZE = "expected a memory size such as 80GiB, 80GB, 256MiB or 8e10 (bytes), got 'lots'"


def _count_parses(monkeypatch):
    """Every chunk size parsed (parse_chunking reaches parse_bytes through its module)."""
    calls = []
    real = chunk_cost.parse_bytes
    monkeypatch.setattr(chunk_cost, "parse_bytes", lambda text: calls.append(text) or real(text))
    return calls


def test_a_chunk_size_is_parsed_once_where_it_enters(monkeypatch, tmp_path, capsys):
    # NOTE [ Chunk sizes are parsed at the edge ]: one parse per entry point, the inner layers
    # take the Chunking (and refuse anything else), and a bad size is refused in one line.
    from pareprop.cli import main
    from pareprop.cli.train import resolve_config
    from pareprop.engine import apply_chunking
    from pareprop.memory import plan as memory_plan
    from pareprop.memory.sweep import plan_sweep

    model = _model("mvit")  # two stacks: the size was parsed once per stack, and once more
    calls = _count_parses(monkeypatch)
    pareprop.set_chunking(model, max_bytes="1MiB")
    assert calls == ["1MiB"]
    assert {s.chunking for _, s in pareprop.engine.stacks_of(model)} == {
        chunk_cost.Chunking(max_bytes=2**20)}
    with pytest.raises(TypeError, match="expected a Chunking or None"):
        apply_chunking(model, "1MiB")
    with pytest.raises(ValueError, match=re.escape(BAD_SIZE)):
        pareprop.set_chunking(model, max_bytes="lots")

    # the trainer's config: parsed once, saved as given
    cfg = resolve_config(["--chunk-bytes", "16KiB"])
    assert (cfg.chunking, cfg.chunk_bytes) == (chunk_cost.Chunking(max_bytes=16 * 2**10), "16KiB")
    assert "chunking" not in __import__("dataclasses").asdict(cfg)
    with pytest.raises(ValueError, match=re.escape(BAD_SIZE)):
        resolve_config(["--chunk-bytes", "lots"])

    # the planner: plan_sweep parses once; every traced model gets the Chunking
    seen = []
    monkeypatch.setattr(memory_plan, "apply_chunking",
                        lambda m, c: seen.append(c) or apply_chunking(m, c))
    calls.clear()
    torch.set_default_dtype(torch.float32)  # planned as trained (the fixture puts it back)
    plan_sweep(["rev_vit_tiny_patch4_32"], ["reversible"], [2, 3], device="cpu", depth=2,
               chunk_bytes="1MiB")
    assert calls == ["1MiB"] and seen == [chunk_cost.Chunking(max_bytes=2**20)] * 2
    for argv in (["plan", "--models", "rev_vit_tiny_patch4_32", "--device", "cpu",
                  "--batch-sizes", "2", "--out", str(tmp_path)],
                 ["train", "--out", str(tmp_path / "run"), "--max-steps", "1"]):
        capsys.readouterr()
        assert main([*argv, "--chunk-bytes", "lots"]) == 2
        assert capsys.readouterr().err == f"pareprop {argv[0]}: error: {BAD_SIZE}\n"


@pytest.mark.parametrize("count", [1, 3])
def test_skip_scale_with_chunks(count):
    # NOTE [ Skip scale of the coupling ]: the chunked paths divide and multiply by beta in place
    model = _model("vit")
    for block in model.stack.blocks:
        block.set_skip_scale(0.5)
    pareprop.set_chunking(model, chunks=count)
    report = engine_errors(model, model.example_inputs(4, dtype=torch.float64), engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"chunks={count}: {engine} {key} relative error {err:.3e}"


# -- Checkpointed blocks in chunks (NOTE [ Checkpointed blocks in chunks ]) ------------------

# Rev-MViTv2's transitions (drop-path on) split over samples; Rev-Swin's merging over samples
# and its fusion over the 15 rows of an odd 30 px map. Batch 8: 7 chunks leave an uneven one.
CHECKPOINTED = {"mvit": "rev_mvitv2_tiny_32", "swin": "rev_swin_tiny_32",
                "rev_mvit": "rev_mvit_base", "video": "rev_mvit_base_16x4"}


def _spy_checkpoint_chunks(monkeypatch):
    """Record (block class, split size, count) of every block checkpointed in chunks."""
    seen = []
    real = recompute._checkpoint_chunks

    def spy(module, parts, join, split, count):
        seen.append((type(module).__name__, split.size, count))
        return real(module, parts, join, split, count)

    monkeypatch.setattr(recompute, "_checkpoint_chunks", spy)
    return seen


def _checkpointed_errors(name, engine, count, max_bytes=None):
    """Relative errors of a checkpointed, chunked model against plain autograd (float64)."""
    want = gc_tests._step(gc_tests._model(name, engine="autograd"), _x(name))
    model = gc_tests._model(name, engine=engine)
    model.set_grad_checkpointing()
    pareprop.set_chunking(model, chunks=count, max_bytes=max_bytes)
    got = gc_tests._step(model, _x(name))
    bad = gc_tests._gradient_errors(got[2], want[2])
    for key, a, b in (("output", got[0], want[0]), ("input", got[1], want[1])):
        if not relative_error(a, b) < TOL:
            bad[key] = relative_error(a, b)
    return bad


def _x(name):
    torch.manual_seed(3)
    return gc_tests._model(name).example_inputs(BATCH, dtype=torch.float64)[0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("family", list(CHECKPOINTED))
@pytest.mark.parametrize("count", COUNTS)
def test_checkpointed_blocks_in_chunks_equal_plain_autograd(family, count, engine, monkeypatch):
    seen = _spy_checkpoint_chunks(monkeypatch)
    bad = _checkpointed_errors(CHECKPOINTED[family], engine, count)
    assert not bad, f"{family} chunks={count} {engine}: {bad}"
    if count == 1:
        assert seen == []
        return
    blocks = {"mvit": {"MViTTransitionBlock"}, "swin": {"PatchMerging", "StreamFusion"},
              "rev_mvit": {"RevMViTv1Transition"}, "video": {"RevMViTVideoTransition"}}[family]
    assert {cls for cls, _, _ in seen} == blocks
    assert all(c == min(count, size) for _, size, c in seen)
    if count == 7:
        assert any(size % c for _, size, c in seen)  # an uneven last chunk


def test_checkpointed_chunks_draw_the_whole_blocks_drop_path():
    # The test above can fail: a chunk that drew its own masks (no generator state put back
    # before it) changes the transitions' drop-path, so output and gradients differ.
    name = CHECKPOINTED["mvit"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, "_set_rng_state", lambda state, device: None)
        bad = _checkpointed_errors(name, "reversible", 3)
    assert bad.get("output", 0) > 1e-3, bad


@pytest.mark.parametrize("engine", ENGINES)
def test_checkpointed_blocks_chunked_by_bytes(engine, monkeypatch):
    seen = _spy_checkpoint_chunks(monkeypatch)
    bad = _checkpointed_errors(CHECKPOINTED["mvit"], engine, None, max_bytes=10**12)
    assert not bad and seen == []  # everything fits: whole blocks
    bad = _checkpointed_errors(CHECKPOINTED["mvit"], engine, None, max_bytes="8KiB")
    assert not bad, bad
    assert seen and all(count > 1 for _, _, count in seen)


def test_blocks_without_a_split_are_checkpointed_whole_under_chunking(monkeypatch):
    # A checkpointed module that declares no split is checkpointed whole, still exact.
    seen = _spy_checkpoint_chunks(monkeypatch)
    torch.manual_seed(3)
    layer = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.GELU())
    x = torch.randn(8, 5, DIM, requires_grad=True)
    out = recompute.maybe_checkpoint(layer, x, True, chunk_cost.Chunking(count=3))
    want = torch.autograd.grad(layer(x).square().sum(), [x, *layer.parameters()])
    got = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    assert all(relative_error(a, b) < TOL for a, b in zip(got, want))
    assert seen == []
