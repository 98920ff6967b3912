"""simkit.figures: the registry, the house style, each figure's compute() data, rendering."""

import dataclasses

import numpy as np
import pandas as pd
import pytest

from simkit import divergence, figures, mappings
from simkit.figures import (
    bandit_bias_variance,
    bias_variance_frontier,
    divergence_inequalities,
    kernel_shapes,
    kernel_shapes_catalogue,
    style,
)

# one xdist worker runs this module, so that
# bandit_small_data (session fixture, shared with tests/test_figure_claims.py) is computed once
pytestmark = pytest.mark.xdist_group("bandit_small_data")

EXPECTED = [
    "kernel_shapes",
    "kernel_shapes_catalogue",
    "divergence_inequalities",
    "bandit_bias_variance",
    "bias_variance_frontier",
    "seq_variance_vs_T",
    "length_trap",
    "gspo_length_conflation",
    "vespo_bound",
    "ess_khat_vs_T",
    "seq_tis_optimal_c",
    "same_kl_different_chi2",
    "token_bias_vs_T",
    "kl_penalty_bias",
    "mse_vs_T",
    "lm_vs_sim",
    "staleness_curves",
    "mismatch_curves",
    "collapse_map",
    "collapse_regimes",
    "lm_staleness_curves",
    "async_tolerance",
]


# --- registry and style ------------------------------------------------------------------------


def test_registry_lists_every_figure_with_its_interface():
    assert figures.available() == EXPECTED
    for name, module in figures.FIGURES.items():
        assert module.NAME == name
        assert module.TITLE and module.CAPTION
        assert dataclasses.is_dataclass(module.Config)
        for small in (False, True):
            cfg = module.config(small=small)
            assert isinstance(cfg, module.Config)
            with pytest.raises(dataclasses.FrozenInstanceError):
                cfg.seed = 1  # frozen (assignment fails even for a missing field)
    with pytest.raises(KeyError, match="available figures: kernel_shapes"):
        figures.figure_module("nope")


def test_every_mapping_has_its_own_style():
    names = mappings.available()
    assert set(names) <= set(style.MAPPING_STYLES)
    pairs = {(style.color(n), style.linestyle(n)) for n in names}
    assert len(pairs) == len(names)  # no two mappings look the same
    for name in names:
        assert style.family(name) in style.FAMILY_COLORS
    # families share a hue: each member's hue is closer to its family's hue than to any other
    # family's (circular distance on the HSV hue wheel; black 'reference' has no hue)
    from matplotlib.colors import rgb_to_hsv, to_rgb

    def hue(c):
        return rgb_to_hsv(to_rgb(c))[0]

    fam_hue = {f: hue(c) for f, c in style.FAMILY_COLORS.items() if f != "reference"}
    for name in names:
        if style.family(name) == "reference":
            continue
        h = hue(style.color(name))
        nearest = min(fam_hue, key=lambda f: min(abs(fam_hue[f] - h), 1 - abs(fam_hue[f] - h)))
        assert nearest == style.family(name), name


def test_unknown_mapping_gets_a_deterministic_fallback_style():
    assert style.style("my_mapping") == style.style("my_mapping")
    assert style.family("my_mapping") == "other"
    with pytest.raises(TypeError, match="registry name"):
        style.color(3)


def test_small_from_env(monkeypatch):
    monkeypatch.setenv("SIMKIT_SMALL", "1")
    assert figures.small_from_env()
    monkeypatch.setenv("SIMKIT_SMALL", "0")
    assert not figures.small_from_env()


# --- kernel_shapes -----------------------------------------------------------------------------


