"""FSDP2 per block (pareprop.distributed.shard) on the CPU: 2 gloo processes, float64. For every
engine and one model of each family, a sharded step on half batches equals one process on the whole
batch: full gradients gathered from the shards, weights after an SGD step, with gradient
accumulation, with one stored block and with the non-reversible blocks checkpointed (the video
model's transitions too); each rank holds about half of the bytes."""

import warnings

import pytest
import torch
import torch.distributed as tdist

import pareprop
from _two_processes import on_two_processes
from pareprop.distributed import fsdp
from pareprop.engine import ENGINES

pytestmark = [  # slow: spawned process pairs (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(
        not (tdist.is_available() and fsdp.fsdp_available()), reason="no FSDP2 in this torch"
    ),
]

BATCH, LR = 8, 0.5
# One tiny model of each family, without dropout (each process draws its own masks).
FAMILIES = {
    "vit": ("rev_vit_tiny_patch4_32", dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16,
                                           depth=3, num_heads=2, num_classes=5)),
    "mvit": ("rev_mvitv2_tiny_32", dict(img_size=16, embed_dim=8, num_classes=5,
                                        last_block_indexes=(0, 3))),
    "swin": ("rev_swin_tiny_32", dict(embed_dim=8, depths=(2, 3), num_heads=(1, 2), window=4,
                                      patch_size=2, img_size=16, num_classes=5)),
    "rev_mvit": ("rev_mvit_base", dict(img_size=32, embed_dim=8, depth=5, num_classes=5,
                                       transition_blocks=(2,))),
    "video": ("rev_mvit_base_16x4", dict(num_frames=4, img_size=32, embed_dim=8, depth=5,
                                         transition_blocks=(2,), kv_stride=(1, 4, 4),
                                         num_classes=5, drop_rate=0.0)),
    "text": ("rev_roberta_small", dict(vocab_size=20, max_position_embeddings=16,
                                       example_seq_len=8, embed_dim=16, depth=3, num_heads=2,
                                       mlp_dim=32, num_classes=3, drop_rate=0.0,
                                       attn_drop_rate=0.0)),
}


def _model(family, engine):
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    model = pareprop.create_model(name, engine=engine, drop_path_rate=0.0, **kwargs)
    model = model.double().train()
    # The key norm's bias has an exact zero gradient (see test_mvit.py).
    if family in ("mvit", "rev_mvit", "video"):
        for n, p in model.named_parameters():
            p.requires_grad_(not n.endswith("norm_k.bias"))
    return model


def _batch(family):
    model = _model(family, "autograd")
    torch.manual_seed(1)
    inputs = model.example_inputs(BATCH, dtype=torch.float64)
    y = torch.randint(0, model.num_classes, (BATCH,))
    return inputs, y


def _half(inputs, y, rank, world):
    return tuple(t[rank::world] for t in inputs), y[rank::world]


def _micro(inputs, y):
    half = len(y) // 2
    return [(tuple(t[:half] for t in inputs), y[:half]),
            (tuple(t[half:] for t in inputs), y[half:])]


def _identity(t):
    return t


def _grads_and_step(model, batches, full=_identity):
    """Loss-mean gradients over ``batches`` (micro-batches of one step), then one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, (x, y) in enumerate(batches):
        if full is not _identity:  # FSDP2's no_sync: reduce on the last micro-batch only
            model.set_requires_gradient_sync(i == len(batches) - 1)
        loss = torch.nn.functional.cross_entropy(model(*x), y) / len(batches)
        loss.backward()
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()
             if p.requires_grad}
    opt.step()
    weights = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return grads, weights


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_bytes(model):
    return sum(_full_local(p).numel() * p.element_size() for p in model.parameters())


def _full_local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _cases():
    for family in FAMILIES:
        for engine in ENGINES:
            yield family, engine, "plain"
        yield family, "reversible", "accum"
        yield family, "pareprop", "stored"
        yield family, "pareprop", "late_reduce"
        yield family, "reversible", "chunked"
        yield family, "pareprop", "chunked"
        if family in ("mvit", "swin", "video"):  # non-reversible blocks checkpointed
            yield family, "pareprop", "grad_ckpt"


def _on_rank(rank, world):
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _run_cases(results, rank, world)
    # FSDP2 warns once per unit that returns a view (its pre-backward hook sits on it).
    results["view_warnings"] = sorted({str(w.message).split(")")[0] for w in caught
                                       if "returned a view tensor" in str(w.message)})
    for family in FAMILIES:
        results[(family, "bytes")] = _bytes_per_rank(family, rank, world)
    results["refused"] = _manual_block_wrapper_refused()
    return results


def _run_cases(results, rank, world):
    for family, engine, variant in _cases():
        inputs, y = _batch(family)
        xs, ys = _half(inputs, y, rank, world)  # this process's half of the batch
        model = _model(family, engine)
        if variant == "stored":
            for stack in model.modules():
                if isinstance(stack, pareprop.ReversibleStack):
                    stack.store_blocks([len(stack.blocks) // 2])
        if variant == "grad_ckpt":
            model.set_grad_checkpointing()
        if variant == "chunked":
            pareprop.set_chunking(model, chunks=2)
        full_bytes = _local_bytes(model)
        fsdp.shard(model)
        micro = _micro(xs, ys) if variant == "accum" else [(xs, ys)]
        fsdp.ENABLE_EARLY_REDUCE = variant != "late_reduce"
        try:
            # FSDP averages over processes; the loss is a mean over each half already.
            grads, weights = _grads_and_step(model, micro, _full)
        finally:
            fsdp.ENABLE_EARLY_REDUCE = True
        results[(family, engine, variant)] = (grads, weights,
                                              _local_bytes(model) / full_bytes)


def _bytes_per_rank(family, rank, world):
    """This rank's share of parameter, gradient and Adam-state bytes after one step."""
    model = _model(family, "pareprop")
    full_params = sum(p.numel() for p in model.parameters())
    fsdp.shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, y = _batch(family)
    xs, ys = _half(inputs, y, rank, world)
    torch.nn.functional.cross_entropy(model(*xs), ys).backward()
    opt.step()
    params = sum(_full_local(p).numel() for p in model.parameters())
    grads = sum(_full_local(p.grad).numel() for p in model.parameters() if p.grad is not None)
    full_grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = sum(_full_local(t).numel() for st in opt.state.values() for k, t in st.items()
                if k != "step")
    return params / full_params, grads / full_grads, state / (2 * full_grads)


