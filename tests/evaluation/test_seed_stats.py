"""fgrpo.evaluation.seed_stats and seed_planner: the paired over-seeds test, the planner, its projection to another
evaluation design and the variance split against hand computations, known values and simulated sweeps with known
components."""

import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fgrpo.evaluation.seed_planner import (VARIANCE_FLOOR, _Design, binomial_sampling_variance, clamped,
                                           expected_half_width, paired_interaction, paired_t_power, pairs_needed,
                                           plan_text, projected_sampling_variance, projected_variance,
                                           sd_upper_limit)
from fgrpo.evaluation.seed_stats import (check_same_eval_settings, config_cells, paired_seed_test, paired_values,
                                         per_problem_pass_at_k, sampling_variance, sign_flip_p, variance_split)
from fgrpo.evaluation.sweep_runs import ReportError, Run


# ---------------------------------------------------------------- paired test


def test_paired_test_matches_a_hand_computation():
    test = paired_seed_test([3.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # differences 2, 2, 3
    mean, se = 7 / 3, np.sqrt(1 / 3) / np.sqrt(3)
    half = stats.t.ppf(0.975, 2) * se
    np.testing.assert_allclose(test.differences, [2, 2, 3])
    assert test.mean == pytest.approx(mean)
    assert (test.ci_low, test.ci_high) == pytest.approx((mean - half, mean + half))
    assert test.t_p == pytest.approx(2 * stats.t.sf(mean / se, 2))  # t = 7, p = 0.0198
    assert test.sign_flip_p == 0.25 and test.exact  # 3 pairs, all positive: 2 of the 8 flips are as extreme


def test_sign_flip_p_is_exact_over_all_flips():
    assert sign_flip_p([1.0, 2.0, 3.0]) == 0.25
    assert sign_flip_p([0.5, 0.5, 0.5, 0.5, 0.5]) == pytest.approx(2 / 32)
    differences = np.array([1.0, -1.0, 2.0, 5.0])
    flips = np.array(list(itertools.product([1, -1], repeat=4)))
    means = (flips * differences).mean(axis=1)
    observed = differences.mean()
    by_hand = min(1.0, 2 * min(np.mean(means >= observed - 1e-12), np.mean(means <= observed + 1e-12)))
    assert sign_flip_p(differences) == pytest.approx(by_hand)
    sampled = sign_flip_p([1.0, 2.0, 3.0], exact_up_to=2, resamples=20_000)  # random flips beyond exact_up_to
    assert sampled == pytest.approx(0.25, abs=0.02)


def test_paired_test_without_spread_and_bad_shapes():
    same = paired_seed_test([0.5, 0.7], [0.2, 0.4])
    assert same.t_p == 0.0 and same.ci_low == same.ci_high == pytest.approx(0.3) and same.sign_flip_p == 0.5
    nothing = paired_seed_test([0.5, 0.7], [0.5, 0.7])
    assert nothing.t_p == 1.0 and nothing.sign_flip_p == 1.0 and nothing.mean == 0.0
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_seed_test([1.0], [2.0])
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_seed_test([1.0, 2.0], [2.0, 3.0, 4.0])


# ---------------------------------------------------------------- planner


def test_pairs_needed_known_values():
    assert pairs_needed(1.0, 1.0, 0.05, 0.8) == 10  # the textbook paired t-test at d = 1
    assert paired_t_power(10, 1.0, 1.0, 0.05) > 0.8 > paired_t_power(9, 1.0, 1.0, 0.05)
    assert pairs_needed(2.0, 4.0, 0.05, 0.8) == 34  # d = 0.5 (G*Power: 34)
    assert pairs_needed(1.0, 10.0, 0.01, 0.8) is None  # d = 0.1 needs far more than 100
    assert paired_t_power(7, 0.0, 1.0, 0.05) == pytest.approx(0.05)  # no effect: the test's level
    with pytest.raises(ValueError, match="effect > 0"):
        pairs_needed(0.0, 1.0, 0.05, 0.8)


def test_power_has_no_nan_where_scipys_lower_tail_has():
    assert paired_t_power(4, 4.0, np.sqrt(1.19), 0.01) == pytest.approx(0.789, abs=0.001)  # nct.cdf gave nan here
    assert 0.5 < paired_t_power(3, 4.0, 0.8, 0.01) < 0.6


def test_expected_half_width_matches_simulation():
    rng = np.random.default_rng(0)
    samples = rng.normal(0.0, 2.0, size=(200_000, 5))
    half_widths = stats.t.ppf(0.95, 4) * samples.std(axis=1, ddof=1) / np.sqrt(5)
    assert expected_half_width(5, 2.0) == pytest.approx(half_widths.mean(), rel=0.005)
    assert expected_half_width(5, 2.0) < stats.t.ppf(0.95, 4) * 2.0 / np.sqrt(5)  # E[s] < sd


# ---------------------------------------------------------------- variance split


@pytest.mark.parametrize("k", [1, 4, 8])
def test_sampling_variance_is_unbiased_where_2k_fits_in_n(k):
    n, theta = 16, 0.3
    counts = np.arange(n + 1)
    pmf = stats.binom.pmf(counts, n, theta)
    estimates = per_problem_pass_at_k(counts, n, k)
    true_variance = pmf @ estimates ** 2 - (pmf @ estimates) ** 2
    assert pmf @ sampling_variance(counts, n, k) == pytest.approx(true_variance, rel=1e-9)


def test_sampling_variance_beyond_n_over_2_is_the_binomial_bootstrap():
    n = 16
    counts = np.array([0, 1, 5, 16])
    missed = (1 - counts / n) ** n  # pass@16 of 16 samples is "any correct": bootstrap var q (1 - q)
    np.testing.assert_allclose(sampling_variance(counts, n, n), missed * (1 - missed), atol=1e-12)
    np.testing.assert_allclose(sampling_variance(counts, n, 1), counts * (n - counts) / (n ** 2 * (n - 1)))


# ---------------------------------------------------------------- projection to another evaluation design


@pytest.mark.parametrize(("n", "k"), [(6, 2), (5, 1), (4, 4)])
def test_binomial_sampling_variance_matches_brute_force_enumeration(n, k):
    p = 0.3
    values, weights = [], []
    for outcome in itertools.product([0, 1], repeat=n):  # every sequence of n samples
        # pass@k by definition: the share of the k-subsets of the samples with a correct one
        values.append(np.mean([any(outcome[i] for i in subset) for subset in itertools.combinations(range(n), k)]))
        weights.append(p ** sum(outcome) * (1 - p) ** (n - sum(outcome)))
    values, weights = np.array(values), np.array(weights)
    brute = weights @ values ** 2 - (weights @ values) ** 2
    assert binomial_sampling_variance(p, n, k) == pytest.approx(brute, rel=1e-12)
    assert binomial_sampling_variance([0.0, 1.0], n, k) == pytest.approx([0.0, 0.0], abs=1e-15)


@pytest.mark.parametrize("new_n", [3, 8, 12, 40])
def test_projected_sampling_variance_is_unbiased_and_the_splits_own_at_the_pilots_n(new_n):
    n, k, counts = 12, 3, np.arange(13)
    for p in (0.05, 0.5, 0.9):
        expected = stats.binom.pmf(counts, n, p) @ projected_sampling_variance(counts, n, new_n, k)
        assert expected == pytest.approx(binomial_sampling_variance(p, new_n, k), rel=1e-9, abs=1e-15)
    np.testing.assert_allclose(projected_sampling_variance(counts, n, n, k), sampling_variance(counts, n, k),
                               atol=1e-13)
    # 2k > n: no unbiased estimate; p = c / n plugged in, at new_n = n the split's bootstrap
    np.testing.assert_allclose(projected_sampling_variance(counts, n, n, 8), sampling_variance(counts, n, 8),
                               atol=1e-13)


def test_projected_sampling_variance_refuses_k_above_the_new_n():
    with pytest.raises(ValueError, match="1 <= k <= n samples; got k=16, n=8"):
        projected_sampling_variance(np.array([3, 40]), 64, 8, 16)
    with pytest.raises(ValueError, match="k <= n"):
        binomial_sampling_variance(0.5, 8, 16)
    runs = [Run(Path(f"/runs/{seed}"), {"algo.name": "grpo", "focal.gamma": 0.0, "seed": seed},
                [{"step": 2, "eval/pass@16": 0.5 + 0.1 * seed}]) for seed in (0, 1)]
    with pytest.raises(ReportError) as error:
        plan_text(runs, effect=4.0, alpha=0.01, power=0.8, metric="pass@16", samples=8)
    assert str(error.value) == ("--samples 8 is below k = 16 of --metric pass@16: the unbiased pass@k needs at least "
                                "k samples per problem")


def test_projection_to_the_pilots_design_is_the_pilot_and_4x_problems_quarter_the_problem_parts():
    seed_part, interaction, sampling, problems = 3.0, 500.0, 60.0, 60  # points², the last two per problem
    pilot = seed_part + 2 * (interaction + sampling) / problems
    assert projected_variance(pilot, interaction, sampling, sampling, problems, problems) == pytest.approx(pilot)
    four_times = projected_variance(pilot, interaction, sampling, sampling, problems, 4 * problems)
    assert four_times - seed_part == pytest.approx((pilot - seed_part) / 4)
    fewer_samples = projected_variance(pilot, interaction, sampling, 3 * sampling, problems, 4 * problems)
    assert fewer_samples - four_times == pytest.approx(2 * 2 * sampling / (4 * problems))
    assert clamped(pilot - 100) == (VARIANCE_FLOOR, True) and clamped(pilot) == (pilot, False)
    # from counts: the sampling part pooled over the tables at the pilot's own n is the split's, so V' = V
    tables, _ = simulate_cells(0.04, 0.08, cells=5)
    split = variance_split(tables, 32, 4)
    design = _Design(pilot, 1e4 * split.interaction * 40, tables, 32, 4, 40, 40)
    assert design.sampling(32) == pytest.approx(1e4 * split.sampling * 40)
    assert design.variance(32) == (pytest.approx(pilot), False)
    assert design.sampling(16) > design.sampling(32)


@pytest.mark.parametrize("shared", [False, True])
def test_paired_interaction_sees_a_problem_x_seed_part_that_the_pair_shares(shared):
    rng = np.random.default_rng(2)
    pairs, half = [], 0.08 * np.sqrt(3)  # interaction sd 0.08, uniform
    for _ in range(200):
        base = rng.uniform(0.35, 0.65, 40)[None, :] + rng.uniform(-0.07, 0.07, (3, 1))
        own = rng.uniform(-half, half, (3, 40))
        other = own if shared else rng.uniform(-half, half, (3, 40))
        pairs.append((rng.binomial(32, base + own), rng.binomial(32, base + 0.05 + other)))
    interaction, df = paired_interaction(pairs, 32, 1)
    assert df == 200 * 2 * 39
    assert interaction == (pytest.approx(0.0, abs=0.0004) if shared else pytest.approx(0.08 ** 2, rel=0.1))


def simulate_cells(seed_sd: float, interaction_sd: float, *, cells=300, seeds=3, problems=40, n=32, rng_seed=0):
    """[cells] arrays [seeds, problems] of counts with success rate base_p + seed shift + seed x problem shift
    (uniform, so no clipping), and the true run-level variances (seed, interaction / P, sampling)."""
    rng = np.random.default_rng(rng_seed)
    half_seed, half_interaction = seed_sd * np.sqrt(3), interaction_sd * np.sqrt(3)
    tables, sampling = [], []
    for _ in range(cells):
        base = rng.uniform(0.35, 0.65, problems)
        theta = (base[None, :] + rng.uniform(-half_seed, half_seed, (seeds, 1))
                 + rng.uniform(-half_interaction, half_interaction, (seeds, problems)))
        tables.append(rng.binomial(n, theta))
        sampling.append(np.mean(np.sum(theta * (1 - theta) / n, axis=1)) / problems ** 2)
    return tables, (seed_sd ** 2, interaction_sd ** 2 / problems, float(np.mean(sampling)))


@pytest.mark.parametrize("seed_sd", [0.04, 0.0])
def test_variance_split_recovers_known_components(seed_sd):
    tables, (seed, interaction, sampling) = simulate_cells(seed_sd, 0.08)
    split = variance_split(tables, 32, 1)
    run = seed + interaction + sampling
    assert split.run_df == 600 and split.interaction_df == 600 * 39 and split.cells == 300
    assert split.run == pytest.approx(run, rel=0.15)
    assert split.sampling == pytest.approx(sampling, rel=0.03)
    assert split.interaction == pytest.approx(interaction, rel=0.1)
    assert split.seed == pytest.approx(seed, abs=0.1 * run)
    assert split.run == pytest.approx(split.seed + split.interaction + split.sampling)
    assert split.method == "unbiased"


def test_variance_split_run_part_is_the_pooled_variance_of_run_values():
    rng = np.random.default_rng(1)
    tables = [rng.binomial(16, 0.4, (3, 10)), rng.binomial(16, 0.6, (2, 10)), rng.binomial(16, 0.5, (1, 10))]
    split = variance_split(tables, 16, 4)
    runs = [per_problem_pass_at_k(t, 16, 4).mean(axis=1) for t in tables]
    by_hand = (np.var(runs[0], ddof=1) * 2 + np.var(runs[1], ddof=1)) / 3  # the one-seed cell adds nothing
    assert split.run == pytest.approx(by_hand) and split.run_df == 3 and split.cells == 2
    with pytest.raises(ValueError, match="two or more seeds"):
        variance_split([tables[2]], 16, 4)
    with pytest.raises(ValueError, match="share their problems"):
        variance_split([tables[0], rng.binomial(16, 0.5, (2, 9))], 16, 4)


# ---------------------------------------------------------------- from runs


def make_run(algo: str, gamma: float, seed: int, pass_at_1: float, n_samples: int = 4) -> Run:
    config = {"algo.name": algo, "focal.gamma": gamma, "seed": seed, "eval.n_samples": n_samples,
              "eval.max_problems": 60, "dataset.name": "arithmetic", "trainer.steps": 2}
    return Run(Path(f"/runs/{algo}_{gamma}_{seed}"), config, [{"step": 2, "eval/pass@1": pass_at_1}])


def test_paired_values_need_the_same_seeds_and_pair_by_seed():
    runs = [make_run("grpo", 0.0, s, 0.1 * s) for s in (0, 1, 2)] + [make_run("grpo", 1.0, s, 0.5) for s in (1, 0)]
    cells = config_cells(runs)
    key, base = sorted(cells, key=lambda k: k[0][2], reverse=True)
    with pytest.raises(ReportError) as error:
        paired_values(cells, key, base, "pass@1")
    assert str(error.value).startswith("paired test over seeds: grpo, gamma=1 has seeds 0, 1 but grpo, gamma=0 has "
                                       "seeds 0, 1, 2;")
    assert "\n" not in str(error.value)
    cells = config_cells(runs[:2] + runs[3:])
    seeds, a, b = paired_values(cells, key, base, "pass@1")
    assert seeds == ["0", "1"] and list(a) == [50.0, 50.0] and list(b) == pytest.approx([0.0, 10.0])


def test_eval_settings_must_match():
    runs = [make_run("grpo", 0.0, 0, 0.1), make_run("grpo", 0.0, 1, 0.2), make_run("grpo", 1.0, 0, 0.3, n_samples=8)]
    check_same_eval_settings(runs[:2])
    with pytest.raises(ReportError) as error:
        check_same_eval_settings(runs)
    message = str(error.value)
    assert "evaluation settings differ" in message and "eval.n_samples: 4 (2 runs), 8 (1 runs)" in message
    assert "\n" not in message


def test_plan_without_shared_seeds_uses_sqrt_2_seed_sd_and_names_a_missing_metric():
    runs = [make_run("grpo", 0.0, 0, 0.5), make_run("grpo", 0.0, 1, 0.7), make_run("grpo", 1.0, 2, 0.6),
            make_run("grpo", 1.0, 3, 0.6)]
    text = plan_text(runs, effect=5.0, alpha=0.05, power=0.8, metric="pass@1")
    # seed sd: gamma 0 has 50, 70 (variance 200), gamma 1 60, 60 (0): pooled sqrt(100) = 10, x sqrt(2) = 14.14
    assert ("sd of a per-seed difference: 14.14 points (no pair of cells shares two seeds: sqrt(2) x the pooled "
            "seed sd (10.00 points, 2 df") in text
    assert f"seed pairs needed: {pairs_needed(5.0, np.sqrt(200), 0.05, 0.8)} (power" in text
    text = plan_text(runs, effect=1.0, alpha=0.01, power=0.8, metric="pass@1")
    assert "seed pairs needed: more than 100 (power at 100: " in text
    assert "90% interval half-width expected under no effect at 100 pairs" in text
    with pytest.raises(ReportError, match=r"--metric pass@16: /runs/grpo_0.0_0 logged no eval/pass@16 \(it has "
                                          r"pass@1\)"):
        plan_text(runs, effect=5.0, alpha=0.05, power=0.8, metric="pass@16")


def test_the_step_size_control_is_paired_with_grpo_and_with_f_grpo_at_its_gamma():
    from fgrpo.evaluation.seed_stats import compared_pairs

    grpo, fgrpo, control = ((("grpo", m, g), ()) for m, g in (("focal", 0.0), ("focal", 1.0), ("mean_focal", 1.0)))
    pairs = compared_pairs({grpo: [], fgrpo: [], control: []})
    assert pairs == [(fgrpo, grpo), (control, grpo), (fgrpo, control)]  # F-GRPO minus the control: the reweighting
    assert compared_pairs({grpo: [], fgrpo: []}) == [(fgrpo, grpo)]


def test_plan_pools_the_paired_differences_and_names_both_cells_of_each_pair():
    values = {0.0: (50, 60, 70), 1.0: (55, 60, 80)}  # gamma 1 - gamma 0 per seed: +5, 0, +10
    runs = [make_run("grpo", g, s, v / 100) for g, row in values.items() for s, v in enumerate(row)]
    runs += [make_run("dapo", 0.0, s, 0.5) for s in range(3)] + [make_run("dapo", 1.0, s, 0.5) for s in range(3)]
    text = plan_text(runs, effect=5.0, alpha=0.05, power=0.8, metric="pass@1")
    # the differences' sd: grpo (+5, 0, +10): sum of squares 50; dapo (0, 0, 0): 0; pooled over 4 df: sqrt(12.5)
    assert (f"sd of a per-seed difference: {np.sqrt(12.5):.2f} points (the pooled sd of the per-seed paired "
            "differences, 4 df, over 2 pairs: ") in text
    assert "dapo, gamma=1 vs dapo, gamma=0 (3 seeds)" in text and "grpo, gamma=1 vs grpo, gamma=0 (3 seeds)" in text
    upper = np.sqrt(12.5) * np.sqrt(4 / stats.chi2.ppf(0.2, 4))  # the sd's 80% upper limit on its 4 df
    assert f"its 80% upper confidence limit (4 df): {upper:.2f} points" in text
    assert f"at the upper limit: seed pairs needed: {pairs_needed(5.0, upper, 0.05, 0.8)} (power" in text


def test_the_upper_limit_of_a_pilot_sd_covers_the_true_sd_at_its_confidence():
    """Browne's limit: over many pilots of 3 normal values (df 2), the true sd lies below the limit 80% of the time,
    where the sd itself lies below the true one more than half the time."""
    assert sd_upper_limit(1.0, 2) == pytest.approx(2.117, abs=1e-3) and sd_upper_limit(1.0, 4) == pytest.approx(
        1.558, abs=1e-3)
    sds = np.random.default_rng(0).normal(size=(20_000, 3)).std(axis=1, ddof=1)
    covered = np.mean([sd_upper_limit(sd, 2) >= 1.0 for sd in sds])
    assert abs(covered - 0.8) < 0.01 and np.mean(sds < 1.0) > 0.6
    with pytest.raises(ValueError, match="df >= 1"):
        sd_upper_limit(1.0, 0)
