"""``pareprop plan`` records the coupling each converted model was planned at, its default
(0, 1) included, in plan.json: the numbers depend on it (at (1, 0) every block keeps its graph)."""

import json

from pareprop.catalog import CONVERTED_COUPLING
from pareprop.cli import main


def test_plan_json_records_a_converted_models_default_coupling(tmp_path):
    out = tmp_path / "plan"
    assert main(["plan", "--models", "converted:vit_small_patch16_224",
                 "--engines", "reversible", "--depth", "2", "--img-size", "32",
                 "--device", "cpu", "--batch-sizes", "2", "--out", str(out)]) == 0
    records = json.loads((out / "plan.json").read_text())["records"]
    coupling = {r["model"]: r["coupling"] for r in records}
    assert CONVERTED_COUPLING == (0.0, 1.0)
    assert coupling == {"converted:vit_small_patch16_224": [0.0, 1.0]}
