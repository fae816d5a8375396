"""Model families. Importing this package registers every named variant."""

# Imported for their side effect: each module registers its named variants.
from pareprop.models import (  # noqa: E402,F401
    converted_vit,
    mvit,
    rev_mvit,
    rev_mvit_video,
    swin,
    text,
    vit,
)
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

__all__ = ["create_model", "is_model", "list_models", "model_spec", "register_model",
           "unknown_model_message"]
