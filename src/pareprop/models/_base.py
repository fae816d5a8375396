"""The timm-style interface the model families share: classifier head, ``pretrained_cfg``,
engine switching, and the weight initialisation they have in common.

A family mixes :class:`ReversibleImageModelMixin` (images) or :class:`ReversibleModelMixin`
(other inputs) into its model, in front of ``nn.Module``. The mixins expect the model to set
``cfg`` (a config dataclass with ``num_classes``), ``num_classes``, ``num_features`` and
``head``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

import torch
import torch.nn as nn
from timm.layers import trunc_normal_

from pareprop.engine import set_stack_engine
from pareprop.models.published import PretrainedError, load_weights_file

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "ClassifierMixin",
    "ReversibleModelMixin",
    "ReversibleImageModelMixin",
    "drop_path_rates",
    "init_linear_",
    "init_linears_",
    "init_weights_",
    "make_head",
    "stage_group_matcher",
]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def drop_path_rates(rate: float, depth: int) -> List[float]:
    """Stochastic-depth rate of each block, growing linearly from 0 to ``rate``.

    Plain floats rather than ``torch.linspace`` so that meta-device builds work.
    """
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


def stage_group_matcher(coarse: bool, stem: str) -> Dict[str, Any]:
    """timm's ``group_matcher`` for models of ``stages.{s}.transition`` and
    ``stages.{s}.stack.blocks.{j}``: the stem, each block in depth order (the transition before
    its stage's stack; the final norm joins the last block's group), then the head (last,
    unmatched). ``coarse``
    groups whole stages."""
    blocks: List[Tuple[str, Any]] = [
        (r"^stages\.(\d+)\.transition", (-1,)),
        (r"^stages\.(\d+)\.stack\.blocks\.(\d+)", None),
    ]
    if coarse:
        blocks = [(r"^stages\.(\d+)", None)]
    return {"stem": stem, "blocks": [*blocks, (r"^norm", (99999,))]}


def init_linear_(m: nn.Linear, truncated: bool = True) -> None:
    """Weight from a (truncated) normal with std 0.02, bias zero.

    Args:
        m: the layer, changed in place.
        truncated: timm's truncated normal (vision); False: the plain normal of BERT/RoBERTa.
    """
    (trunc_normal_ if truncated else nn.init.normal_)(m.weight, std=0.02)
    if m.bias is not None:
        nn.init.zeros_(m.bias)


def init_linears_(module: nn.Module) -> None:
    """:func:`init_linear_` on every ``nn.Linear`` inside ``module``, in module order."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            init_linear_(m)


