"""How much low precision costs a reversible network, block by block.

A reversible engine rebuilds each block's inputs by subtraction (X2 = Y2 - G(Y1)), so the
rounding of F and G in low precision is not only in the gradients, as with autograd, but also
in the rebuilt activations, and it can build up from the last block to the first.
:func:`drift_report` measures both for one training step: the relative error of every rebuilt
block input against the input the forward really had, and the relative error of every
parameter gradient against a high-precision autograd reference, for the autograd engine and
the reversible engines under the same autocast.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import DropPath as TimmDropPath

from pareprop.engine import ENGINES, debug_reconstruction, stacks_of
from pareprop.engine.testing import one_step, relative_error
from pareprop.layers import DropPath

__all__ = ["DriftReport", "drift_report"]

Tensor = torch.Tensor


@dataclass
class DriftReport:
    """Results of :func:`drift_report`; every error is a relative error.

    Attributes:
        blocks: names of the reversible blocks, first to last (``stack.blocks.3``).
        reconstruction: per reversible engine, per block, the larger of the X1 and X2 errors of
            the rebuilt inputs against the forward's.
        block_grad_error: per engine, per block, the error of the block's parameter gradients
            (all of them together) against the reference.
        param_grad_error: per engine, per parameter name, its gradient's error.
        grad_error: per engine, the error of all parameter gradients together.
    """

    amp_dtype: str
    reference_dtype: str
    blocks: List[str]
    reconstruction: Dict[str, List[float]] = field(default_factory=dict)
    block_grad_error: Dict[str, List[float]] = field(default_factory=dict)
    param_grad_error: Dict[str, Dict[str, float]] = field(default_factory=dict)
    grad_error: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def ratios(self) -> Dict[str, float]:
        """Each reversible engine's total gradient error over the autograd engine's."""
        base = self.grad_error.get("autograd")
        if not base:
            return {}
        return {e: err / base for e, err in self.grad_error.items() if e != "autograd"}

    def table(self) -> str:
        lines = [f"gradient error against the {self.reference_dtype} reference "
                 f"under {self.amp_dtype} autocast:"]
        for engine, err in self.grad_error.items():
            ratio = self.ratios().get(engine)
            extra = "" if ratio is None else f"  ({ratio:.2f}x autograd)"
            lines.append(f"  {engine:<10} {err:.3e}{extra}")
        for engine, errs in self.reconstruction.items():
            finite = [e for e in errs if math.isfinite(e)]
            if finite:
                lines.append(f"  {engine:<10} rebuilt inputs: worst block {max(finite):.3e}, "
                             f"first block {errs[0]:.3e}, last block {errs[-1]:.3e}")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Error against block index: rebuilt inputs and block gradients, one line per engine."""
        # matplotlib is heavy and only this plot needs it; Agg draws without a display, and the
        # backend must be chosen before pyplot is imported.
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
        index = list(range(len(self.blocks)))
        for engine, errs in self.reconstruction.items():
            axes[0].plot(index, errs, marker="o", label=engine)
        for engine, errs in self.block_grad_error.items():
            axes[1].plot(index, errs, marker="o", label=engine)
        titles = ("rebuilt block inputs", f"block gradients vs {self.reference_dtype}")
        for ax, title in zip(axes, titles):
            ax.set_yscale("log")
            ax.set_xlabel("block (0 = first)")
            ax.set_ylabel("relative error")
            ax.set_title(f"{title}, {self.amp_dtype} autocast")
            ax.legend()
        fig.savefig(path, dpi=120)
        plt.close(fig)


@contextlib.contextmanager
def _without_randomness(model: nn.Module) -> Iterator[None]:
    # Masks drawn for low-precision tensors need not match those drawn for float32 ones, which
    # would swamp the rounding error this report is about: switch dropout and drop-path off.
    saved: List[Tuple[nn.Module, str, float]] = []
    for m in model.modules():
        attr = "p" if isinstance(m, nn.modules.dropout._DropoutNd) else (
            "drop_prob" if isinstance(m, (DropPath, TimmDropPath)) else None
        )
        if attr is not None:
            saved.append((m, attr, getattr(m, attr)))
            setattr(m, attr, 0.0)
    try:
        yield
    finally:
        for m, attr, value in saved:
            setattr(m, attr, value)


