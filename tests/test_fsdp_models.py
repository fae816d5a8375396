"""FSDP2 (pareprop.distributed.shard) on every registered model's default configuration, at small
widths: 2 gloo processes, float64. A sharded step on half batches equals one process on the
whole batch (gradients gathered from the shards, weights after an SGD step), and after it the
root's forward_features / forward_head / forward_intermediates called directly give one
process's outputs. The MViT layouts hold stages without reversible blocks, which the models
call through ``stage.forward_ends`` (issue 39); checkpointed transitions in chunks run through
``forward_chunk``. Both are methods other than ``forward`` on an FSDP unit (NOTE [ FSDP units
called through other methods ] in pareprop/distributed/fsdp.py)."""

import os

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

import pareprop
from pareprop.distributed import fsdp
from pareprop.engine import ENGINES

pytestmark = [  # slow: one spawned process pair for all models (README, Development)
    pytest.mark.slow,
    pytest.mark.skipif(
        not (tdist.is_available() and fsdp.fsdp_available()), reason="no FSDP2 in this torch"
    ),
]

BATCH, LR = 4, 0.5
# Widths cut down; the layouts (depths, stage ends, transitions, windows) stay the defaults.
TEXT = dict(vocab_size=20, max_position_embeddings=16, example_seq_len=8, embed_dim=16,
            num_heads=2, mlp_dim=32, drop_rate=0.0, attn_drop_rate=0.0)


def _small(name):
    if name == "converted_vit":
        return dict(source="vit_tiny_patch16_224", img_size=16, patch_size=4, embed_dim=16,
                    num_heads=2, tolerance=None)
    if name.startswith("rev_vit"):
        return dict(img_size=16, patch_size=4, embed_dim=16, num_heads=2)
    if name.startswith(("rev_mvitv2", "rev_mvit_base")):
        video = dict(num_frames=4, drop_rate=0.0) if name == "rev_mvit_base_16x4" else {}
        return dict(img_size=32, embed_dim=8, **video)
    if name.startswith("rev_swin"):
        return dict(img_size=32, embed_dim=8, num_heads=(1, 1, 1, 1))
    return TEXT


# pareprop's own registered models (other test modules register toy ones at import). The
# converted timm/torchvision families other than ViT have their own two-process DDP and FSDP2
# tests (test_convert_swin_distributed.py, test_convert_mvit_distributed.py), at sizes their
# sources take.
_OWN_FAMILIES = ("rev_", "converted_vit")
MODELS = [n for n in pareprop.list_models() if n.startswith(_OWN_FAMILIES)]
# Checkpointed transitions in chunks (forward_chunk on a unit), one model of each MViT kind.
CHUNKED = ("rev_mvitv2_tiny_32", "rev_mvit_base", "rev_mvit_base_16x4")
# Without register_fsdp_forward_method: such modules stay in their parent's unit.
FALLBACK = "rev_mvitv2_tiny_32"


def _model(name):
    torch.manual_seed(0)
    model = pareprop.create_model(name, num_classes=5, drop_path_rate=0.0, **_small(name))
    model = model.double().train()
    # The key norm's bias has an exact zero gradient (see test_mvit.py).
    for n, p in model.named_parameters():
        p.requires_grad_(not n.endswith("norm_k.bias"))
    return model


def _batch(name):
    model = _model(name)
    torch.manual_seed(1)
    inputs = model.example_inputs(BATCH, dtype=torch.float64)
    return inputs, torch.randint(0, 5, (BATCH,))


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def _root_methods(model, inputs):
    """Outputs of the root's methods called directly, not through ``model(...)``."""
    out = {"head": _full(model.forward_head(model.forward_features(*inputs)))}
    if hasattr(model, "forward_intermediates"):
        final, features = model.forward_intermediates(inputs[0])
        out["intermediates"] = [_full(t) for t in (final, *features)]
    return out


