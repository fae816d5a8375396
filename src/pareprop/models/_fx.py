"""FX symbolic tracing of the models, as torchvision's feature extraction and timm's FX tests do it.

# NOTE [ FX leaves ]
# torch.fx traces Python with proxies in place of tensors. Three things here cannot be traced
# and need not be:
#  * ReversibleStack: its training forward captures generator and autocast states and runs
#    one autograd Function whose backward walks the blocks again. A traced copy would lose
#    all of that, so the stack stays one call in the graph and runs itself, with its engine,
#    when the traced module runs (its memory guarantee holds inside the graph too).
#  * RevSwinStage: the window masks it hands to its stack are built in Python from the map
#    size and cached per size, which a proxy does not have.
#  * PoolingAttention (Rev-MViTv2's transitions): its windows, padding and relative position
#    tables are sized in Python from the pooled maps' shapes.
#  * check_image, check_video: the input checks branch on shapes and dtypes; as wrapped calls
#    they stay in the graph and still check at run time.
# timm keeps the list of such leaves (``timm.layers.get_notrace_modules()`` and
# ``get_notrace_functions()``), and its tests and ``timm.models.create_feature_extractor``
# pass it to the tracer, so registering there is what makes the models traceable. A tracer
# built by hand needs ``leaf_modules=`` and ``autowrap_functions=`` from those two calls.
"""

from __future__ import annotations

from pareprop.engine import ReversibleStack
from pareprop.layers.patch_embed import check_image
from pareprop.layers.pooling_attention import PoolingAttention
from pareprop.models.rev_mvit_video import check_video
from pareprop.models.swin import RevSwinStage

__all__ = ["register_fx_leaves"]


def register_fx_leaves() -> None:
    """Add the untraceable parts to timm's FX leaf lists (no-op without timm)."""
    try:
        from timm.layers import register_notrace_function, register_notrace_module
    except ImportError:  # timm is a declared dependency, but the core works without it
        return

    register_notrace_module(ReversibleStack)
    register_notrace_module(RevSwinStage)
    register_notrace_module(PoolingAttention)
    register_notrace_function(check_image)
    register_notrace_function(check_video)
