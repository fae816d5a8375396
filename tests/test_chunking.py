"""Chunked branches (pareprop.set_chunking): every family under every reversible engine equals
plain autograd in float64 with chunk counts 1, 2, 3 and 7, dropout and drop-path on; chunked
dropout draws exactly the whole branch's masks; the top block's outputs are left alone."""

import pytest
import torch
import torch.nn.functional as F

import pareprop
from pareprop import chunking
from pareprop import engine as engine_module
from pareprop.testing import engine_errors, relative_error, worst_error
from test_engine import DIM, TOL, Model, float64  # noqa: F401 - autouse fixture

ENGINES = ("reversible", "pareprop")
COUNTS = (1, 2, 3, 7)


def _tiny_models():
    """One model of each family with enough heads and tokens for 7 uneven chunks, dropout and
    drop-path on."""
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
    return {"vit": vit, "mvit": mvit, "swin": swin, "text": text}


def _model(family):
    torch.manual_seed(0)
    model = _tiny_models()[family].double()
    if family == "mvit":  # the key norm's bias has an exact zero gradient (see test_mvit.py)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.endswith("norm_k.bias"))
    return model


def _spy_chunks(monkeypatch):
    """Record (size, count) of every chunked branch the engine runs."""
    seen = []
    real = engine_module.chunks

    def spy(size, count):
        seen.append((size, count))
        return real(size, count)

    monkeypatch.setattr(engine_module, "chunks", spy)
    return seen


def test_chunks_cover_every_unit_the_first_ones_longer():
    assert [(c.start, c.stop) for c in chunking.chunks(10, 3)] == [(0, 4), (4, 7), (7, 10)]
    assert [c.length for c in chunking.chunks(3, 7)] == [1, 1, 1]  # at most one per unit
    assert [c.first for c in chunking.chunks(5, 2)] == [True, False]


@pytest.mark.parametrize("count", [2, 3, 7])
@pytest.mark.parametrize("dim", [1, 2])
def test_chunked_dropout_draws_the_whole_mask(count, dim):
    x = torch.randn(3, 9, 10)
    torch.manual_seed(5)
    whole = F.dropout(x, 0.4)
    after_whole = torch.get_rng_state()
    parts = []
    for chunk in chunking.chunks(x.shape[dim], count):
        torch.manual_seed(5)  # the engine restores the branch's state before every chunk
        parts.append(chunking.dropout(chunk.take(x, dim), 0.4, True, chunk, dim))
        # the generator moved exactly as the whole draw moved it: later draws agree too
        assert torch.equal(torch.get_rng_state(), after_whole)
    assert torch.equal(torch.cat(parts, dim), whole)
    # A chunk that drew only its own part would not match: the test can fail.
    torch.manual_seed(5)
    naive = F.dropout(chunking.chunks(x.shape[dim], count)[-1].take(x, dim), 0.4)
    assert not torch.equal(naive, chunking.chunks(x.shape[dim], count)[-1].take(whole, dim))


@pytest.mark.parametrize("family", ["vit", "mvit", "swin", "text"])
@pytest.mark.parametrize("count", COUNTS)
def test_every_family_and_engine_equals_autograd_with_chunks(family, count, monkeypatch):
    model = _model(family)
    pareprop.set_chunking(model, chunks=count)
    seen = _spy_chunks(monkeypatch)
    report = engine_errors(model, model.example_inputs(2, dtype=torch.float64), engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"{family} chunks={count}: {engine} {key} relative error {err:.3e}"
    if count == 1:  # whole branches through the chunked (in-place) schedule
        assert seen == []
    else:  # both kinds of split ran, and some with the uneven last chunk
        assert seen and all(c == min(count, size) for size, c in seen)
        if count == 7:
            assert any(size % c for size, c in seen)


def test_stored_blocks_with_chunks():
    model = _model("vit")
    model.stack.store_blocks([1])
    pareprop.set_chunking(model, chunks=3)
    report = engine_errors(model, model.example_inputs(2, dtype=torch.float64), engines=ENGINES)
    engine, key, err = worst_error(report)
    assert err < TOL, f"{engine} {key} relative error {err:.3e}"


def test_block_without_a_split_runs_whole_under_chunking():
    model = Model(3)
    pareprop.set_chunking(model, chunks=4)
    report = engine_errors(model, torch.randn(2, 5, DIM), engines=ENGINES, scale=torch.tensor(0.5))
    engine, key, err = worst_error(report)
    assert err < TOL, f"{engine} {key} relative error {err:.3e}"


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


def test_top_block_leaves_the_outputs_alone_and_a_second_backward_agrees():
    model = _model("vit")
    pareprop.set_engine(model, "reversible")
    pareprop.set_chunking(model, chunks=3)
    x = model.example_inputs(2, dtype=torch.float64)[0]
    tokens = model.patch_embed(x) + model.pos_embed
    torch.manual_seed(0)
    y1, y2 = model.stack(tokens, tokens)
    kept = (y1.detach().clone(), y2.detach().clone())
    loss = (y1 * 1.5).sum() + (y2 * y2).sum()
    first = torch.autograd.grad(loss, list(model.stack.parameters()), retain_graph=True)
    assert torch.equal(y1, kept[0]) and torch.equal(y2, kept[1])
    second = torch.autograd.grad(loss, list(model.stack.parameters()))
    assert max(relative_error(a, b) for a, b in zip(first, second)) == 0.0


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
