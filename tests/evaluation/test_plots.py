"""fgrpo.evaluation.plots: one run's pass@k PNG and the sweep report's panels, drawn the same way."""

import pytest

pytest.importorskip("matplotlib")

from fgrpo.evaluation.pass_at_k import pass_at_k_curve  # noqa: E402
from fgrpo.evaluation.plots import _log2_ticks, plot_pass_at_k, plot_pass_at_k_panels  # noqa: E402


def test_plot_pass_at_k_writes_a_png(tmp_path):
    from matplotlib.image import imread

    ks = [1, 2, 4, 8, 16]
    before = [(k, 1 - 0.8**k, max(0.0, 1 - 0.8**k - 0.05), min(1.0, 1 - 0.8**k + 0.05)) for k in ks]
    after = [(k, 1 - 0.7**k, max(0.0, 1 - 0.7**k - 0.04), min(1.0, 1 - 0.7**k + 0.04)) for k in ks]
    path = tmp_path / "out" / "pass_at_k.png"
    plot_pass_at_k({"before training": before, "after training": after}, path, title="pass@k on arithmetic")
    assert path.stat().st_size > 10_000
    image = imread(path)
    assert image.shape[0] > 400 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # not a blank canvas
    with pytest.raises(ValueError, match="at least one"):
        plot_pass_at_k({}, path, title="t")
    with pytest.raises(ValueError, match="k must be >= 1"):
        plot_pass_at_k({"a": [(0, 0.1, 0.0, 0.2)]}, path, title="t")


def test_plot_takes_pass_at_k_curve_output_directly(tmp_path):
    curve = pass_at_k_curve([0, 3, 8, 16], 16, n_bootstrap=50)
    path = tmp_path / "curve.png"
    plot_pass_at_k({"after training": curve}, path, title="t")
    assert path.stat().st_size > 0
    with pytest.raises(ValueError, match="must be \\(k, mean, ci_low, ci_high\\)"):
        plot_pass_at_k({"a": [(1, 0.5)]}, path, title="t")


def test_log2_ticks_are_powers_of_two_plus_uncrowded_extra_ks():
    assert _log2_ticks([1, 2, 4, 8, 16]) == [1, 2, 4, 8, 16]
    assert _log2_ticks([1, 2, 4, 8, 16, 32, 64, 100]) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert _log2_ticks([1, 512, 1000, 1024]) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]  # 1000 would overlap
    assert len(_log2_ticks([1, 2**20])) <= 12


def test_panels_share_one_figure_and_a_band_only_where_there_is_one(tmp_path):
    from matplotlib.image import imread

    ks = [1, 2, 4]
    panels = {"grpo": {"gamma=0 (2 seeds)": [(k, 0.3 * k / 4, 0.2 * k / 4, 0.4 * k / 4) for k in ks],
                       "gamma=1 (1 seed)": [(k, 0.5, 0.5, 0.5) for k in ks]},
              "cispo": {"gamma=0 (2 seeds)": [(k, 0.6, 0.5, 0.7) for k in ks]}}
    path = tmp_path / "report.png"
    plot_pass_at_k_panels(panels, path, ylabel="final pass@k")
    height, width = imread(path).shape[:2]
    one = tmp_path / "one.png"
    plot_pass_at_k_panels({"grpo": panels["grpo"]}, one)
    assert width > 1.2 * imread(one).shape[1] and height == imread(one).shape[0]  # two panels side by side
    with pytest.raises(ValueError, match="at least one panel"):
        plot_pass_at_k_panels({}, path)
    with pytest.raises(ValueError, match="curve 'gamma=1' has no points"):
        plot_pass_at_k_panels({"grpo": {"gamma=1": []}}, path)
