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
