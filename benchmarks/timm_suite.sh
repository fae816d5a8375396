#!/usr/bin/env bash
# Run timm's own model test suite (tests/test_models.py of timm's source release) against
# pareprop's registered image models, and print the pass/fail counts.
#
#   PYTHONPATH=src bash benchmarks/timm_suite.sh [extra pytest args]
#
# Needs the network once (pip download of timm's sdist); not part of CI. The suite selects
# models with timm.list_models(...) at collection time, so the copied test file gets
# list_models restricted to pareprop's image models, and our models are added to its
# NON_STD_FILTERS (timm's list for ViT-like models whose features are not NCHW maps), as timm
# treats its own ViT, MViTv2 and Swin-like families.
set -euo pipefail
TIMM_VERSION="${TIMM_VERSION:-1.0.31}"
WORK="${TIMM_SUITE_DIR:-/tmp/timmsrc}"
mkdir -p "$WORK"
SDIST="$WORK/timm-$TIMM_VERSION.tar.gz"
[ -f "$SDIST" ] || pip download --no-binary :all: --no-deps "timm==$TIMM_VERSION" -d "$WORK"
[ -d "$WORK/timm-$TIMM_VERSION" ] || tar xzf "$SDIST" -C "$WORK"
SUITE="$WORK/pareprop_suite"
rm -rf "$SUITE" && mkdir -p "$SUITE"
python - "$WORK/timm-$TIMM_VERSION/tests/test_models.py" "$SUITE/test_models.py" <<'PY'
import sys
src, dst = sys.argv[1:]
text = open(src).read()
old = "from timm import list_models, "
assert old in text, "timm's test_models.py no longer imports list_models from timm"
text = text.replace(old, "from timm import ", 1)
shim = '''
import pareprop as _pareprop  # registers the rev_* image models in timm
_OURS = {n for n in _pareprop.list_models() if timm.is_model(n)}


def list_models(*args, **kwargs):
    """timm.list_models restricted to pareprop's image models."""
    return [n for n in timm.list_models(*args, **kwargs) if n in _OURS]

'''
marker = "NON_STD_FILTERS = ["
assert marker in text
text = text.replace(marker, shim + marker, 1)
marker = "NUM_NON_STD = len(NON_STD_FILTERS)"
assert marker in text
text = text.replace(marker, "NON_STD_FILTERS += ['rev_*']\n" + marker, 1)
open(dst, "w").write(text)
PY
cd "$SUITE"
# Two tests are about timm's own models, not ours, and are left out: test_model_inference runs
# timm's pretrained test_* models against reference outputs on the Hugging Face Hub (timm's
# list_pretrained, which the shim does not restrict), and
# test_model_forward_torchscript_with_features_fx names timm's regnetx_002.
python -m pytest -q -p no:cacheprovider -W ignore::pytest.PytestUnknownMarkWarning test_models.py \
    --deselect test_models.py::test_model_inference \
    --deselect test_models.py::test_model_forward_torchscript_with_features_fx \
    -rfE "$@" 2>&1 | tee "$WORK/suite.log" | tail -n 40