def init_weights_(m: nn.Module, truncated: bool = True) -> None:
    """Per-module initialisation for ``Module.apply``: Linear as :func:`init_linear_`,
    LayerNorm to the identity; other modules are left alone."""
    if isinstance(m, nn.Linear):
        init_linear_(m, truncated)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def make_head(
    num_features: int,
    num_classes: int,
    init: bool = True,
    truncated: bool = True,
    device: Any = None,
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """The classifier: a Linear from the pooled features, or ``nn.Identity()`` for 0 classes.

    Args:
        num_features: width of the pooled features.
        num_classes: classes to predict; 0 for none (the model then returns features).
        init: initialise as :func:`init_linear_`. False where a model-wide ``apply`` initialises
            afterwards: drawing here too would shift every later random draw, and so every
            parameter of a seeded build.
        truncated: as in :func:`init_linear_`.
        device: where to create the head.
        dtype: its parameter dtype.
    """
    if num_classes < 0:
        raise ValueError(f"expected num_classes >= 0 (0: no classifier), got {num_classes}")
    if num_classes == 0:
        return nn.Identity()
    head = nn.Linear(num_features, num_classes, device=device, dtype=dtype)
    if init:
        init_linear_(head, truncated)
    return head


class ClassifierMixin:
    """``get_classifier``, ``pretrained_cfg`` and classifier replacement, for every model."""

    cfg: Any
    num_classes: int
    num_features: int
    head: nn.Module

    def get_classifier(self) -> nn.Module:
        return self.head

    @property
    def head_hidden_size(self) -> int:
        """Width of ``forward_head(x, pre_logits=True)``: the pooled features (timm's name;
        no model here has a hidden pre-logits layer, so it equals ``num_features``)."""
        return self.num_features

    def _set_pretrained_cfg(
        self, input_size: Tuple[int, ...], mean: Any, std: Any, **extra: Any
    ) -> None:
        """timm's description of the model's input and classifier (``default_cfg`` is timm's
        older name for it); ``extra`` keys go between the statistics and ``classifier``."""
        self.pretrained_cfg: Dict[str, Any] = {
            "url": "",  # set for models with published weights (pareprop.pretrained)
            "hf_hub_id": None,
            "input_size": input_size,
            "num_classes": self.num_classes,
            "pool_size": None,
            "mean": mean,
            "std": std,
            **extra,
            "classifier": "head",
        }
        self.default_cfg = self.pretrained_cfg

    def load_pretrained(self, path: Any) -> Any:
        """Load a published or pareprop weight file from ``path``; timm calls this for
        ``pretrained=True`` (``pretrained_cfg["custom_load"]``). ``pareprop.load_pretrained``
        also takes checkpoint directories."""
        return load_weights_file(self, path)  # type: ignore[arg-type]

    def checkpoint_filter(self, state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Map a published state dict onto this model's names (families with published
        weights override this with their ``checkpoint_filter_fn``)."""
        raise PretrainedError(
            "published weights exist only for Rev-ViT, Rev-MViT-B and Rev-MViT-B 16x4; "
            f"{type(self).__name__} loads pareprop checkpoints only"
        )

    def _replace_head(self, num_classes: int, **head_kwargs: Any) -> None:
        """A fresh :func:`make_head` for ``num_classes``, recorded everywhere the class count is
        kept (the attribute, the config saved with the model, ``pretrained_cfg``)."""
        head = make_head(self.num_features, num_classes, **head_kwargs)
        self.num_classes = num_classes
        try:
            # Mutable configs (Swin, text) are updated where they are, frozen ones replaced.
            self.cfg.num_classes = num_classes
        except dataclasses.FrozenInstanceError:
            self.cfg = dataclasses.replace(self.cfg, num_classes=num_classes)
        self.pretrained_cfg["num_classes"] = num_classes
        self.head = head.train(self.training)  # a fresh module is in training mode


class ReversibleModelMixin(ClassifierMixin):
    """Engine switching for models built on :class:`~pareprop.engine.ReversibleStack`."""

    # Whether set_engine also writes the engine into the (mutable) config, so that the config
    # saved with the model rebuilds it on the engine it runs now. Frozen configs keep the
    # engine the model was built with.
    _cfg_records_engine = False
    grad_checkpointing = False  # see set_grad_checkpointing

    def set_engine(self, name: str) -> Self:
        """Switch every reversible stack to engine ``name`` (one of ``pareprop.ENGINES``)."""
        set_stack_engine(self, name)
        if self._cfg_records_engine:
            self.cfg.engine = name
        return self

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Run the blocks that are not reversible (Rev-MViTv2's stage transitions, Rev-Swin's
        patch merging and stream fusion) under activation checkpointing, as timm's
        ``set_grad_checkpointing`` does for its blocks: they keep only their inputs and run
        again in backward. The reversible stacks are the engine's business: they keep nothing
        under ``reversible`` and ``pareprop`` and everything under ``autograd``, either way.
        Rev-ViT and Rev-RoBERTa have no such blocks (their stack is the whole body), so the
        call changes nothing there. See NOTE [ Checkpointing what is not reversible ]."""
        self.grad_checkpointing = bool(enable)
        for module in self.modules():
            if module is not self and hasattr(module, "grad_checkpointing"):
                module.grad_checkpointing = bool(enable)


class ReversibleImageModelMixin(ReversibleModelMixin):
    """:class:`ReversibleModelMixin` plus what image classifiers share: their
    ``pretrained_cfg`` and random example batches."""

    in_chans: int

    def _set_image_pretrained_cfg(self, crop_pct: float, fixed_input_size: bool) -> None:
        """``pretrained_cfg`` (and ``in_chans``) from ``cfg.in_chans``, ``cfg.img_size`` (H, W),
        ``cfg.mean`` and ``cfg.std``; the first convolution is ``patch_embed.proj``.

        Args:
            crop_pct: timm's evaluation crop fraction.
            fixed_input_size: True where the model accepts only its configured size (learned
                absolute position embeddings).
        """
        cfg = self.cfg
        self.in_chans = cfg.in_chans
        self._set_pretrained_cfg(
            (cfg.in_chans, *cfg.img_size),
            tuple(cfg.mean),
            tuple(cfg.std),
            fixed_input_size=fixed_input_size,
            crop_pct=crop_pct,
            crop_mode="center",
            interpolation="bicubic",
            first_conv="patch_embed.proj",
        )

    def example_inputs(
        self, batch_size: int = 2, device: Any = None, dtype: torch.dtype = torch.float32
    ) -> Tuple[torch.Tensor]:
        """A random batch ``(B, C, H, W)`` of the configured image size, for benchmarks and
        tests."""
        C, H, W = self.pretrained_cfg["input_size"]
        return (torch.randn(batch_size, C, H, W, device=device, dtype=dtype),)
