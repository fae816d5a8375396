"""torchvision's 2-D Swin Transformers (``swin_t/s/b``, ``swin_v2_t/s/b``) as baselines, in the
two modes the catalog compares reversible models with: ``plain`` (autograd) and
``checkpointed`` (every block under ``torch.utils.checkpoint``, as timm's
``set_grad_checkpointing()`` does for its Swin's blocks). Beside their conversion
(``converted:swin_t``, pareprop/convert/torchvision_swin.py), one plan compares the two.

They are not in pareprop's registry (they are torchvision's models); the catalog builds them by
name (:data:`TORCHVISION_SWIN_MODELS`) through :func:`create_torchvision_swin`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["TORCHVISION_SWIN_MODELS", "TorchvisionSwin", "create_torchvision_swin"]

TORCHVISION_SWIN_MODELS = ("swin_t", "swin_s", "swin_b", "swin_v2_t", "swin_v2_s", "swin_v2_b")


class TorchvisionSwin(nn.Module):
    """A torchvision 2-D Swin with pareprop's model interface: ``example_inputs``,
    ``set_grad_checkpointing``, ``num_classes`` and a ``pretrained_cfg`` giving its image size.

    Args:
        name: one of :data:`TORCHVISION_SWIN_MODELS`.
        num_classes: classes of its head (1000: ImageNet-1k).
        img_size: side of the square images (default the weights' crop: 224 for V1, 256 for
            V2); torchvision's model takes any size (its windows pad).
    """

    def __init__(self, name: str, num_classes: int = 1000, img_size: Optional[int] = None):
        super().__init__()
        import torchvision  # heavy, and only baselines need it

        if name not in TORCHVISION_SWIN_MODELS:
            raise ValueError(f"expected one of {TORCHVISION_SWIN_MODELS}, got {name!r}")
        self.net = getattr(torchvision.models, name)(num_classes=num_classes)
        self.name = name
        self.num_classes = num_classes
        self.in_chans = 3
        self.img_size = int(img_size) if img_size is not None else \
            (256 if name.startswith("swin_v2") else 224)
        self.grad_checkpointing = False
        self.pretrained_cfg: Dict[str, Any] = {
            "input_size": (3, self.img_size, self.img_size),
            "num_classes": num_classes,
            "mean": (0.485, 0.456, 0.406),
            "std": (0.229, 0.224, 0.225),
            "classifier": "net.head",
        }

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Run every block under ``torch.utils.checkpoint`` (non-reentrant)."""
        self.grad_checkpointing = bool(enable)

    def example_inputs(
        self, batch_size: int = 2, device: Any = None, dtype: torch.dtype = torch.float32
    ) -> Tuple[torch.Tensor]:
        """A random batch of images ``(B, 3, H, W)``."""
        return (torch.randn(batch_size, 3, self.img_size, self.img_size, device=device,
                            dtype=dtype),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torchvision's SwinTransformer.forward, with each block optionally checkpointed: the
        # stages are the odd parts of ``features`` (the stem at 0, mergings between).
        net = self.net
        for i, part in enumerate(net.features):
            if i % 2 == 0 or not (self.grad_checkpointing and torch.is_grad_enabled()):
                x = part(x)  # (B, H, W, C)
                continue
            for block in part:
                x = checkpoint(block, x, use_reentrant=False)
        x = net.norm(x)
        return net.head(net.flatten(net.avgpool(net.permute(x))))


def create_torchvision_swin(name: str, **kwargs: Any) -> TorchvisionSwin:
    """Build torchvision's ``name`` (``swin_t`` ... ``swin_v2_b``) as a :class:`TorchvisionSwin`;
    ``kwargs``: ``num_classes``, ``img_size``."""
    return TorchvisionSwin(name, **kwargs)
