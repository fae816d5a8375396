"""Reversible text encoder: engines against autograd (float64), padding, inputs, baseline."""

from __future__ import annotations

import dataclasses
import json

import pytest
import timm
import torch

import pareprop
from pareprop.engine.testing import engine_errors
from pareprop.models.text import TEXT_VARIANTS, TextConfig

TOL = 1e-8
VOCAB = 50


def _tiny(name="rev_roberta_small", **overrides):
    cfg = dict(
        vocab_size=VOCAB,
        max_position_embeddings=16,
        example_seq_len=12,
        embed_dim=16,
        depth=3,
        num_heads=2,
        mlp_dim=32,
        num_classes=3,
        drop_rate=0.1,
        attn_drop_rate=0.1,
        drop_path_rate=0.2 if name.startswith("rev_") else 0.0,
    )
    cfg.update(overrides)
    return pareprop.create_model(name, **cfg).double()


def _batch(B=3, L=12, seed=0):
    """Ids and a mask with right padding in rows 1 and 2 and left padding in row 2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, L - 4 :] = 0
    mask[2, :3] = 0
    mask[2, L - 2 :] = 0
    return ids.masked_fill(mask == 0, 1), mask


def _assert_small(report):
    for engine, errors in report.items():
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_engines_match_autograd_from_ids(depth):
    torch.manual_seed(0)
    model = _tiny(depth=depth)
    report = engine_errors(model, _batch())
    n_params = len(list(model.parameters()))
    assert all(sum(k.startswith("param:") for k in e) == n_params for e in report.values())
    _assert_small(report)


@pytest.mark.parametrize("depth", [2, 3])
def test_engines_match_autograd_from_embeddings(depth):
    torch.manual_seed(0)
    model = _tiny(depth=depth)
    ids, mask = _batch()
    embeds = torch.randn(*ids.shape, 16, dtype=torch.float64)
    report = engine_errors(model, (None, mask, embeds))
    assert all("input:0" in e for e in report.values())  # the embeddings' gradient
    _assert_small(report)


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = _tiny(depth=2)
    model.train()
    model(*_batch()).square().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not missing


@pytest.mark.parametrize("name", ["rev_roberta_small", "text_encoder_small"])
def test_padding_does_not_change_real_tokens(name):
    torch.manual_seed(0)
    model = _tiny(name, depth=2).eval()
    ids, mask = _batch()
    with torch.no_grad():
        feats = model.forward_features(ids, mask)
        logits = model(ids, mask)
        # Other ids under the padding: real tokens must not see them.
        noisy = torch.where(mask.bool(), ids, torch.randint(2, VOCAB, ids.shape))
        assert torch.allclose(model.forward_features(noisy, mask)[mask.bool()], feats[mask.bool()])
        # Each sequence alone, without padding, gives the same features and logits.
        for b in range(ids.shape[0]):
            real = ids[b][mask[b].bool()][None]
            alone = model.forward_features(real, torch.ones_like(real))
            assert torch.allclose(alone[0], feats[b][mask[b].bool()], rtol=0, atol=1e-10)
            assert torch.allclose(model(real), logits[b : b + 1], rtol=0, atol=1e-10)


def test_padding_does_not_change_gradients_of_real_tokens():
    torch.manual_seed(0)
    model = _tiny(depth=2, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)
    model.train()
    ids, mask = _batch()
    embeds = torch.randn(*ids.shape, 16, dtype=torch.float64, requires_grad=True)
    model(inputs_embeds=embeds, attention_mask=mask)[1].sum().backward()
    real = mask[1].bool()
    alone = embeds.detach()[1:2, real].clone().requires_grad_(True)
    model.zero_grad()
    model(inputs_embeds=alone)[0].sum().backward()
    assert torch.allclose(alone.grad[0], embeds.grad[1, real], rtol=0, atol=1e-10)
    assert not embeds.grad[1, ~real].any()  # padded positions feed nothing forward


def test_checkpointed_baseline_matches_plain():
    torch.manual_seed(0)
    model = _tiny("text_encoder_small", depth=3)
    model.train()
    ids, mask = _batch()
    grads = []
    for enable in (False, True):
        model.set_grad_checkpointing(enable)
        model.zero_grad()
        with torch.random.fork_rng():
            torch.manual_seed(1)
            out = model(ids, mask)
            out.square().sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=0, atol=1e-12)
    for n, g in grads[0][1].items():
        assert torch.allclose(g, grads[1][1][n], rtol=0, atol=1e-12), n


def test_baseline_matches_reversible_sizes():
    for size in ("base", "small"):
        rev, base = TEXT_VARIANTS[f"rev_roberta_{size}"], TEXT_VARIANTS[f"text_encoder_{size}"]
        fields = ("vocab_size", "embed_dim", "depth", "num_heads", "mlp_dim")
        assert [getattr(rev, f) for f in fields] == [getattr(base, f) for f in fields]
        assert rev.reversible and not base.reversible
    base = TEXT_VARIANTS["rev_roberta_base"]
    assert (base.vocab_size, base.embed_dim, base.depth, base.num_heads) == (50265, 768, 12, 12)
    assert (base.mlp_dim, base.max_position_embeddings) == (3072, 514)


def test_baseline_engine_and_drop_path():
    model = _tiny("text_encoder_small", depth=1)
    model.set_engine("autograd")
    with pytest.raises(ValueError, match="autograd"):
        model.set_engine("reversible")
    with pytest.raises(ValueError, match="drop-path"):
        _tiny("text_encoder_small", drop_path_rate=0.1)


def test_model_interface():
    model = _tiny()
    ids, mask = model.example_inputs(4)
    assert ids.dtype == torch.int64 and ids.shape == (4, 12) and mask.shape == (4, 12)
    assert (mask == 0).any() and mask.all(dim=1).any()  # some rows padded, some not
    assert (ids[mask == 0] == model.cfg.pad_token_id).all()
    model.set_grad_checkpointing()  # accepted; nothing outside the stack to checkpoint
    assert model.grad_checkpointing
    model.set_engine("pareprop")
    assert model.blocks.engine == "pareprop"
    model.reset_classifier(7)
    feats = model.forward_features(ids, mask)
    assert feats.shape == (4, 12, model.num_features) and model.num_features == 32
    assert model.forward_head(feats, attention_mask=mask).shape == (4, 7)
    assert model.forward_head(feats, pre_logits=True).shape == (4, 32)
    assert model.no_weight_decay() <= {n for n, _ in model.named_parameters()}
    first = _tiny(global_pool="first").eval()
    with torch.no_grad():
        f = first.forward_features(ids, mask)
        assert torch.allclose(first.forward_head(f, pre_logits=True), f[:, 0])


def test_config_round_trip_and_not_in_timm():
    # Text encoders live in pareprop's registry only; timm's is for image models.
    assert not timm.is_model("rev_roberta_small") and not timm.list_models("*roberta*")
    model = pareprop.create_model("rev_roberta_small", num_classes=4, depth=1, vocab_size=VOCAB)
    assert model.num_classes == 4 and model.head.out_features == 4
    data = json.loads(json.dumps(dataclasses.asdict(model.cfg)))
    assert TextConfig(**data) == model.cfg


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.ones(2, 5)), "dtype torch.int64"),
        (dict(input_ids=torch.ones(5, dtype=torch.long)), "shape \\(B, L\\)"),
        (dict(input_ids=torch.full((2, 5), VOCAB)), f"\\[0, {VOCAB}\\)"),
        (dict(input_ids=torch.full((2, 5), -1)), f"\\[0, {VOCAB}\\)"),
        (dict(input_ids=torch.ones(2, 17, dtype=torch.long)), "at most 16 tokens"),
        (
            dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)),
            "shape \\(2, 5\\)",
        ),
        (
            dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5)),
            "integer or bool",
        ),
        (
            dict(
                input_ids=torch.ones(2, 5, dtype=torch.long),
                attention_mask=torch.full((2, 5), 2),
            ),
            "values 0",
        ),
        (
            dict(
                input_ids=torch.ones(2, 5, dtype=torch.long),
                attention_mask=torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]),
            ),
            "at least one real token",
        ),
        (dict(), "exactly one"),
        (
            dict(
                input_ids=torch.ones(2, 5, dtype=torch.long),
                inputs_embeds=torch.zeros(2, 5, 16, dtype=torch.float64),
            ),
            "exactly one",
        ),
        (dict(inputs_embeds=torch.zeros(2, 5, 8, dtype=torch.float64)), "\\(B, L, 16\\)"),
    ],
)
def test_bad_input(kwargs, match):
    model = _tiny(depth=1)
    with pytest.raises(ValueError, match=match):
        model(**kwargs)


def test_bad_config():
    with pytest.raises(ValueError, match="valid fields"):
        pareprop.create_model("rev_roberta_small", hidden_size=8)
    with pytest.raises(ValueError, match="divisible"):
        pareprop.create_model("rev_roberta_small", embed_dim=10, num_heads=4)
    with pytest.raises(ValueError, match="autograd"):
        pareprop.create_model("text_encoder_small", engine="reversible")
