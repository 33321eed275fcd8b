"""`sim run --plot` and `sim compare --plot`: one colour per worker state in every panel, shared
scales, labels that say what is drawn, and the legend beside the data rather than over it."""

from __future__ import annotations

import pytest
from matplotlib.colors import to_rgb
from pearl.sim.experiments import run_system
from pearl.sim.plot import (
    AVAILABLE_LABEL,
    STATE_COLOURS,
    STATE_LABELS,
    STEP_LABEL,
    THROUGHPUT_LABEL,
    comparison_figure,
    run_figure,
)
from pearl.sim.scenario import load_scenario

pytestmark = pytest.mark.unit

LABEL_STATE = {label: state for state, label in STATE_LABELS.items()}


@pytest.fixture(scope="module")
def results():
    """Three systems on a short seg2 run: static, elastic, and borrowing (every kind of panel)."""
    sc = load_scenario("paper-qwen3-8b-seg2", ["duration_s=900"])
    return {name: run_system(sc, name) for name in ("roll", "rlboost-plus", "pearl")}


def _fleet_panels(fig):
    return [ax for ax in fig.axes if ax.get_ylabel() == "GPUs serving rollout"]


def test_comparison_uses_one_colour_per_state_and_one_scale(results) -> None:
    fig = comparison_figure(results)
    panels = _fleet_panels(fig)
    assert len(panels) == 3
    states_seen = set()
    for ax in panels:
        for area in ax.collections:
            state = LABEL_STATE[area.get_label()]
            states_seen.add(state)
            assert to_rgb(area.get_facecolor()[0]) == pytest.approx(to_rgb(STATE_COLOURS[state]))
    assert {"dedicated/colocated", "overlap/colocated"} <= states_seen  # pearl borrowed
    assert len({ax.get_ylim() for ax in panels}) == 1
    twins = [ax for ax in fig.axes if ax.get_ylabel() == "generated tok/s"]
    assert len(twins) == 3 and len({ax.get_ylim() for ax in twins}) == 1
    state_rgbs = {to_rgb(c) for c in STATE_COLOURS.values()}
    for ax in twins:  # lines never take a state's colour
        assert all(to_rgb(line.get_color()) not in state_rgbs for line in ax.get_lines())
    # the metric per system is drawn once, as bars, not as overlaid lines
    bars = fig.axes[0]
    assert [t.get_text() for t in bars.get_yticklabels()] == ["pearl", "rlboost-plus", "roll"]
    assert not bars.get_lines()


def test_legend_is_beside_the_data_and_names_every_mark(results) -> None:
    for fig in (comparison_figure(results), run_figure(results["pearl"])):
        assert all(ax.get_legend() is None for ax in fig.axes)
        (legend,) = fig.legends
        fig.canvas.draw()
        right = max(ax.get_window_extent().x1 for ax in fig.axes)
        assert legend.get_window_extent().x0 >= right
        texts = [t.get_text() for t in legend.get_texts()]
        assert {THROUGHPUT_LABEL, STEP_LABEL, AVAILABLE_LABEL, STATE_LABELS["overlap/colocated"]} <= set(texts)
        assert not any(t.startswith(("dedicated/", "overlap/")) for t in texts)  # words, not the keys


def test_run_title_and_axis_say_what_is_counted(results) -> None:
    fig = run_figure(results["pearl"])
    top = fig.axes[0]
    assert "generated + trained tokens of completed training steps" in top.get_title()
    assert top.get_ylabel() == "generated tokens/s"
    assert fig.axes[1].get_xlabel() == "simulated minutes"


def test_over_several_seeds_the_bars_are_means_with_their_intervals(results) -> None:
    intervals = {"roll": (1000.0, 900.0, 1150.0), "rlboost-plus": (1500.0, 1400.0, 1600.0),
                 "pearl": (2500.0, 2300.0, 2700.0)}
    fig = comparison_figure(results, intervals, [1, 2, 3])
    bars = fig.axes[0]
    assert "95% intervals" in bars.get_title() and "1, 2, 3" in bars.get_title()
    widths = [p.get_width() for p in bars.patches]
    assert widths == [2500.0, 1500.0, 1000.0]  # the means, pearl on top
    (errors,) = [c for c in bars.containers if hasattr(c, "has_xerr") and c.has_xerr]
    segments = errors.lines[2][0].get_segments()  # one horizontal segment per bar: low to high
    assert sorted((round(s[0][0]), round(s[1][0])) for s in segments) == [(900, 1150), (1400, 1600), (2300, 2700)]
    labels = [t.get_text() for t in bars.texts]
    assert "2,500 [2,300, 2,700]" in labels
    assert any("(seed 1)" in ax.get_title() for ax in fig.axes[1:])
