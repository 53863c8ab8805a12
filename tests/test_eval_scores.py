"""mean@n and pass@k (app/evaluation/scores.py) against values computed by hand."""

from __future__ import annotations

import pytest

from app.evaluation.scores import PromptRewards, ks_for, metric_items, pass_at_k, score


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # k=1 is the fraction that passes
    assert pass_at_k(4, 3, 1) == pytest.approx(0.75)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # all four drawn: the one passing sample is among them
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a passing sample


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_score_per_source_and_all_by_hand():
    prompts = [
        PromptRewards("a", [1.0, 0.0, 0.0, 0.0]),  # c=1
        PromptRewards("a", [1.0, 1.0, 0.0, 0.0]),  # c=2
        PromptRewards("b", [0.0, 0.0, 0.0, 0.0]),  # c=0
        PromptRewards("b", [0.5, 1.0, 0.5, 1.0]),  # c=2 at threshold 1 (0.5 does not pass)
    ]
    s = score(prompts, ks=[1, 2], threshold=1.0)
    assert set(s) == {"a", "b", "all"}
    # a: means 1/4 and 2/4 -> 0.375; pass@1: (1/4 + 2/4)/2; pass@2: (1/2 + 5/6)/2
    assert s["a"]["mean_at_4"] == pytest.approx(0.375)
    assert s["a"]["pass_at_1"] == pytest.approx(0.375)
    assert s["a"]["pass_at_2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert s["a"]["prompts"] == 2
    # b: means 0 and 3/4 -> 0.375; pass@1: (0 + 2/4)/2 = 0.25; pass@2: (0 + 5/6)/2
    assert s["b"]["mean_at_4"] == pytest.approx(0.375)
    assert s["b"]["pass_at_1"] == pytest.approx(0.25)
    assert s["b"]["pass_at_2"] == pytest.approx(5 / 12)
    # all four prompts
    assert s["all"]["mean_at_4"] == pytest.approx(0.375)
    assert s["all"]["pass_at_1"] == pytest.approx((0.25 + 0.5 + 0 + 0.5) / 4)
    assert s["all"]["pass_at_2"] == pytest.approx((0.5 + 5 / 6 + 0 + 5 / 6) / 4)
    assert s["all"]["prompts"] == 4
    # a lower threshold lets 0.5 pass: b's second prompt has c=4
    assert score(prompts, [1], threshold=0.5)["b"]["pass_at_1"] == pytest.approx(0.5)


def test_score_refuses_uneven_groups_and_large_k():
    with pytest.raises(ValueError, match="same number of samples"):
        score([PromptRewards("a", [1.0, 0.0]), PromptRewards("a", [1.0])], [1], 1.0)
    with pytest.raises(ValueError, match=r"1 <= k <= n = 2"):
        score([PromptRewards("a", [1.0, 0.0])], [3], 1.0)
    assert score([], [1], 1.0) == {}


def test_metric_names_and_ks():
    s = score([PromptRewards("gsm8k", [1.0, 0.0])], [1, 2], 1.0)
    assert metric_items(s, "val") == {
        "val/gsm8k/mean_at_2": 0.5,
        "val/gsm8k/pass_at_1": 0.5,
        "val/gsm8k/pass_at_2": 1.0,
        "val/all/mean_at_2": 0.5,
        "val/all/pass_at_1": 0.5,
        "val/all/pass_at_2": 1.0,
    }
    assert ks_for([8, 1, 2, 1], 4) == [1, 2]


def test_the_record_and_the_tracker_name_each_score_alike():
    """RESULT's and scores.json's names are MLflow's: `eval/<source>/<name>` for each name of the record."""
    s = score([PromptRewards("arith", [1.0, 0.0, 0.0, 0.0])], [1, 4], 1.0)
    assert set(s["arith"]) == {"mean_at_4", "pass_at_1", "pass_at_4", "prompts"}
    items = metric_items(s, "eval")
    assert {f"eval/{src}/{k}" for src, v in s.items() for k in v if k != "prompts"} == set(items)
    assert not any("@" in name for name in items)


def test_pass_at_k_per_prompt_by_hand():
    from app.evaluation.scores import per_prompt

    got = per_prompt([("a", [1.0, 0.0, 0.0, 1.0]), ("b", [0.0] * 4)], [1, 2, 4], 1.0)
    assert got["a"] == {
        "passed": 2.0,
        "n": 4.0,
        "pass_at_1": 0.5,
        "pass_at_2": pytest.approx(5 / 6),
        "pass_at_4": 1.0,
    }
    assert got["b"] == {"passed": 0.0, "n": 4.0, "pass_at_1": 0.0, "pass_at_2": 0.0, "pass_at_4": 0.0}


def test_sub_score_means_over_the_samples_that_report_them():
    from app.evaluation.scores import sub_score_means

    extras = [{"strict": 1.0, "flexible": 1.0}, {"strict": 0.0, "flexible": 1.0}, {}, {"flexible": 0.0}]
    assert sub_score_means(extras, "val/sub/") == {
        "val/sub/flexible": pytest.approx(2 / 3),
        "val/sub/strict": 0.5,
    }
