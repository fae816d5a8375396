"""The measurement behind chunking by bytes (NOTE [ Measuring a chunk's graph ]): every saved
map counted, a fit that does not grow refused, and the chunk counts a stack chooses at a batch
where a miscount once ran a branch whole on CUDA (issue 31: Rev-ViT-B, batch 4000, 256 MiB)."""

import math

import pytest
import torch

import pareprop
from pareprop.engine import chunk_cost, chunked
from pareprop.engine.chunk_cost import graph_bytes, linear_cost


def test_graph_bytes_counts_maps_whose_storage_died_during_the_build():
    # fc1's output dies once the activation has run (the hook keeps nothing in the graph), and
    # the activation's output has its shape: both are saved, both must be counted.
    lin = torch.nn.Linear(8, 32).double()
    x = torch.randn(5, 8, dtype=torch.float64)

    def build():
        leaf = x.clone().requires_grad_(True)
        return torch.nn.functional.gelu(lin(leaf)).sin(), [leaf]

    hidden = 5 * 32 * 8
    # gelu saves fc1's output, sin saves gelu's output; plus sin's output. The leaf and the
    # weight are left out (the weight is passed as free; linear saves the leaf itself).
    assert graph_bytes(build, free=lin.parameters()) == 3 * hidden


def test_graph_bytes_keeps_saved_tensors_until_counted():
    alive = []

    def pack_probe():
        leaf = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
        out = leaf.exp().exp()  # the first exp's output is saved, then dropped by the graph
        alive.append(torch.autograd.graph.saved_tensors_hooks)  # the build ran under a hook
        return out, [leaf]

    assert graph_bytes(pack_probe) == 2 * 16 * 8  # two exp outputs (saved), leaf left out
    assert alive