def test_kernel_shapes_data():
    # 91 points on [0, 3]: spacing 1/30, so both VESPO argmaxes 2/3 and 3/2 are grid points
    cfg = kernel_shapes.Config(n_points=91)
    data = kernel_shapes.compute(cfg)
    assert len(data) == 4 * 2 * 2 * 91
    assert np.isfinite(data.value).all()
    w = np.linspace(0, 3, 91)

    def curve(name, sign, quantity):
        part = data[(data.curve == name) & (data.advantage == sign) & (data.quantity == quantity)]
        np.testing.assert_array_equal(part.w, w)
        return part.value.to_numpy()

    # VESPO drawn peak-normalised: max φ/φ_max = 1 at W = c1/c2 (VESPO Prop. C.1)
    for sign, argmax in (("A>0", 2 / 3), ("A<0", 1.5)):
        phi = curve("VESPO (peak-normalised)", sign, "phi")
        i = int(np.argmax(phi))
        assert abs(phi[i] - 1.0) < 1e-12
        assert abs(w[i] - argmax) < 1e-12
    # hard clip ε = 0.2: φ = W inside the band, 0 outside (docs/reference.md, Mappings)
    phi_pos, phi_neg = curve("hard clip", "A>0", "phi"), curve("hard clip", "A<0", "phi")
    np.testing.assert_allclose(phi_pos, np.where(w <= 1.2 + 1e-12, w, 0.0), atol=1e-12)
    np.testing.assert_allclose(phi_neg, np.where(w >= 0.8 - 1e-12, w, 0.0), atol=1e-12)
    np.testing.assert_allclose(curve("hard clip", "A>0", "f"), np.minimum(w, 1.2), atol=1e-12)
    # SAPO c(1) = 1 for both temperatures; identity φ = W
    at_one = int(np.argmin(np.abs(w - 1.0)))
    for sign in ("A>0", "A<0"):
        assert curve("SAPO", sign, "phi")[at_one] == pytest.approx(1.0, abs=1e-12)
        np.testing.assert_array_equal(curve("IS (φ = W)", sign, "phi"), w)
    # f and φ are a pair: w·f'(w) = φ(w), by central differences on the grid (interior, smooth
    # curves; O(h²) error with h = 1/30)
    for name in ("SAPO", "VESPO (peak-normalised)"):
        for sign in ("A>0", "A<0"):
            f, phi = curve(name, sign, "f"), curve(name, sign, "phi")
            deriv = (f[2:] - f[:-2]) / (w[2:] - w[:-2])
            np.testing.assert_allclose(w[1:-1] * deriv, phi[1:-1], atol=5e-3)


@pytest.mark.parametrize("module", [kernel_shapes, kernel_shapes_catalogue])
@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"w_max": 1.0}, "w_max must be > 1 to show the ratio 1, got 1.0"),
        ({"n_points": 2}, "n_points must be >= 3, got 2"),
    ],
)
def test_kernel_shape_figures_check_their_ratio_grid_alike(module, bad, message):
    """Both kernel-shape figures check w_max and n_points with _common.check_ratio_grid."""
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(module.config(small=True), **bad)


def test_kernel_shapes_config_validation():
    with pytest.raises(ValueError, match="w_max"):
        kernel_shapes.Config(w_max=0.5)
    with pytest.raises(ValueError, match="vespo_k_pos"):
        kernel_shapes.Config(vespo_k_pos=0.5)


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("ess_khat_vs_T", {"V": 1}, "V must be >= 2, got 1"),
        ("ess_khat_vs_T", {"chi2_toks": (0.1, 0.0)}, "chi2_toks must be positive"),
        ("ess_khat_vs_T", {"lengths": ()}, "lengths must be positive integers"),
        ("seq_variance_vs_T", {"chi2_toks": ()}, "chi2_toks must be positive"),
        ("seq_variance_vs_T", {"markov_lengths": (0, 4)}, "markov_lengths must be positive"),
        ("token_bias_vs_T", {"V": 0}, "V must be >= 2, got 0"),
        ("token_bias_vs_T", {"lengths": (0,)}, "lengths must be positive integers"),
    ],
)
def test_token_figure_configs_name_the_bad_field(name, bad, message):
    """The token-level figures check V, χ² and length grids alike (_common.check_token_grid)."""
    module = figures.figure_module(name)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(module.config(small=True), **bad)


