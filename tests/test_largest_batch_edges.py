"""``largest_batch``'s search at its edges: a boundary that the bisection (not the secant)
decides, with the memory equal to a planned peak, and a first batch above 1 where nothing fits
(issue 39 item 5: each test here failed with a one-line mutant of the search)."""

import types

from pareprop.memory import largest_batch, plan_memory
from pareprop.memory import plan as plan_module

BOUNDARY = 40


def _planned(monkeypatch, peak):
    """Replace the planner by ``peak(batch)``; returns the batches planned, in order."""
    planned = []

    def fake(name, batch_size, engine, **kwargs):
        planned.append(batch_size)
        return types.SimpleNamespace(batch_size=batch_size, peak=peak(batch_size))

    monkeypatch.setattr(plan_module, "plan_memory", fake)
    return planned


def test_the_bisection_keeps_a_batch_whose_peak_equals_the_memory(monkeypatch):
    # Peaks that grow by one byte each time the batch doubles, then jump past BOUNDARY: the
    # secant's lines misjudge them and leave a bracket around the boundary, which the bisection
    # decides; the memory is exactly the boundary's planned peak (a peak equal to it fits).
    planned = _planned(monkeypatch, lambda b: 1000 + b.bit_length() if b <= BOUNDARY else 10**9)
    brackets = []
    secant = plan_module._secant
    monkeypatch.setattr(plan_module, "_secant",
                        lambda *a, **k: brackets.append(secant(*a, **k)) or brackets[-1])
    memory = 1000 + BOUNDARY.bit_length()
    best, reports = largest_batch("m", "reversible", memory)
    assert best == BOUNDARY
    assert {r.batch_size: r.peak for r in reports}[BOUNDARY] == memory
    (lo, hi), = brackets
    assert lo < BOUNDARY < BOUNDARY + 1 < hi  # the secant left it to the bisection
    assert BOUNDARY + 1 in planned


def test_nothing_fits_from_a_first_batch_above_one(monkeypatch):
    planned = _planned(monkeypatch, lambda b: 1000 + b)
    best, _ = largest_batch("m", "reversible", 1000, start=8)
    assert best == 0
    assert 1 in planned  # batch 1 was planned, not assumed to fit


def test_nothing_fits_from_a_first_batch_above_one_on_a_real_plan():
    kw = dict(device="cpu", depth=1, num_classes=10)
    one = plan_memory("rev_vit_tiny_patch4_32", 1, "autograd", **kw).peak
    best, reports = largest_batch("rev_vit_tiny_patch4_32", "autograd", one - 1, start=4, **kw)
    assert best == 0 and all(r.peak > one - 1 for r in reports)