class _QkvAttentionBlock(pareprop.ReversibleBlock):
    """F: timm's attention without the output projection, q, k and v views of one qkv
    storage (reshape, permute, unbind), split by samples; G: a linear map, whole."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.lin = torch.nn.Linear(dim, dim)

    def f(self, x, **kwargs):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(
            1, 2).reshape(b, n, c)

    def f_split(self, x, **kwargs):
        return pareprop.chunking.Split.samples(x.shape[0])

    def f_chunk(self, x, chunk, **kwargs):
        return self.f(x)

    def g(self, x, **kwargs):
        return self.lin(x)


def _attention_bytes(samples, tokens=16, dim=32, heads=2):
    """What the toy F's graph holds, float32: the qkv storage (q, k and v saved by attention,
    each a view of it), attention's log-sum-exp, and its output (F's output is a view)."""
    return 4 * samples * tokens * (3 * dim + heads + dim)


def test_graph_bytes_counts_q_k_and_v_of_one_storage_whole():
    # NOTE [ Counting a chunk by storage ]: q, k and v have one shape and one storage; keyed
    # by storage and shape and counted by numel they were one third of it (12,544 bytes here
    # against the 16,640 the graph holds).
    torch.manual_seed(0)
    block = _QkvAttentionBlock()
    x = torch.randn(2, 16, 32)

    def build():
        leaf = x.clone().requires_grad_(True)
        return block.f(leaf), [leaf]

    assert graph_bytes(build, free=block.parameters()) == _attention_bytes(2) == 16_640


def test_max_bytes_caps_what_a_chunk_of_attention_holds(monkeypatch):
    # A cap of 4 samples' graph: counted by numel a sample looked 6,272 bytes, not 8,320, and
    # the branch ran in chunks of 5 samples, each holding 41,600 bytes over the 33,280 asked.
    seen = []
    count_for = pareprop.engine.chunk_cost.Chunking.count_for

    def spy(self, size, fixed=0.0, per_unit=0.0):
        seen.append((size, count_for(self, size, fixed, per_unit)))
        return seen[-1][1]

    monkeypatch.setattr(pareprop.engine.chunk_cost.Chunking, "count_for", spy)
    torch.manual_seed(0)
    stack = pareprop.ReversibleStack([_QkvAttentionBlock()], engine="reversible")
    cap = _attention_bytes(4)
    pareprop.set_chunking(stack, max_bytes=cap)
    x = torch.randn(20, 16, 32, requires_grad=True)
    y1, y2 = stack(x, x * 2)
    (y1 * y2).sum().backward()
    assert seen and all(size == 20 for size, _ in seen)  # F, in forward and in backward
    for size, count in seen:
        assert _attention_bytes(math.ceil(size / count)) <= cap, count


def test_linear_cost_fits_and_refuses_a_flat_fit():
    assert linear_cost([100, 150]) == (50.0, 50.0)
    assert linear_cost([70]) == (0.0, 70.0)
    with pytest.raises(RuntimeError, match="two units saved 90 bytes, one unit 100"):
        linear_cost([100, 90], "block 3 branch g")
    with pytest.raises(RuntimeError, match="expected the larger chunk to save more"):
        linear_cost([100, 100])


def test_a_miscounted_measurement_is_an_error_not_a_whole_branch(monkeypatch):
    # What the CUDA run did: the two-unit graph measured no more than the one-unit graph. The
    # old fit turned that into one byte per unit, so the branch ran whole. Now it is refused.
    calls = iter([1000, 1000] * 10)
    monkeypatch.setattr(chunked, "graph_bytes", lambda build, free=(): next(calls))
    model = pareprop.create_model("rev_vit_tiny_patch4_32", depth=1)
    pareprop.set_engine(model, "reversible")
    pareprop.set_chunking(model, max_bytes=2**20)
    with pytest.raises(RuntimeError, match="block 0 .* branch f"):
        model(torch.randn(2, 3, 32, 32))


def test_rev_vit_base_chunk_counts_and_transient_where_cuda_ran_whole():
    # Planned on fake tensors (nothing allocated), at 3500 and at 4000 where one block's G ran
    # whole on CUDA: every G splits its 196 tokens into the count the measured per-token cost
    # gives at 256 MiB, never 1, in forward and backward, and the step's transient grows with
    # the batch, not by a whole-batch MLP map.
    seen = []
    count_for = pareprop.engine.chunk_cost.Chunking.count_for

    def spy(self, size, fixed=0.0, per_unit=0.0):
        count = count_for(self, size, fixed, per_unit)
        seen.append((size, fixed, per_unit, count))
        return count

    transient = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pareprop.engine.chunk_cost.Chunking, "count_for", spy)
        for batch in (3500, 4000):
            seen.clear()
            report = pareprop.plan_memory("rev_vit_base_patch16_224", batch, "reversible",
                                          amp="bf16", depth=2, chunk_bytes="256MiB")
            transient[batch] = report.transient
            tokens = [s for s in seen if s[0] == 196]
            assert len(tokens) >= 4  # G of both blocks, forward and backward
            for _size, fixed, per_unit, count in tokens:
                # at bf16 a token of G keeps fc1's and GELU's 3072-wide maps at least
                assert per_unit > batch * 3072 * 2 * 2
                units = int((256 * 2**20 - fixed) // per_unit)
                assert count == math.ceil(196 / units) > 1
    # linear in the batch: a whole-batch MLP map (4.8 GB at 4000) would break it by 30%
    assert transient[4000] / transient[3500] == pytest.approx(4000 / 3500, rel=0.02)


def test_graph_bytes_leaves_nothing_alive():
    # autograd keeps a saved tensor's pack hook in the graph; a hook that holds the graph's
    # output would make a cycle the collector cannot see, and every measurement would leak
    # its graph (3.4 GiB of Rev-ViT-B's planned peak at batch 6520 before this was found).
    import gc
    import weakref

    refs = []

    def build():
        leaf = torch.randn(64, 64, requires_grad=True)
        hidden = leaf.exp()
        out = hidden.sin()
        refs.extend([weakref.ref(hidden), weakref.ref(out)])
        return out, [leaf]

    assert graph_bytes(build) == 2 * 64 * 64 * 4
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_rev_vit_head_in_chunks_keeps_no_whole_2c_map(monkeypatch):
    # NOTE [ Rev-ViT's head in chunks ]: with the stack chunked, the head's LayerNorm over the
    # 2C concatenation runs a chunk of samples at a time under checkpointing. Run whole, as
    # before, it keeps the concatenation and makes two more maps of its size in backward; at
    # this tiny size other maps share the peak, so a third of a 2C map is what shows.
    torch.manual_seed(0)
    model = pareprop.create_model("rev_vit_tiny_patch4_32", embed_dim=64, depth=2, num_heads=4,
                                  num_classes=10)
    pareprop.set_engine(model, "reversible")
    pareprop.set_chunking(model, chunks=16)
    x = torch.randn(64, 3, 32, 32)
    chunked = pareprop.memory_report(model, x, optimizer="sgd").peak
    with monkeypatch.context() as m:  # the head as it was: whole, under autograd
        m.setattr(type(model), "forward",
                  lambda self, x: self.forward_head(self.forward_features(x)))
        whole = pareprop.memory_report(model, x, optimizer="sgd").peak
    two_c_map = 64 * 64 * 128 * 4  # batch x tokens x 2C, float32
    assert whole - chunked > 0.25 * two_c_map, (whole - chunked) / two_c_map


# NOTE [ Chunk costs while planning ]: plans share measurements among modules of one structure.


def test_blocks_alike_have_one_structure_and_settings_tell_them_apart():
    from pareprop.engine import ReversibleStack
    from pareprop.engine.chunk_cost import structure

    with torch.device("meta"):  # stages of 1, 1, 10 and 1 blocks
        model = pareprop.create_model("rev_mvitv2_base", num_classes=10)
    stacks = [m for m in model.modules() if isinstance(m, ReversibleStack)]
    deep = next(s for s in stacks if len(s.blocks) > 1)
    assert structure(deep.blocks[0]) == structure(deep.blocks[1]) is not None
    assert structure(stacks[0].blocks[0]) != structure(deep.blocks[0])  # other widths
    assert hash(structure(deep.blocks[0]))  # a key
    block = deep.blocks[1]
    block.training = False
    assert structure(block) != structure(deep.blocks[0])
    block.training = True
    block.attn.num_heads = True  # a bool is not the int 1
    one = structure(block)
    block.attn.num_heads = 1
    assert one != structure(block)
    handle = block.mlp.register_forward_hook(lambda *a: None)
    assert structure(block) is None  # a hook may do anything
    handle.remove()
    block.scale_fn = lambda x: x  # a setting that is no plain value
    assert structure(block) is None
    assert structure(object()) is None


def _graph_bytes_calls(monkeypatch):
    from pareprop.engine import recompute

    calls = []
    for module in (chunked, recompute):
        real = module.graph_bytes
        monkeypatch.setattr(module, "graph_bytes",
                            lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("name, ckpt, overrides", [
    ("rev_vit_tiny_patch4_32", False, {}),
    pytest.param("rev_mvitv2_tiny_32", True, {}, marks=pytest.mark.slow),
    pytest.param("rev_swin_tiny_32", True, {"embed_dim": 24, "num_heads": (1, 2, 3, 4)},
                 marks=pytest.mark.slow),
])
def test_plans_that_share_chunk_costs_are_the_plans_that_measure_them(name, ckpt, overrides,
                                                                      monkeypatch):
    from pareprop.memory import plan_memory

    kw = dict(device="cpu", num_classes=10, grad_checkpointing=ckpt, **overrides)
    configs = [(6, 16 * 2**10), (6, 64 * 2**10), (10, 256 * 2**10), (6, 16 * 2**10)]
    calls = _graph_bytes_calls(monkeypatch)
    monkeypatch.setattr(chunk_cost, "_PLANNED_COSTS", {})
    shared, counts = [], []
    for batch, size in configs:
        shared.append(plan_memory(name, batch, "reversible", chunk_bytes=size, **kw).to_dict())
        counts.append(len(calls))
        calls.clear()
    # the same batch again: only what has no structure to share (Rev-ViT's head, not a module)
    assert counts[1] == counts[3] < counts[0]
    monkeypatch.setattr(chunk_cost, "planned_cost", lambda module, key, measure: measure())
    for module in (chunked, pareprop.engine.recompute):
        monkeypatch.setattr(module, "planned_cost", chunk_cost.planned_cost)
    measured, every = [], []
    for batch, size in configs:
        measured.append(plan_memory(name, batch, "reversible", chunk_bytes=size, **kw).to_dict())
        every.append(len(calls))
        calls.clear()
    assert shared == measured
    assert all(n <= m for n, m in zip(counts, every)) and sum(counts) < sum(every)


def test_what_a_measurement_makes_is_not_counted_unless_it_outlives_it(monkeypatch):
    from pareprop.memory.measure import StepPeakTracker

    tracker = StepPeakTracker()
    with tracker:
        base = torch.zeros(100)  # 400 bytes
        monkeypatch.setattr(chunk_cost, "_MEASURING", [1])
        graph = torch.ones(1000)  # a measured graph: 4000 bytes, never counted
        left = torch.ones(10)  # outlives the measurement: 40 bytes, counted from its end
        aliased = base[:50] + 0  # 200 bytes, freed inside
        del graph, aliased
        monkeypatch.setattr(chunk_cost, "_MEASURING", [0])
        assert tracker.current == tracker.peak == 400
        after = base * 2  # the next operator counts what the measurement left
        assert tracker.current == 400 + 40 + 400
    assert tracker.peak == 840
    del after, left