def test_kernel_shapes_catalogue_data():
    data = kernel_shapes_catalogue.compute(kernel_shapes_catalogue.config(small=True))
    scalar = [
        n for n in mappings.available() if isinstance(mappings.get(n), mappings.ScalarMapping)
    ]
    assert list(dict.fromkeys(data.mapping)) == scalar
    assert set(data.attrs["not_scalar"]) == set(mappings.available()) - set(scalar)
    assert np.isfinite(data.phi).all()
    n_points = kernel_shapes_catalogue.config(small=True).n_points - 1
    assert len(data) == 2 * n_points * len(scalar)
    # on-policy identity: φ(1) = 1 for both signs (the grid contains 1)
    at_one = data[np.isclose(data.w, 1.0, rtol=0, atol=1e-12)]
    for name in scalar:
        if mappings.mapping_class(name).on_policy_identity:
            np.testing.assert_allclose(at_one[at_one.mapping == name].phi, 1.0, atol=1e-12)
    assert set(data.ratio) <= {"r_t", "W", "s"}
    for name, symbol in (("gspo", "s"), ("is_seq", "W"), ("is_token", "r_t"), ("vespo", "W")):
        assert (data[data.mapping == name].ratio == symbol).all(), name


# --- divergence_inequalities -------------------------------------------------------------------


@pytest.fixture(scope="module")
def inequality_data():
    return divergence_inequalities.compute(divergence_inequalities.config(small=True))


def test_divergence_inequalities_chain_holds_on_every_pair(inequality_data):
    pairs = inequality_data.pairs
    cfg = divergence_inequalities.config(small=True)
    n_settings = len(cfg.concentrations) + len(cfg.perturbations)
    assert len(pairs) == n_settings * cfg.pairs_per_setting
    assert pairs.holds.all()
    finite = pairs[np.isfinite(pairs.chi2)]
    assert len(finite) >= 0.9 * len(pairs)
    chain = finite[["tv_sq", "half_kl", "half_log1p_chi2", "half_chi2"]].to_numpy()
    assert (np.diff(chain, axis=1) >= -1e-12 * chain[:, 1:]).all()
    np.testing.assert_allclose(finite.half_chi2, 0.5 * finite.chi2, rtol=1e-15)
    np.testing.assert_allclose(finite.tv_sq, finite.tv**2, rtol=1e-15)
    # both kinds of pairs, spanning several decades of χ²
    assert set(pairs.kind) == {"independent", "perturbed"}
    assert finite.chi2.max() / finite.chi2.min() > 1e3


def test_divergence_inequalities_same_kl_line(inequality_data):
    line = inequality_data.same_kl
    assert len(line) >= 3
    for kl, part in line.groupby("kl_target"):
        np.testing.assert_allclose(part.kl, kl, rtol=1e-8)
        np.testing.assert_allclose(part.chi2, part.chi2_target, rtol=1e-8)
        assert part.chi2.max() / part.chi2.min() > 10  # same KL, χ² over a decade and more
    assert line.holds.all()


# --- bandit figures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bandit_data(bandit_small_data):  # conftest: computed once for this module and the claims'
    return bandit_small_data


