"""Figures over seeds (sim/spread.py): mean, spread and the 95% interval of the mean."""

from __future__ import annotations

import math

import pytest
from pearl.sim.spread import spread, t95

pytestmark = pytest.mark.unit


def test_t_quantiles_match_the_tables_and_tend_to_the_normal():
    assert t95(1) == pytest.approx(12.706)
    assert t95(4) == pytest.approx(2.776)
    assert t95(30) == pytest.approx(2.042)
    assert t95(1000) == pytest.approx(1.96)
    with pytest.raises(ValueError):
        t95(0)


def test_five_values_give_the_student_interval():
    s = spread([1, 2, 3, 4, 5])
    assert s.mean == 3 and s.sd == pytest.approx(math.sqrt(2.5))
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert s.ci95 == pytest.approx((3 - half, 3 + half))
    assert s.spans(1.1) is True and s.spans(0.9) is False
    assert s.as_dict()["ci95"] == [round(3 - half, 4), round(3 + half, 4)]


def test_one_value_has_no_interval():
    s = spread([2.5])
    assert s.mean == 2.5 and s.sd is None and s.ci95 is None and s.spans(2.5) is None


def test_identical_values_have_a_zero_width_interval():
    s = spread([1.0, 1.0, 1.0])
    assert s.ci95 == (1.0, 1.0) and s.spans(1.0) is True
