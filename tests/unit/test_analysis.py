"""analysis.mean_and_spread against hand values."""

from pathlib import Path

from grpo_lightning.studies.analysis import RunData, group_by, mean_and_spread


def test_mean_and_spread_by_hand():
    a = RunData(Path("a"), {"variant": "storpo", "seed": "0"}, {"r": [(0, 1.0), (1, 3.0)]})
    b = RunData(Path("b"), {"seed": "1"}, {"r": [(0, 3.0), (2, 5.0)]})
    c = RunData(Path("c"), {"variant": "storpo"}, {"r": [(0, 2.0), (1, float("nan"))]})
    assert mean_and_spread([a, b, c], "r") == ([0, 1, 2], [2.0, 3.0, 5.0], [1.0, 3.0, 5.0], [3.0, 3.0, 5.0])
    assert {k: [r.path.name for r in v] for k, v in group_by([a, b, c]).items()} == {
        "storpo": ["a", "c"],
        "grpo": ["b"],
    }
