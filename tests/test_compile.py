"""pareprop.compile_blocks: compiled F and G against eager, under every engine (CPU, float64).

Inductor compiles are slow on a small CPU, so the models are tiny and each compiled model is
built once per module (a fixture) and reused by every engine.
"""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import pareprop
from pareprop.engine.testing import one_step, relative_error

# slow: every test compiles with torch.compile (minutes in all; README, Development)
pytestmark = pytest.mark.slow

TOL = 1e-10
ENGINES = pareprop.ENGINES


def _vit():
    return pareprop.create_model(
        "rev_vit_tiny_patch4_32", img_size=8, embed_dim=16, depth=2, num_heads=2,
        num_classes=3, attn_drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.2,
    ), (torch.randn(2, 3, 8, 8),)


def _text():
    ids = torch.randint(2, 50, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return pareprop.create_model(
        "rev_roberta_small", vocab_size=50, max_position_embeddings=8, example_seq_len=8,
        embed_dim=16, depth=2, num_heads=2, mlp_dim=32, num_classes=3, drop_rate=0.1,
        attn_drop_rate=0.1, drop_path_rate=0.2,
    ), (ids, mask)


def _swin():
    return pareprop.create_model(
        "rev_swin_tiny_32", embed_dim=8, depths=(2, 2), num_heads=(1, 2), window=4,
        patch_size=2, img_size=16, num_classes=3, drop_path_rate=0.2, proj_drop_rate=0.1,
        attn_drop_rate=0.1,
    ), (torch.randn(2, 3, 16, 16),)


def _mvit():
    return pareprop.create_model(
        "rev_mvitv2_tiny_32", img_size=16, embed_dim=8, depth=4, num_classes=3,
        drop_path_rate=0.2,
    ), (torch.randn(2, 3, 16, 16),)


def _rev_mvit():
    return pareprop.create_model(
        "rev_mvit_base", img_size=32, embed_dim=8, depth=4, transition_blocks=(2,),
        num_classes=3, drop_path_rate=0.2,
    ), (torch.randn(2, 3, 32, 32),)


def _video():
    return pareprop.create_model(
        "rev_mvit_base_16x4", num_frames=4, img_size=32, embed_dim=8, depth=4,
        transition_blocks=(2,), kv_stride=(1, 4, 4), num_classes=3, drop_path_rate=0.2,
    ), (torch.randn(2, 3, 4, 32, 32),)


FAMILIES = {"vit": _vit, "text": _text, "swin": _swin, "mvit": _mvit, "rev_mvit": _rev_mvit,
            "video": _video}


@pytest.fixture(autouse=True)
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request):
    """(eager model, compiled copy, inputs), float64, same weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    eager, inputs = FAMILIES[request.param]()
    compiled = pareprop.compile_blocks(copy.deepcopy(eager))
    torch.set_default_dtype(previous)
    yield request.param, eager, compiled, inputs


def _errors(got, ref):
    errors = {"output": max(relative_error(a, b) for a, b in zip(got[0], ref[0]))}
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        errors[f"input:{i}"] = relative_error(a, b)
    for name, b in ref[2].items():
        if b is not None and b.norm() < 1e-12:
            # MViTv2's key-norm bias: softmax ignores a shift shared by all keys, so its exact
            # gradient is 0 and a relative error would compare rounding noise; absolute here
            errors[f"param:{name}"] = (got[2][name] - b).norm().item()
        else:
            errors[f"param:{name}"] = relative_error(got[2][name], b)
    return errors


def _step(model, inputs, engine, seed=0):
    model.train()
    out = one_step(model, inputs, engine, seed, None, {})
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_compiled_blocks_match_eager(pair, engine):
    family, eager, compiled, inputs = pair
    counters.clear()
    got = _step(compiled, inputs, engine)
    ref = _step(eager, inputs, "autograd")
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    errors = _errors(got, ref)
    assert len(errors) > 3
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, f"{family} {engine}: {bad}"
    # dropout is on: another seed must change the result, or the comparison proves nothing
    other = _step(eager, inputs, "autograd", seed=1)
    assert relative_error(other[0][0], ref[0][0]) > 1e-3


def test_every_block_is_compiled_and_can_be_undone(pair):
    _, eager, compiled, _ = pair
    names = pareprop.compiled_blocks(compiled)
    blocks = [n for n, m in compiled.named_modules() if isinstance(m, pareprop.ReversibleBlock)]
    assert names == blocks and names
    assert pareprop.compiled_blocks(eager) == []
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    undone = pareprop.uncompile_blocks(copy.deepcopy(compiled))
    assert pareprop.compiled_blocks(undone) == []


def test_global_rng_after_a_compiled_step_is_where_autograd_leaves_it(pair):
    _, eager, compiled, inputs = pair
    ends = []
    for model, engine in [(eager, "autograd"), (compiled, "reversible"), (compiled, "pareprop")]:
        with torch.random.fork_rng():
            _step(model, inputs, engine, seed=3)
            ends.append(torch.get_rng_state())
    assert all(torch.equal(ends[0], end) for end in ends[1:])


@pytest.mark.parametrize("engine", ["autograd", "reversible"])
def test_compiled_graphs_do_not_grow_with_depth(engine):
    # Regional compilation: blocks of one class and shape share one graph per branch and
    # grad mode, so a depth-4 stack compiles exactly as many graphs as a depth-2 one. Inductor
    # itself, since each torch.compile call makes its own backend (a per-block compile would
    # recompile per block and pass with a shared custom backend).
    counts = []
    for depth in (2, 5):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        # Drop-path on: every block gets its own rate, which must not be a guarded constant
        # (NOTE [ Drop-path rates as buffers ]; with timm's float rates this counted 8 vs 48).
        model = pareprop.create_model("rev_vit_tiny_patch4_32", img_size=8, embed_dim=16,
                                      depth=depth, num_heads=2, num_classes=3, engine=engine,
                                      drop_path_rate=0.2)
        pareprop.compile_blocks(model)
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        counts.append(counters["stats"]["unique_graphs"])
    assert counts[0] == counts[1] and counts[0] > 0, counts


def test_whole_model_torch_compile_breaks_only_at_the_stack():
    torch.manual_seed(0)
    eager, inputs = _vit()
    for engine in ENGINES:
        pareprop.set_engine(eager, engine)
        torch._dynamo.reset()
        model = torch.compile(copy.deepcopy(eager), options={"fallback_random": True})
        explanation = torch._dynamo.explain(model)(*inputs)
        if engine == "autograd":
            assert explanation.graph_break_count == 0, explanation.break_reasons
        else:
            # breaks only where the reversible path leaves the graph (torch.compiler.disable);
            # Dynamo counts that one place once per frame it resumes in (model, stack)
            assert explanation.graph_break_count >= 1
            for reason in explanation.break_reasons:
                assert "_forward_reversible" in str(reason.reason), reason.reason
        got = _step(model, inputs, engine)
        grads = {k.removeprefix("_orig_mod."): v for k, v in got[2].items()}
        ref = _step(eager, inputs, "autograd")
        bad = {k: v for k, v in _errors((got[0], got[1], grads), ref).items() if not v < TOL}
        assert not bad, f"{engine}: {bad}"


def test_branch_with_a_graph_break_is_refused_by_fullgraph():
    class Breaking(pareprop.ReversibleBlock):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def f(self, x):
            torch._dynamo.graph_break()
            return self.lin(x)

        def g(self, x):
            return self.lin(x)

    stack = pareprop.compile_blocks(pareprop.ReversibleStack([Breaking()]))
    x = torch.randn(2, 4)
    with pytest.raises(Exception, match="graph_break|graph break"):
        stack(x, x)


def test_compile_blocks_refuses_a_model_without_blocks():
    with pytest.raises(ValueError, match="no ReversibleBlock"):
        pareprop.compile_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        pareprop.compile_blocks("model")


def test_stored_blocks_under_compile_match_eager(pair):
    family, eager, compiled, inputs = pair
    for stack in (m for m in compiled.modules() if isinstance(m, pareprop.ReversibleStack)):
        stack.store_blocks([0])
    try:
        got = _step(compiled, inputs, "reversible")
    finally:
        for stack in (m for m in compiled.modules() if isinstance(m, pareprop.ReversibleStack)):
            stack.store_blocks([])
    ref = _step(eager, inputs, "autograd")
    bad = {k: v for k, v in _errors(got, ref).items() if not v < TOL}
    assert not bad, f"{family} stored: {bad}"


@pytest.mark.parametrize("count", [1, 3])
def test_chunked_branches_under_compile_match_eager(pair, count):
    # One chunk runs the compiled F and G; several run f_chunk / g_chunk eagerly (NOTE
    # [ Chunked branches and torch.compile ] in docs/compile.md).
    family, eager, compiled, inputs = pair
    pareprop.set_chunking(compiled, chunks=count)
    try:
        got = {engine: _step(compiled, inputs, engine) for engine in ENGINES[1:]}
    finally:
        pareprop.set_chunking(compiled)
    ref = _step(eager, inputs, "autograd")
    for engine, step in got.items():
        bad = {k: v for k, v in _errors(step, ref).items() if not v < TOL}
        assert not bad, f"{family} {engine} chunks={count}: {bad}"


def test_bf16_autocast_on_cpu_under_compile():
    torch.manual_seed(0)
    eager, inputs = _vit()
    eager = eager.float()
    compiled = pareprop.compile_blocks(copy.deepcopy(eager))
    x = inputs[0].float()
    results = {}
    for name, model, engine in [("eager", eager, "autograd"), ("compiled", compiled, "reversible")]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[name] = _step(model, (x,), engine)
    got, ref = results["compiled"], results["eager"]
    errors = _errors(got, ref)
    # bf16 rounds differently in fused kernels: a loose bound, far below a wrong mask's error
    bad = {k: v for k, v in errors.items() if not v < 5e-2}
    assert not bad, bad


def test_train_cli_compile(tmp_path):
    from pareprop.cli.train import main
    from pareprop.trainer import TrainConfig, Trainer

    torch.set_default_dtype(torch.float32)  # a real run; the autouse fixture restores float64
    tiny = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2)
    trainer = Trainer(TrainConfig(model="rev_vit_tiny_patch4_32", model_kwargs=tiny, epochs=1,
                                  batch_size=8, max_steps=1, out=str(tmp_path / "a"),
                                  progress=False, compile=True))
    assert pareprop.compiled_blocks(trainer.model) == ["stack.blocks.0", "stack.blocks.1"]
    args = [f"--model-arg={k}={v}" for k, v in tiny.items()]
    code = main(["--out", str(tmp_path / "b"), "--epochs", "1", "--max-steps", "1",
                 "--batch-size", "8", "--compile", "--no-progress", *args])
    assert code == 0


def test_inductor_random_replays_in_recomputation_too():
    # With inductor's own random kernels (fallback_random=False) masks differ from eager's, but
    # their seeds come from the global generator the engine restores, so recomputation must
    # still rebuild each block's inputs exactly: a mask drawn anew would not.
    torch.manual_seed(0)
    model, inputs = _vit()
    pareprop.compile_blocks(model, options={"fallback_random": False})
    model.train()
    pareprop.debug_reconstruction(model, tolerance=1e-9)
    model(*inputs).sum().backward()
    errors = model.stack.last_reconstruction_errors
    assert len(errors) == 2 and max(max(e) for e in errors) < 1e-9, errors


def test_checkpointed_non_reversible_blocks_under_compile_match_eager(pair):
    # set_grad_checkpointing: transitions / merging and fusion recompute eagerly in backward
    # while F and G run compiled.
    family, eager, compiled, inputs = pair
    compiled.set_grad_checkpointing(True)
    try:
        got = _step(compiled, inputs, "pareprop")
    finally:
        compiled.set_grad_checkpointing(False)
    ref = _step(eager, inputs, "autograd")
    bad = {k: v for k, v in _errors(got, ref).items() if not v < TOL}
    assert not bad, f"{family} grad checkpointing: {bad}"
