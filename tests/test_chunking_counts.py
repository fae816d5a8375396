"""Chunk counts chosen by bytes (``set_chunking(max_bytes=...)``, ``plan_memory(chunk_bytes=)``):
the count for a cost that does not divide the room, counts measured again after an autocast
switch, and a plan at a second batch measuring again what the first batch's plan measured
(issue 39 item 5: each test here failed with a one-line mutant of the code it checks)."""

import torch

import pareprop
from pareprop.chunking import chunks
from pareprop.engine import chunk_cost, chunked
from pareprop.engine.chunk_cost import Chunking
from pareprop.memory import plan_memory


def _spy_chunks(monkeypatch):
    """Record (size, count) of every chunked branch the engine runs (or a plan traces)."""
    seen = []
    real = chunked.chunks
    monkeypatch.setattr(chunked, "chunks", lambda size, count: seen.append((size, count))
                        or real(size, count))
    return seen


def test_count_for_rounds_up_when_the_room_does_not_divide_the_units():
    # 1000 bytes hold 3 units of 300 bytes, so 10 units take 4 chunks (3, 3, 2, 2); 3 chunks
    # would hold 4 units (1200 bytes) each.
    count = Chunking(max_bytes=1000).count_for(10, 0, 300)
    assert count == 4
    assert max(c.length for c in chunks(10, count)) * 300 <= 1000
    assert max(c.length for c in chunks(10, count - 1)) * 300 > 1000


def _vit():
    torch.manual_seed(0)
    return pareprop.create_model("rev_vit_tiny_patch4_32", img_size=16, embed_dim=32, depth=2,
                                 num_heads=2, num_classes=5, engine="reversible")


def _step_counts(model, seen, autocast):
    seen.clear()
    x = model.example_inputs(4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*x)
    out.float().sum().backward()
    return list(seen)


def test_counts_after_an_autocast_switch_are_a_fresh_models(monkeypatch):
    # A chunk's cost is measured once per block, branch, input and autocast state: bf16's graph
    # saves other bytes than float32's, so a model that trained in float32 first must count
    # chunks under autocast as a model that never left it.
    seen = _spy_chunks(monkeypatch)
    switched = _vit()
    pareprop.set_chunking(switched, max_bytes="16KiB")
    float32 = _step_counts(switched, seen, autocast=False)
    after_switch = _step_counts(switched, seen, autocast=True)
    fresh = _vit()
    pareprop.set_chunking(fresh, max_bytes="16KiB")
    assert after_switch == _step_counts(fresh, seen, autocast=True)
    assert after_switch != float32  # the two states do count differently here


def test_a_plan_at_a_second_batch_equals_that_batch_planned_alone(monkeypatch):
    # Plans share chunk costs across models of one structure (NOTE [ Chunk costs while
    # planning ]); a cost per token grows with the batch, so a plan at batch 8 must not reuse
    # what batch 2 measured. At 256 KiB the counts are not clamped to the split's size (one
    # unit per chunk) nor to 1, so the cost decides them.
    kw = dict(device="cpu", num_classes=10, depth=1, chunk_bytes=256 * 2**10)
    seen = _spy_chunks(monkeypatch)
    monkeypatch.setattr(chunk_cost, "_PLANNED_COSTS", {})
    plan_memory("rev_vit_tiny_patch4_32", 2, "reversible", **kw)
    seen.clear()
    second = plan_memory("rev_vit_tiny_patch4_32", 8, "reversible", **kw).to_dict()
    second_counts = list(seen)
    monkeypatch.setattr(chunk_cost, "_PLANNED_COSTS", {})
    seen.clear()
    alone = plan_memory("rev_vit_tiny_patch4_32", 8, "reversible", **kw).to_dict()
    assert any(1 < count < size for size, count in seen)
    assert second_counts == seen
    assert second == alone