def test_bandit_bias_variance_data(bandit_data):
    cfg = bandit_bias_variance.config(small=True)
    data = bandit_data
    from simkit.figures import _common

    names = _common.figure_mappings()  # the whole registry
    assert len(data) == len(names) * cfg.n_chi2 * len(cfg.ns)
    assert set(data.mapping) == set(names) and set(data.n) == set(cfg.ns)
    # μ dialed to the χ² grid (shifts.dial solves to 1e-8 relative)
    np.testing.assert_allclose(data.chi2_tok, data.target_chi2, rtol=1e-7)
    for col in ("bias", "variance", "mse", "cosine", "mse_zero", "rel_mse_scaled"):
        assert np.isfinite(data[col]).all(), col
    np.testing.assert_allclose(data.mse, data.bias**2 + data.variance, rtol=1e-9)
    # the scale-free error: ĝ ≡ 0 is ‖∇J‖², rel_mse_scaled in [0, 1]; exact rows: rel_mse_scaled
    # = 1 − cos²·snr/(1 + snr), and rescaling-invariant, so it falls with n for every exact row
    env = bandit_bias_variance.make_bandit(cfg.arms, cfg.seed)
    np.testing.assert_allclose(data.mse_zero, env.grad_J() @ env.grad_J(), rtol=1e-14)
    assert data.rel_mse_scaled.between(0, 1).all()
    exact = data[data.exact]
    want = 1 - exact.cosine**2 * exact.snr / (1 + exact.snr)
    np.testing.assert_allclose(exact.rel_mse_scaled, want, rtol=1e-9)
    wide = exact.pivot_table(index=["mapping", "target_chi2"], columns="n", values="rel_mse_scaled")
    assert (wide[max(cfg.ns)] <= wide[min(cfg.ns)] + 1e-12).all()
    np.testing.assert_allclose(data.kept_exact[data.mapping == "naive"], 1.0)
    # exact path for per-sample mappings, Monte Carlo for batch-dependent ones
    for name in names:
        rows = data[data.mapping == name]
        assert (rows.exact == (not mappings.mapping_class(name).batch_dependent)).all(), name
    # sequence IS is unbiased; naive's bias grows with the mismatch
    assert (data[data.mapping == "is_seq"].bias < 1e-10).all()
    naive = data[(data.mapping == "naive") & (data.n == min(cfg.ns))].sort_values("target_chi2")
    assert (np.diff(naive.bias.to_numpy()) > 0).all()
    assert naive.bias.min() > 1e-3


def test_bias_variance_frontier_data():
    cfg = bias_variance_frontier.config(small=True)
    data = bias_variance_frontier.compute(cfg)
    assert np.isfinite(data[["bias2", "variance", "mse"]].to_numpy()).all()
    assert set(data.mapping) == set(bias_variance_frontier.KNOBS) | {"naive", "is_seq"}
    np.testing.assert_allclose(data.chi2_tok, cfg.chi2, rtol=1e-7)
    naive = data[data.mapping == "naive"].iloc[0]
    is_seq = data[data.mapping == "is_seq"].iloc[0]
    assert is_seq.bias2 < 1e-20 and naive.bias2 > 1e-6
    assert naive.variance < is_seq.variance
    # the power knob connects the two endpoints: α = 0 is naive, α = 1 is sequence IS
    power = data[data.mapping == "power"].set_index("value")
    assert power.loc[0.0, "bias2"] == pytest.approx(naive.bias2, rel=1e-10)
    assert power.loc[0.0, "variance"] == pytest.approx(naive.variance, rel=1e-10)
    assert power.loc[1.0, "variance"] == pytest.approx(is_seq.variance, rel=1e-10)
    assert power.loc[1.0, "bias2"] < 1e-20
    # truncated IS: raising the cap C trades bias for variance (monotone on the bandit)
    tis = data[data.mapping == "tis_seq"].sort_values("value")
    assert (np.diff(tis.bias2.to_numpy()) <= 1e-15).all()
    assert (np.diff(tis.variance.to_numpy()) >= -1e-15).all()


# --- rendering and gallery ---------------------------------------------------------------------


