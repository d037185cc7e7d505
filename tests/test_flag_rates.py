"""Recall against false flags of a confidence floor, on hand-made (confidence, wrong) lists."""

from __future__ import annotations

import json
import math

from nowait.flag_rates import below, floor_rates, floor_report, routed_report, sweep_floors

# Four wrong answers (two unsure, one sure, one without a confidence) and four right ones (one unsure).
CONFIDENCES = [0.2, 0.4, 0.95, None, 0.3, 0.9, 0.99, 1.0]
WRONG = [True, True, True, True, False, False, False, False]


def test_recall_and_false_flags_count_each_class_below_the_floor():
    rates = floor_rates(CONFIDENCES, WRONG, 0.5)
    assert (rates.wrong, rates.wrong_flagged, rates.correct, rates.correct_flagged) == (4, 2, 4, 1)
    assert rates.recall == 0.5 and rates.false_flag_rate == 0.25
    assert rates.meets_goal is False  # recall reached, but a quarter of the right answers flagged


def test_the_floor_is_strict_and_no_confidence_is_never_flagged_but_nan_is():
    assert not below(0.5, 0.5) and below(0.4999, 0.5)
    assert not below(None, 1.0) and below(math.nan, 0.0)
    assert floor_rates([0.5], [True], 0.5).wrong_flagged == 0


def test_the_goal_needs_the_recall_and_few_false_flags_both():
    rates = floor_rates(CONFIDENCES, WRONG, 0.25)
    assert rates.recall == 0.25 and rates.false_flag_rate == 0.0 and rates.meets_goal is False
    caught = floor_rates([0.1, 0.2, 0.9, 0.95, 0.99], [True, True, True, False, False], 0.5)
    assert caught.recall == 0.6667 and caught.false_flag_rate == 0.0 and caught.meets_goal is True


def test_no_wrong_answers_leaves_the_recall_undefined_not_zero_or_one():
    rates = floor_rates([0.1, 0.9], [False, False], 0.5)
    assert rates.recall is None and rates.meets_goal is None
    assert rates.false_flag_rate == 0.5


def test_no_correct_answers_leaves_the_false_flag_rate_and_the_goal_undefined():
    rates = floor_rates([0.1, 0.9], [True, True], 0.5)
    assert rates.false_flag_rate is None and rates.recall == 0.5 and rates.meets_goal is None
    assert floor_rates([0.1, 0.9], [True, True], 1.0).meets_goal is None  # flagging all proves nothing


def test_no_answers_at_all_give_no_rates():
    rates = floor_rates([], [], 0.5)
    assert (rates.recall, rates.false_flag_rate, rates.meets_goal) == (None, None, None)
    assert floor_report([], [], 0.5, [0.5])["at_floor"]["recall"] is None


def test_the_sweep_holds_the_default_floor_once_in_order():
    assert sweep_floors([0.5]) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert sweep_floors([0.35, 0.5], sweep=(0.9, 0.1)) == [0.1, 0.35, 0.5, 0.9]


def test_an_engines_report_names_the_floors_of_the_sweep_that_meet_the_goal():
    report = floor_report([0.1, 0.2, 0.9, 0.95, 0.99], [True, True, True, False, False], 0.5, [0.1, 0.5, 0.97])
    assert report["n"] == 5 and report["at_floor"]["recall"] == 0.6667
    assert [r["floor"] for r in report["sweep"]] == [0.1, 0.5, 0.97]
    assert report["floors_meeting_goal"] == [0.5]  # 0.1 catches too few, 0.97 flags a right answer in two
    json.dumps(report, allow_nan=False)  # the report is plain JSON


def test_returned_answers_at_the_default_are_each_judged_by_their_own_engines_floor():
    # A diffusion answer at 0.6 under diffusion's floor of 0.7, an AR answer at 0.6 above AR's 0.5.
    report = routed_report([0.6, 0.6, 0.99], [True, True, False], ["diffusion", "ar", "ar"],
                           {"diffusion": 0.7, "ar": 0.5}, [0.5, 0.7])
    assert report["at_floor"]["wrong_flagged"] == 1 and report["at_floor"]["recall"] == 0.5
    assert report["at_floor"]["floor"] is None  # the engines' floors differ
    assert [r["wrong_flagged"] for r in report["sweep"]] == [0, 2]  # one floor for both in the sweep
    json.dumps(report, allow_nan=False)
