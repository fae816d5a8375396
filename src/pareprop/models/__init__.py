"""Model families. Importing this package registers every named variant."""

# Imported for their side effect: each module registers its named variants.
from pareprop.models import (  # noqa: E402,F401
    mvit,
    rev_mvit,
    rev_mvit_video,
    swin,
    text,
    vit,
)
from pareprop.models._base import ReversibleModelMixin, make_head
from pareprop.models._features import check_output_fmt
from pareprop.models._fx import register_fx_leaves
from pareprop.models._registry import (
    create_model,
    is_model,
    list_models,
    model_spec,
    register_model,
    unknown_model_message,
)

register_fx_leaves()

# The model contract's parts, for models built outside this package (pareprop.convert).
__all__ = ["ReversibleModelMixin", "check_output_fmt", "create_model", "is_model", "list_models",
           "make_head", "model_spec", "register_model", "unknown_model_message"]
