"""tools/selection_steps.py: the NumPy model of the selection's threshold search."""

import numpy as np
import pytest

from tools.selection_steps import main, order_keys, search


def test_the_search_finds_a_sorts_threshold_in_fewer_steps(capsys):
    """Every case's tau equals a sort's (main checks it), and no case needs the 32 steps
    of the fixed bisection; bad input is one error line."""
    assert main(["--trials", "2"]) == 0
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 16 and all(int(r[6]) < 32 for r in rows)
    assert main(["--trials", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --trials must be positive"


@pytest.mark.parametrize("k", [1, 5, 8, 10])
def test_order_keys_and_the_search_on_a_small_case(k):
    scores = np.array([0.5, -1.0, 2.0, 2.0, -np.inf, 0.0], dtype=np.float32)
    key = order_keys(scores)
    assert list(np.argsort(key, kind="stable")) == list(np.argsort(scores, kind="stable"))
    cnt = np.array([2, 2, 2, 2, 0, 2])
    tau, steps = search(key, cnt, k)
    # keys descending with slots: 2.0 (4 slots), 0.5 (2), 0.0 (2), -1.0 (2); -inf has none
    expect = {1: 2.0, 5: 0.5, 8: 0.0, 10: -1.0}[k]  # 10: every slot
    assert tau == order_keys(np.array([expect], dtype=np.float32))[0] and 0 < steps <= 32
