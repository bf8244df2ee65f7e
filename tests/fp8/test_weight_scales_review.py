"""The issue 41 review's attacks on WeightScales (2 gloo ranks, FSDP2 float8 all-gather).

Oracle (``_review_ranks``, as ``_loop_ranks``): before every forward, every rank counts its
shards' elements with ``|w| * scale_used > 448``; the exact scale ``448 / max|w|`` comes from
the test's own all-reduce outside the step. A sound scale is never above the exact one.
"""

from __future__ import annotations

import pytest

from tests.fp8 import _review_ranks
from tests.multirank import run_ranks

LOOPS = ("exact_adamw", "bound_adamw", "bound_amsgrad")


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("review41")


@pytest.fixture(scope="module")
def runs(directory):
    """Every 2-rank scenario in one spawn (the resume test's save too)."""
    return run_ranks(_review_ranks.attacks, str(directory), timeout_s=600.0)


def _saturated(runs, scenario):
    return [a + b for a, b in zip(runs[0][scenario]["saturated"], runs[1][scenario]["saturated"])]


@pytest.mark.parametrize("scenario", LOOPS)
def test_no_element_saturates_under_schedules_skips_clipping_and_late_groups(runs, scenario):
    """Clipping, a beta change on the step rank 1 overflows (every rank skips), lr < 0 after
    the schedule's end, eps and decay changed, add_param_group, set_to_none alternating, a
    float8 weight without grad: 0 saturated, used <= exact, the same scales on both ranks."""
    run = runs[0][scenario]
    assert run["skipped"][3] and not any(run["skipped"][:3] + run["skipped"][4:])
    assert run["lr"] < 0  # the schedule did run past its end
    assert _saturated(runs, scenario) == [0] * 11
    assert runs[0][scenario]["used"] == runs[1][scenario]["used"]
    worst = max(u / e for us, es in zip(run["used"], run["exact"]) for u, e in zip(us, es))
    assert worst <= 1.0, worst


def test_a_rollback_with_torchs_state_dict_api_does_not_saturate(runs):
    """set_model_state_dict + set_optimizer_state_dict to a snapshot of larger weights: the
    load measures the scales (on 2ecb776 3054 elements saturated at the first forward after
    it, used 2.23x exact: the scales of the weights before the load)."""
    assert _saturated(runs, "rollback") == [0] * 9


def test_another_object_under_the_reserved_key_is_refused_on_every_rank(runs):
    """extra={'fp8_weight_scales': a Linear} beside the scaler's own WeightScales."""
    for rank in (0, 1):
        out = runs[rank]["other_object"]
        assert out["refusal"] != "no error", out
        assert "fp8_weight_scales" in out["refusal"], out["refusal"]
    assert runs[0]["other_object"]["written"] == []


def test_one_rank_resumes_a_two_rank_checkpoint_in_a_beta_schedule(runs, directory):
    """Saved by 2 ranks at step 4, one step after betas changed; resumed on 1 rank: the
    scales and the bound's state load as saved (agreed numbers, not per rank), nothing
    saturates in the first forward or after, and no step needs a measurement."""
    two = {rank: runs[rank]["save_two"] for rank in (0, 1)}  # saved in the module's spawn
    saved = f"{directory}/resume"
    one = run_ranks(_review_ranks.resume_one, saved, world_size=1, timeout_s=300.0)[0]
    assert two[0]["saturated"] == two[1]["saturated"] == [0] * 5
    for key in ("names", "shapes", "scales", "ratio_sq", "steps"):
        assert two[0]["saved"][key].equal(one["loaded"][key]), key
    assert one["used"][0] == two[0]["saved"]["scales"].tolist()
    assert one["saturated"] == [0] * 5
    assert one["measured"] == 0


def test_two_weight_scales_on_one_scaler_are_refused_unless_both_are_named(runs):
    """Two models on one scaler (torch's multi-model recipe), a WeightScales each: only one
    would travel under 'fp8_weight_scales' (on 2ecb776 the first was dropped without a word,
    its resume casting with fresh scales). The save refuses on every rank, writing nothing;
    both named in extra= are saved."""
    for rank in (0, 1):
        out = runs[rank]["two_models"]
        assert out["refusal"].startswith("ValueError: the scaler has 2 live WeightScales"), out
        assert out["written"] == [], out
        assert out["named"] == ["step-1"], out
