"""How large a difference a comparison can see, and what it reports beside its verdicts (issue 31): the minimum
detectable difference of the paired t test against a simulation, verdicts on a zero-width seed interval, and a small
comparison on the smoke preset (CLIP and CLIP-PGS, two seeds, in this process) whose report carries the detectable
differences, the drop ratio CLIP-PGS's runs logged and each seed's learning curve, through a rewrite and a merge."""
import csv, json, math

import numpy as np
import pytest
from scipy import stats as st

from powerclip.compare import RUNS, compare
from powerclip.report import (load_comparison, merge_comparisons, metric_verdict, read_seed_curves, rewrite_outputs,
                              verdicts, write_outputs)
from powerclip.stats import Interval, detectable_difference, detectable_lambda, min_detectable, t_interval


@pytest.mark.parametrize("n", [3, 4])
def test_mdd_has_the_power_it_claims(n):
    "At the MDD (sd 1) a two-sided paired t test rejects in 80 % of simulated experiments; half of it, far less often."
    rng = np.random.default_rng(n)
    tc = st.t.ppf(0.975, n - 1)
    for share, lo, hi in ((1.0, 0.785, 0.815), (0.5, 0.0, 0.45)):
        x = rng.normal(share * min_detectable(1.0, n), 1.0, size=(40_000, n))
        power = np.mean(np.abs(x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))) > tc)
        assert lo < power < hi, (n, share, power)


def test_mdd_scales_and_its_interval():
    "Linear in the sd, smaller with more seeds; the interval is the chi-square interval of the sd, scaled alike."
    assert min_detectable(2.0, 3) == pytest.approx(2 * min_detectable(1.0, 3), rel=1e-12)
    assert min_detectable(1.0, 2) > min_detectable(1.0, 3) > min_detectable(1.0, 10) > (1.96 + 0.84) / math.sqrt(10)
    d = np.array([1.0, 3.0, 2.5, 0.5])
    iv = detectable_difference(d)
    s = d.std(ddof=1)
    k = detectable_lambda(4) / 2
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((k * s, k * s * math.sqrt(3 / st.chi2.ppf(0.975, 3)),
                                                     k * s * math.sqrt(3 / st.chi2.ppf(0.025, 3))), rel=1e-12)
    assert math.isnan(detectable_difference([0.4]).mean) and math.isnan(detectable_difference([0.4, 0.4]).mean)


def test_zero_width_interval_defers_to_the_bootstrap():
    """Every seed the same difference: no verdict on the seed interval; the scene bootstrap's, marked and at most
    suggestive, where it is."""
    t = t_interval([36 / 254 * 100] * 3)
    assert t.excludes_zero and t.verdict() == "degenerate interval"
    boot = Interval(14.2, 10.4, 18.1, 300, method="bootstrap")
    assert metric_verdict(dict(t=t, boot=boot)) == "suggestive (+, scene bootstrap, seed sd 0)"   # at most suggestive
    assert metric_verdict(dict(t=t, boot=None)) == "degenerate interval"
    flat = Interval(0.5, -1.0, 2.0, 300, method="bootstrap")
    assert metric_verdict(dict(t=t, boot=flat)) == "no difference shown (scene bootstrap, seed sd 0)"
    ok = t_interval([1.0, 2.0, 1.5])
    stats = {"A": {"hn_mean": dict(t=ok, boot=None), "i2t_R@1": dict(t=t, boot=boot)},
             "B": {"hn_mean": dict(t=t, boot=None)}}
    # A's HN mean (p 0.035) is corrected over A's two numbers; its i2t R@1 counts in that family without a p-value
    assert verdicts(stats) == {"A": "suggestive: HN mean (+), i2t R@1 (+, scene bootstrap, seed sd 0)",
                               "B": "degenerate interval: HN mean"}


@pytest.fixture(scope="module")
def pgs(tmp_path_factory):
    "CLIP and CLIP-PGS on the smoke preset, seeds 0 and 1, and the same as two one-seed comparisons."
    out = tmp_path_factory.mktemp("pgs")
    kw = dict(preset="smoke", eval_images=12, grounding_scenes=0, curve_points=(0.5, 1.0), isolate=False,
              log=lambda m: None)
    rows = {n: RUNS[n] for n in ("CLIP", "CLIP-PGS")}
    both = compare(rows, [0, 1], 4, out / "both", **kw)
    parts = [compare(rows, [s], 4, out / "both", report_dir=out / f"seed{s}", **kw) for s in (0, 1)]
    return out, both, parts


def test_report_carries_power_drop_ratio_and_seed_curves(pgs):
    out, cmp, _ = pgs
    md = (out / "both" / "summary.md").read_text()
    assert "detectable" in md and "patch drop ratio as its runs logged it (`_pgs_drop_ratio`" in md
    ratios = [cmp.per_seed[s]["CLIP-PGS"]["pgs_drop_ratio"] for s in (0, 1)]
    assert all(0 < r <= 0.5 for r in ratios), ratios          # PGS_0.3 drops between its bounds
    j = json.loads((out / "both" / "summary.json").read_text())
    assert j["summary"]["CLIP-PGS"]["pgs_drop_ratio"] == pytest.approx(np.mean(ratios))
    assert j["summary"]["CLIP-PGS"]["pgs_drop_ratio_max"] >= max(ratios)
    assert "pgs_drop_ratio" not in j["summary"]["CLIP"]
    mdd = j["stats"]["CLIP-PGS"]["hn_mean"]["mdd"]
    assert mdd["method"] == "mdd" and mdd["n"] == 2
    with open(out / "both" / "summary.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["run"] == "CLIP-PGS" and r["metric"] == "i2t_R@1")
    assert {"mdd", "mdd_lo", "mdd_hi"} <= set(row)
    curves = read_seed_curves(out / "both")
    assert sorted(curves) == ["CLIP", "CLIP-PGS"] and sorted(curves["CLIP-PGS"]) == [0, 1]
    assert [p["step"] for p in curves["CLIP"][1]] == [p["step"] for p in cmp.curves["CLIP"]]
    last = np.mean([curves["CLIP-PGS"][s][-1]["hn_mean"] for s in (0, 1)])
    assert last == pytest.approx(cmp.curves["CLIP-PGS"][-1]["hn_mean"], rel=1e-12)


def test_rewrite_and_merge_keep_them(pgs):
    out, cmp, parts = pgs
    before = {f: (out / "both" / f).read_bytes() for f in ("summary.md", "summary.csv", "summary.json",
                                                           "curves_per_seed.csv")}
    rewrite_outputs(out / "both")
    assert {f: (out / "both" / f).read_bytes() for f in before} == before
    merged = merge_comparisons([load_comparison(out / "seed0"), load_comparison(out / "seed1")])
    (out / "merged").mkdir()
    write_outputs(merged, out / "merged")
    assert read_seed_curves(out / "merged") == read_seed_curves(out / "both")
    for m in ("hn_mean", "i2t_R@1"):
        a, b = merged.stats["CLIP-PGS"][m]["mdd"], cmp.stats["CLIP-PGS"][m]["mdd"]
        assert (a.mean, a.hi) == pytest.approx((b.mean, b.hi), rel=1e-9, nan_ok=True)
    md = (out / "merged" / "summary.md").read_text()
    assert "detectable" in md and "patch drop ratio as its runs logged it" in md