def test_render_is_deterministic(tmp_path):
    a = figures.render("kernel_shapes", tmp_path / "a", small=True)
    b = figures.render("kernel_shapes", tmp_path / "b", small=True)
    for pa, pb in zip(a, b, strict=True):
        assert pa.name == pb.name
        assert pa.stat().st_size > 1000
        assert pa.read_bytes() == pb.read_bytes()
    assert a[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert a[1].read_bytes()[:5] == b"%PDF-"


@pytest.mark.parametrize(
    "name", ["kernel_shapes_catalogue", "divergence_inequalities", "bias_variance_frontier"]
)
def test_render_writes_png_and_pdf(tmp_path, name):
    png, pdf = figures.render(name, tmp_path, small=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000


def test_bandit_draw_from_data(bandit_data, tmp_path):
    from simkit.figures import _claims

    with style.context():
        fig = bandit_bias_variance.draw(bandit_data)
    panels = [p for p in _claims.PANELS if (bandit_data.panel == p).any()]
    axes = [ax for ax in fig.axes if ax.get_ylabel() or ax.get_xlabel() or ax.get_title()]
    assert len(fig.axes) == len(bandit_bias_variance.METRICS) * len(panels) == 20
    # naive and is_seq are drawn in every panel (as members or as references)
    bias_row = fig.axes[: len(panels)]
    for ax in bias_row:
        labels = [line.get_label() for line in ax.get_lines()]
        assert any(lab.startswith("naive") for lab in labels), labels
        assert any(lab.startswith("is_seq") for lab in labels), labels
    # is_seq's bias is exactly 0 at every χ²: no line segment (all NaN), markers on the floor
    for ax in bias_row:
        lines = [line for line in ax.get_lines() if line.get_label().startswith("is_seq")]
        assert lines and all(np.isnan(np.asarray(line.get_ydata(), float)).all() for line in lines)
        floor = [
            line
            for line in ax.get_lines()
            if line.get_linestyle() == "None" and line.get_color() == style.color("is_seq")
        ]
        assert floor and len(np.unique(floor[0].get_ydata())) == 1
    # the MSE row draws the error of ĝ ≡ 0, ‖∇J‖², as a horizontal line in every panel
    mse_row = fig.axes[len(panels) : 2 * len(panels)]
    zero = float(bandit_data.mse_zero.iloc[0])
    for ax in mse_row:
        assert any(
            np.allclose(np.asarray(line.get_ydata(), float), zero) for line in ax.get_lines()
        )
    assert axes
    fig.savefig(tmp_path / "b.png", dpi=50)
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_gallery_lists_rendered_figures(tmp_path):
    figures.render("kernel_shapes", tmp_path, small=True)
    text = figures.write_gallery(tmp_path).read_text()
    lines = [line for line in text.splitlines() if line.startswith("- **")]
    assert len(lines) == 1
    assert kernel_shapes.TITLE in lines[0] and "(kernel_shapes.png)" in lines[0]
    assert "kernel_shapes.pdf" in lines[0]


def test_make_returns_data_and_figure():
    data, fig = figures.make("kernel_shapes", small=True)
    assert isinstance(data, pd.DataFrame)
    assert len(fig.axes) == 4


def test_divergence_functions_used_by_the_figures_agree():
    # the figure's chain columns come from simkit.divergence: spot-check one pair
    data = divergence_inequalities.random_pairs(
        divergence_inequalities.Config(pairs_per_setting=1, concentrations=(1.0,), perturbations=())
    )
    rng = np.random.default_rng(0)
    pi, mu = rng.dirichlet(np.ones(10)), rng.dirichlet(np.ones(10))
    assert data.chi2.iloc[0] == pytest.approx(float(divergence.chi2(pi, mu)), rel=1e-14)


def test_annotated_heatmap_writes_each_cell_and_labels_the_axes():
    from simkit.figures import _common

    fig = _common.new_figure(3, 2)
    ax = fig.subplots()
    values = np.array([[0.0, 0.5, 1.0], [0.25, 0.75, np.nan]])
    texts = [["a", "b", "c"], ["d", "e", "f"]]
    colors = [["white", "black", "black"], ["white", "black", "white"]]
    image = _common.annotated_heatmap(
        ax,
        values,
        texts,
        colors,
        ["1", "2", "3"],
        ["x", "y"],
        cmap="viridis",
        vmin=0,
        vmax=1,
        fontsize=6,
        tick_fontsize=5,
    )
    np.testing.assert_array_equal(image.get_array().filled(np.nan), values)
    placed = {t.get_text(): (t.get_position(), t.get_color()) for t in ax.texts}
    for i, j in np.ndindex(values.shape):
        assert placed[texts[i][j]] == ((j, i), colors[i][j])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "3"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["x", "y"]
    assert ax.get_xticklabels()[0].get_fontsize() == 5
    with pytest.raises(ValueError):
        _common.annotated_heatmap(
            ax,
            values,
            texts[:1],
            colors,
            ["1"],
            ["x"],
            cmap="viridis",
            vmin=0,
            vmax=1,
            fontsize=6,
        )


# --- helpers the figure modules share ------------------------------------------------------------


def test_chosen_mappings_and_oracle_estimators():
    from simkit.figures import _common

    assert _common.chosen_mappings(("naive", "vespo")) == ["naive", "vespo"]
    assert _common.chosen_mappings(None) == _common.figure_mappings()
    assert _common.figure_mappings() == list(mappings.available())
    assert _common.chosen_mappings(None, ("is_seq",)) == ["is_seq"]
    assert _common.chosen_mappings((), ("is_seq",)) == []  # an empty choice is kept, not replaced
    per_sample = _common.per_sample_mappings()
    assert "snis" in mappings.available() and "snis" not in per_sample
    assert all(not mappings.mapping_class(n).batch_dependent for n in per_sample)
    assert set(_common.SMALL_EXACT_MAPPINGS) <= set(per_sample)
    ests = _common.oracle_estimators(["naive", "tis_seq"])
    assert [e.name for e in ests] == ["naive", "tis_seq"]
    assert [type(e.mapping) for e in ests] == [
        type(mappings.get("naive")),
        type(mappings.get("tis_seq")),
    ]
    assert {(e.aggregation, e.advantage) for e in ests} == {("seq-mean-token-sum", "oracle")}


def test_seed_means_against_hand_computed_groups():
    from simkit.figures.staleness_curves import seed_means, summarize

    runs = pd.DataFrame(
        {
            "recipe": ["b", "b", "a", "a", "a"],
            "N": [1, 1, 1, 1, 1],
            "J_final": [0.2, 0.4, 1.0, 2.0, 6.0],
            "J_mean": [0.1, 0.1, 0.0, 0.0, 3.0],
            "collapsed": [True, False, False, False, True],
        }
    )
    out = summarize(runs, ["recipe", "N"])
    assert list(out.columns) == [
        "recipe", "N", "J_final", "J_mean", "collapsed", "runs", "J_final_se", "J_mean_se"
    ]  # fmt: skip
    assert list(out.recipe) == ["b", "a"]  # order of appearance
    np.testing.assert_allclose(out.J_final, [0.3, 3.0])
    se_a = np.std([1.0, 2.0, 6.0], ddof=1) / np.sqrt(3)
    np.testing.assert_allclose(out.J_final_se, [np.std([0.2, 0.4], ddof=1) / np.sqrt(2), se_a])
    np.testing.assert_allclose(out.J_mean_se, [0.0, 1.0])  # a: J_mean 0, 0, 3: sd √3
    assert out.collapsed.tolist() == [1, 1] and out.collapsed.dtype.kind == "i"
    assert out.runs.tolist() == [2, 3]
    one = seed_means(runs.iloc[:1], ["recipe"], ("J_final",), ("J_mean",))
    assert list(one.columns) == ["recipe", "J_final", "J_mean", "collapsed", "runs", "J_final_se"]
    assert np.isnan(one.J_final_se.iloc[0])  # one seed: no SE


@pytest.mark.parametrize(
    ("runs", "steps", "workers", "expected"),
    [
        (4, 5_000, 8, 4),  # 20 000 steps in total: a pool, one process per run
        (4, 4_999, 8, None),  # one step short of PARALLEL_STEPS: serial
        (100, 1_000, 3, 3),  # at most ``workers``
        (1, 10**6, 8, None),  # one run: serial
        (8, 10**6, 1, None),  # one worker: serial
    ],
)
def test_pool_size_rule(runs, steps, workers, expected):
    from simkit.figures.staleness_curves import PARALLEL_STEPS, pool_size

    assert PARALLEL_STEPS == 20_000
    assert pool_size(runs, steps, workers) == expected


def test_training_sweep_takes_the_schedule_from_the_figure_config():
    from simkit.figures import collapse_regimes, mismatch_curves, staleness_curves

    for module in (staleness_curves, mismatch_curves, collapse_regimes):
        cfg = module.config(small=True)
        sweep = module.sweep_config(cfg)
        assert (sweep.name, sweep.steps, sweep.minibatch_size) == (
            module.NAME,
            cfg.steps,
            cfg.minibatch_size,
        )
        assert (sweep.optimizer, sweep.record_every, list(sweep.seeds)) == (
            "adam",
            cfg.record_every,
            list(cfg.seeds),
        )
        assert sweep.max_grad_norm == cfg.max_grad_norm
        assert len(sweep.estimators) == len(collapse_regimes.usable_recipes(cfg))
    cfg = dataclasses.replace(staleness_curves.config(small=True), max_grad_norm=None)
    assert staleness_curves.sweep_config(cfg).max_grad_norm is None


def test_lm_figures_share_the_study_settings():
    import inspect

    from simkit.figures import _lm_vs_sim_mc, lm_vs_sim
    from simkit.lm.study import gradient_study

    for module in (lm_vs_sim, _lm_vs_sim_mc):
        cfg = module.config(small=True)
        assert isinstance(cfg, lm_vs_sim.LMStudyConfig)
        assert {k: getattr(cfg, k) for k in lm_vs_sim.SMALL_LM} == lm_vs_sim.SMALL_LM
        sizes = lm_vs_sim.study_sizes(cfg)
        # every setting is a keyword of the study (mc_study passes its **kwargs on to it), and
        # the length is the figure's T
        assert set(sizes) <= set(inspect.signature(gradient_study).parameters)
        assert sizes["max_new_tokens"] == cfg.T and sizes["reps"] == cfg.reps
    with pytest.raises(ValueError, match="reps must be an integer >= 2"):
        dataclasses.replace(_lm_vs_sim_mc.config(small=True), reps=1)


def test_lm_staleness_passes_its_train_fields_by_name():
    pytest.importorskip("torch", reason="needs torch (the lm extra)")
    from simkit.figures import lm_staleness_curves as lsc

    cfg = lsc.config(small=True)
    fields = lsc.train_fields(cfg)
    assert sorted(fields) == sorted(
        ["group_size", "steps", "minibatch_size", "lag", "lr", "max_grad_norm",
         "response_length", "precision", "n_prompts", "eval_every", "target"]
    )  # fmt: skip
    tc = lsc.lm_config(cfg, "vespo", 4)
    assert tc.minibatches == 4 and tc.mapping == "vespo"
    assert all(getattr(tc, name) == value for name, value in fields.items())


@pytest.mark.parametrize("module_name", ["staleness_curves", "collapse_map", "lm_staleness_curves"])
def test_training_figures_reject_staleness_below_one(module_name):
    """check_grid checks N >= 1 for every figure with a staleness axis (collapse_map too)."""
    module = figures.figure_module(module_name)
    with pytest.raises(ValueError, match=r"staleness values N must be >= 1, got \(0, 4\)"):
        dataclasses.replace(module.config(small=True), staleness=(0, 4))
