"""`plan --sample` suggests selection weights from a sample's participation shape (issue 34,
item 4): integers proportional to the share of (user, key) pairs in each slot, and the gain they
buy (docs/plan.md, "Selection weights")."""
import json
import math

import numpy as np
import pytest

import dpstream
from dpstream.processor.preview import selection_gain, suggest_selection_weights

START = 1_795_132_800_000


def test_no_weights_have_gain_one_and_weights_proportional_to_the_shape_the_most():
    C = 8
    shape = 0.6 ** np.arange(C)
    shape /= shape.sum()
    assert selection_gain(shape, [1] * C, C) == pytest.approx(1.0)
    best = math.sqrt(C * float((shape ** 2).sum()))  # Cauchy-Schwarz: the gain of w proportional to p
    assert selection_gain(shape, (shape * 1000).tolist(), C) == pytest.approx(best)
    out = suggest_selection_weights(shape, C)
    w = out["weights"]
    assert all(isinstance(x, int) and x >= 0 for x in w) and w == sorted(w, reverse=True) and w[0] > w[-1]
    assert best * 0.98 <= out["gain"] <= best and out["gain"] > 1.2


def test_the_synthetic_workloads_shape_gives_its_headline_gain():
    """The paper's workload's shape (slot shares at 1M users, seed 1): the suggestion does at
    least as well as the hand-made headline weights [5, 4, 3, 2, 2, 2, 1, ...] (1.63x)."""
    shape = np.array([0.1673, 0.1353, 0.1103, 0.0904, 0.0747, 0.0621, 0.0519, 0.0437, 0.0369, 0.0313, 0.0267, 0.0229,
                      0.0196, 0.0169, 0.0147, 0.0127, 0.0111, 0.0097, 0.0085, 0.0075, 0.0066, 0.0059, 0.0052, 0.0046,
                      0.0041, 0.0037, 0.0033, 0.003, 0.0027, 0.0024, 0.0022, 0.002])
    shape /= shape.sum()
    headline = selection_gain(shape, [5, 4, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1], 32)
    assert headline == pytest.approx(1.63, abs=0.01)
    assert suggest_selection_weights(shape, 32)["gain"] >= headline


def test_the_preview_reads_the_shape_by_distinct_keys_in_line_order(tmp_path):
    """Each user: key a twice, then b, then c (one record each). Slots are distinct keys in line
    order, a repeat takes none: the shape is 1/3 per slot for the first three."""
    rows = []
    for u in range(60):
        for j, k in enumerate(["a", "a", "b", "c"]):
            rows.append({"user_id": f"u{u}", "key": k, "ts": START + 1000 * (4 * u + j)})
    sample = tmp_path / "s.jsonl"
    sample.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"queries": [{"name": "q", "window": "1d", "triggers": 4, "epsilon": 3.0, "delta": 1e-9, "contribution_bound": 4,
                           "per_key_bound": 1}]}
    [q] = dpstream.preview(config, sample)["queries"]
    w = q["suggested_selection_weights"]
    assert w["shape"] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert w["weights"] == [1, 1, 1] and w["gain"] == pytest.approx(selection_gain(np.array(w["shape"]), [1, 1, 1], 4))