def _block_names(model: nn.Module) -> List[str]:
    return [
        f"{name}.blocks.{i}" if name else f"blocks.{i}"
        for name, stack in stacks_of(model)
        for i in range(len(stack.blocks))
    ]


def _block_grad_errors(blocks, grads, reference) -> List[float]:
    errors = []
    for block in blocks:
        names = [n for n in reference if n.startswith(block + ".")]
        got = [grads[n].flatten() for n in names if grads[n] is not None]
        want = [reference[n].flatten() for n in names if reference[n] is not None]
        errors.append(relative_error(torch.cat(got), torch.cat(want)) if want else 0.0)
    return errors


def _total_grad_error(grads, reference) -> float:
    names = [n for n, g in reference.items() if g is not None]
    return relative_error(
        torch.cat([grads[n].double().flatten() for n in names]),
        torch.cat([reference[n].double().flatten() for n in names]),
    )


def drift_report(
    model: nn.Module,
    inputs: Union[Tensor, Sequence[Any]],
    amp_dtype: Optional[torch.dtype] = torch.bfloat16,
    reference_dtype: torch.dtype = torch.float32,
    engines: Sequence[str] = ENGINES,
    seed: int = 0,
) -> DriftReport:
    """Measure the reconstruction and gradient error of one training step in low precision.

    Args:
        model: a float32 model with reversible stacks, on its device.
        inputs: its positional inputs (a tensor or a tuple).
        amp_dtype: autocast dtype for the measured runs (bfloat16 on CPU or GPU, float16 on
            GPU); None measures without autocast.
        reference_dtype: dtype of the reference run (plain autograd, no autocast).
        engines: engines to measure; each runs one step under the same autocast.
        seed: seed of the step (dropout and drop-path are switched off for the measurement).

    Returns:
        A :class:`DriftReport`. The model's engine, mode and gradients are left as found.
    """
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected some of {', '.join(ENGINES)}")
    if not stacks_of(model):
        raise ValueError("model has no ReversibleStack, so there is nothing to rebuild")
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    device_type = next(
        (x.device.type for x in inputs if isinstance(x, Tensor)), "cpu"
    )
    original_engine = stacks_of(model)[0][1].engine
    was_training = model.training
    blocks = _block_names(model)
    report = DriftReport(
        amp_dtype=str(amp_dtype).replace("torch.", "") if amp_dtype else "none",
        reference_dtype=str(reference_dtype).replace("torch.", ""),
        blocks=blocks,
    )

    reference_model = copy.deepcopy(model).to(reference_dtype).train()
    ref_inputs = [
        x.to(reference_dtype) if isinstance(x, Tensor) and x.is_floating_point() else x
        for x in inputs
    ]
    with _without_randomness(reference_model):
        _, _, reference = one_step(reference_model, ref_inputs, "autograd", seed, None, {})
    del reference_model

    model.train()
    try:
        with _without_randomness(model):
            for engine in engines:
                debug_reconstruction(model, tolerance=math.inf)
                autocast = (
                    torch.autocast(device_type, dtype=amp_dtype)
                    if amp_dtype is not None
                    else contextlib.nullcontext()
                )
                with autocast:
                    _, _, grads = one_step(model, inputs, engine, seed, None, {})
                if engine != "autograd":
                    report.reconstruction[engine] = [
                        max(pair)
                        for _, stack in stacks_of(model)
                        for pair in stack.last_reconstruction_errors
                    ]
                report.param_grad_error[engine] = {
                    n: relative_error(grads[n], g) for n, g in reference.items()
                }
                report.block_grad_error[engine] = _block_grad_errors(blocks, grads, reference)
                report.grad_error[engine] = _total_grad_error(grads, reference)
    finally:
        for _, stack in stacks_of(model):
            stack.debug_reconstruction(None)
            stack.set_engine(original_engine)
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return report