def _manual_block_wrapper_refused():
    """fully_shard on a block by hand (not through shard) is still refused."""
    from torch.distributed.fsdp import fully_shard

    from pareprop.distributed import check_wrapping

    model = _model("vit", "reversible")
    fully_shard(model.stack.blocks[0])
    try:
        check_wrapping(model)
    except ValueError as e:
        return "bypassing the wrapper" in str(e)
    return False


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return on_two_processes(_on_rank, tmp_path_factory.mktemp("fsdp"), weights_only=False)


def _reference(family, variant):
    inputs, y = _batch(family)
    model = _model(family, "autograd")
    return _grads_and_step(model, [(inputs, y)])


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: "-".join(c))
def test_sharded_step_matches_one_process(fsdp_results, case):
    family, engine, variant = case
    ref_grads, ref_weights = _reference(family, variant)
    for rank in range(2):
        grads, weights, _ = fsdp_results[rank][case]
        assert set(grads) == set(ref_grads)
        for name in ref_grads:
            assert _rel(grads[name], ref_grads[name]) < 1e-10, (rank, name)
            assert _rel(weights[name], ref_weights[name]) < 1e-10, (rank, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_holds_half_the_bytes(fsdp_results, family):
    for rank in range(2):
        ratio = fsdp_results[rank][(family, "pareprop", "plain")][2]
        assert 0.4 < ratio < 0.6, ratio
        params, grads, adam = fsdp_results[rank][(family, "bytes")]
        for what, share in (("params", params), ("grads", grads), ("adam", adam)):
            assert 0.4 < share < 0.6, (what, share)
    totals = [sum(fsdp_results[r][(family, "bytes")][i] for r in range(2)) for i in range(3)]
    assert all(abs(t - 1) < 1e-9 for t in totals), totals  # the shards partition the model


def test_the_patch_embedding_returns_no_view(fsdp_results):
    # NOTE [ Patch tokens are not a view ] in pareprop/layers/patch_embed.py: every family's
    # patch embedding (FSDPPatchEmbed) was warned about. Still warned (2026-12-05): Swin's
    # StreamFusion and the Rev-MViT transitions, whose last Linear on a (B, H, W, C) map
    # returns a view of its 2-D product; a copy there would cost a map per stage.
    for results in fsdp_results:
        assert results["view_warnings"], ("none recorded: the record is broken, or the units "
                                          "above were fixed (then drop this line)")
        assert not [w for w in results["view_warnings"] if "PatchEmbed" in w]


def test_hand_made_fsdp_block_is_still_refused(fsdp_results):
    assert fsdp_results[0]["refused"] and fsdp_results[1]["refused"]


def test_clear_error_without_fully_shard(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_fsdp2(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "torch.distributed.fsdp" and fromlist and "fully_shard" in fromlist:
            raise ImportError("cannot import name 'fully_shard'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_fsdp2)
    assert not fsdp.fsdp_available()
    with pytest.raises(RuntimeError, match=r"PyTorch >= 2.6.*torch " + torch.__version__[:4]):
        fsdp.shard(torch.nn.Linear(2, 2))