def _step(model, inputs, y):
    """Gradients of one step, then the weights after it (SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.nn.functional.cross_entropy(model(*inputs), y).backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()
             if p.requires_grad}
    opt.step()
    return grads, {n: _full(p).detach().clone() for n, p in model.named_parameters()}


def _cases():
    for name in MODELS:
        yield name, "default"
    for engine in ENGINES:  # the layout of issue 39 under every engine
        yield FALLBACK, engine
    for name in CHUNKED:
        yield name, "chunked"
    yield FALLBACK, "fallback"


def _run(name, variant, rank, world):
    inputs, y = _batch(name)
    xs, ys = tuple(t[rank::world] for t in inputs), y[rank::world]
    model = _model(name)
    if variant in ENGINES:
        pareprop.set_engine(model, variant)
    if variant == "chunked":
        pareprop.set_engine(model, "pareprop")
        model.set_grad_checkpointing()
        pareprop.set_chunking(model, chunks=2)
    fsdp.shard(model)
    step = _step(model, xs, ys)
    # After the step: a failure here leaves the step's result standing.
    return step, _attempt(_root_methods, model, xs) if variant == "default" else None


def _attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # reported by the test of this case, not as a crash
        return f"{type(e).__name__}: {e}"


def _worker(rank, world, init_file, out):
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                             world_size=world)
    registrar = getattr(fsdp, "_forward_method_registrar", None)
    try:
        results = {}
        for name, variant in _cases():
            if variant == "fallback" and registrar is not None:
                fsdp._forward_method_registrar = lambda: None
            try:
                results[(name, variant)] = _attempt(_run, name, variant, rank, world)
            finally:
                if registrar is not None:
                    fsdp._forward_method_registrar = registrar
        results["graphs"] = _graphs_refusals(rank, world)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        tdist.destroy_process_group()


def _graphs_refusals(rank, world):
    """cuda_graphs=True on a sharded model, switched on after shard and before it: the
    messages of the refusals (None: not refused)."""
    messages = []
    for graphs_first in (False, True):
        model = _model("rev_vit_tiny_patch4_32")
        if graphs_first:
            pareprop.set_engine(model, "reversible", cuda_graphs=True)
        fsdp.shard(model)
        inputs, _ = _batch("rev_vit_tiny_patch4_32")
        try:
            if graphs_first:
                model(*(t[rank::world] for t in inputs))
            else:
                pareprop.set_engine(model, "reversible", cuda_graphs=True)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_models")
    mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _close(a, b):
    return ((a - b).norm() <= 1e-10 * b.norm() + 1e-14).item()


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: "-".join(c))
def test_sharded_step_matches_one_process(results, case):
    name, variant = case
    inputs, y = _batch(name)
    ref_grads, ref_weights = _step(_model(name), inputs, y)
    for rank in range(2):
        got = results[rank][case]
        assert not isinstance(got, str), got
        grads, weights = got[0]
        assert set(grads) == set(ref_grads)
        for n in ref_grads:
            assert _close(grads[n], ref_grads[n]), (rank, n)
            assert _close(weights[n], ref_weights[n]), (rank, n)


@pytest.mark.parametrize("name", MODELS)
def test_root_methods_called_directly_match_one_process(results, name):
    inputs, y = _batch(name)
    model = _model(name)
    _step(model, inputs, y)  # the sharded model's methods ran after its step
    for rank in range(2):
        got = results[rank][(name, "default")]
        assert not isinstance(got, str), got
        got = got[1]
        assert not isinstance(got, str), got
        ref = _root_methods(model, tuple(t[rank::2] for t in inputs))
        assert got.keys() == ref.keys()
        assert _close(got["head"], ref["head"])
        got_features, ref_features = got.get("intermediates", []), ref.get("intermediates", [])
        assert len(got_features) == len(ref_features)
        for a, b in zip(got_features, ref_features):
            assert _close(a, b)


def test_stage_without_blocks_is_its_own_unit():
    """The MViT default layout ends on a stage without reversible blocks: sharded as a unit
    (the case that failed), unless this torch cannot register its forward_ends."""
    model = _model("rev_mvitv2_tiny_32")
    last = model.stages[-1]
    assert last.stack is None
    assert last in fsdp._units(model)
    assert last not in fsdp._units(model, methods_gather=False)


def test_cuda_graphs_on_a_sharded_model_are_refused(results):
    # Its gathers and gradient reductions are collectives around each block, which a capture
    # would freeze (NOTE [ CUDA graphs of a stack ]).
    for rank in range(2):
        for message in results[rank]["graphs"]:
            assert message is not None and "cannot capture an FSDP2-sharded stack" in message
