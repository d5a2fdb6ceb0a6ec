"""Edges of `python -m powerclip.experiments` budget / plateau (issues 30 and 31): checks that must fail before anything
trains, malformed result folders named in one line (exit 2), the plateau's rows without CLIP, the plateau rule's
arithmetic, and the 600-line rule. Nothing here trains: where a command would, `plateau` is replaced after its
pre-check."""
import csv, json, math, shutil
from pathlib import Path

import pytest

import powerclip.compare as C
import powerclip.experiments as E

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "benchmarks" / "results" / "plateau_cpu" / "T1600"  # committed: seeds 0-7, gold (avg) 0-2 only
AVG = ["--rows", "CLIP (avg)", "PowerCLIP-R (avg)"]


def _run(argv, capsys):
    "(exit status, stderr) of the command line."
    rc = E.main(argv)
    return rc, capsys.readouterr().err


def _one_line(err: str, *words):
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.fixture
def part(tmp_path):
    "A copy of the committed plateau's tables (what `--merge` reads)."
    d = tmp_path / "part"
    shutil.copytree(KEPT, d)
    return d


@pytest.fixture
def no_training(monkeypatch):
    "`plateau` and `budget` replaced: the command line's pre-check runs, then the call is recorded, nothing trains."
    seen = []
    monkeypatch.setattr(E, "plateau", lambda *a, **k: seen.append(("plateau", a, k)) or _Stop.throw())
    monkeypatch.setattr(E, "budget", lambda *a, **k: seen.append(("budget", a, k)) or _Stop.throw())
    return seen


class _Stop(Exception):
    @staticmethod
    def throw():
        raise _Stop


def test_lead_command_precheck_passes(part, tmp_path, no_training):
    """The plateau without class-token CLIP, merged with the committed seeds (0-7): the pre-check (plans, merge rules,
    the parts' anatomy) passes and the plateau is called with those rows."""
    with pytest.raises(_Stop):
        E.main(["plateau", "--steps", "1600", "--seeds", "8", "9", "10", *AVG, "--merge", str(part), "--out",
                str(tmp_path / "out"), "progress=false"])
    (kind, args, kw), = no_training
    assert kind == "plateau" and kw["rows"] == ["CLIP (avg)", "PowerCLIP-R (avg)"] and kw["merge"] == [str(part)]
    assert not (tmp_path / "out").exists()                       # nothing written before the plateau itself


def test_other_rows_of_committed_seeds(part, tmp_path, no_training, capsys):
    """A row the committed seeds lack (PowerCLIP-gold (avg) has seeds 0-2 only) run on seed 3, merged with them: the
    pre-check passes; a row seed 3 already has is refused in one line naming the run, before anything trains."""
    with pytest.raises(_Stop):
        E.main(["plateau", "--steps", "1600", "--seeds", "3", "--rows", "PowerCLIP-gold (avg)", "--merge", str(part),
                "--out", str(tmp_path / "out"), "progress=false"])
    assert [k for k, _, _ in no_training] == ["plateau"]
    rc, err = _run(["plateau", "--steps", "1600", "--seeds", "3", "--rows", "CLIP (avg)", "--merge", str(part),
                    "--out", str(tmp_path / "out"), "progress=false"], capsys)
    assert rc == 2
    _one_line(err, "CLIP (avg) of seed 3 is in two comparisons")
    assert not (tmp_path / "out").exists()


def test_rows_checked(tmp_path, capsys):
    for rows in (["CLIP", "CLIP"], ["FILIP"]):
        rc, err = _run(["plateau", "--steps", "4", "--rows", *rows, "--out", str(tmp_path)], capsys)
        assert rc == 2
        _one_line(err, "--rows")
    plan = E._plateau_plan(["CLIP (avg)", "PowerCLIP-R (avg)"], [0], 4, tmp_path, log=lambda m: None)
    assert list(plan.runs) == ["CLIP (avg)", "PowerCLIP-R (avg)"] and plan.meta["reference"] == "CLIP"
    assert plan.meta["experiment"] == "plateau"


def test_long_table_plan(tmp_path, capsys):
    """`long`: a row of another table is refused in one line; its plan trains every row on the long captions with the
    long model, to CLIP (long), in OUT/T{T}; `--runs all` of the comparison leaves them out."""
    rc, err = _run(["long", "--steps", "4", "--rows", "CLIP", "--out", str(tmp_path)], capsys)
    assert rc == 2
    _one_line(err, "--rows")
    plan = E._long_plan(list(E.LONG_ROWS), [0], 4, tmp_path, log=lambda m: None)
    assert list(plan.runs) == list(E.LONG_ROWS) and plan.meta["reference"] == "CLIP (long)"
    assert plan.meta["experiment"] == "long" and plan.out == tmp_path / "T4" and plan.world.caption == "long"
    for job in plan.jobs.values():
        assert (job.cfg.data.world, job.cfg.model.name) == ({"caption": "long"}, "powerclip-demo-long")
        assert (job.cfg.optim.lr, job.cfg.optim.weight_decay) == (1e-3, 0.2)     # the world's recipe, not CC3M's
    assert {n: j.cfg.method for (n, _, _), j in plan.jobs.items()}["FLAIR (long)"] == "flair"
    assert C.LONG_RUNS == E.LONG_ROWS             # what the comparison's `--runs all` leaves out


def test_merge_tolerates_other_rows(part, tmp_path):
    """A part whose meta lists other rows (here: only the two average-pooling rows) merges with a plan of all five; the
    rows the part lacks count by the other seeds."""
    d = json.loads((part / "summary.json").read_text())
    keep = ("untrained", "CLIP (avg)", "PowerCLIP-R (avg)")
    d["meta"]["runs"] = list(keep[1:])
    d["per_seed"] = {s: {n: r for n, r in res.items() if n in keep} for s, res in d["per_seed"].items()}
    (part / "summary.json").write_text(json.dumps(d))
    plan = E._plateau_plan(E.PLATEAU_ROWS, [8], 1600, tmp_path, log=lambda m: None, grounding_scenes=200,
                           overrides={"progress": False}, eval_images=300)
    parts, extra = E._merge_parts(plan, [part])
    assert set(parts[0].per_seed[0]) == set(keep) and set(extra[0]) == {"PowerCLIP-R (avg)"}   # its anatomy: its rows


def test_budget_one_seed_refused_before_training(tmp_path, capsys):
    argv = ["budget", "--steps", "2", "--seeds", "0", "--preset", "smoke", "--out", str(tmp_path / "b")]
    rc, err = _run(argv, capsys)
    assert rc == 2
    _one_line(err, "at least 2 seeds")
    assert not (tmp_path / "b").exists()


def test_malformed_summary_named(part, tmp_path, capsys):
    d = json.loads((part / "summary.json").read_text())
    for bad in ({"0": [1, 2]}, {"0": {"CLIP": {"hn_mean": "x"}, "CLIP (avg)": {"hn_mean": 1.0}}}, [1]):
        (part / "summary.json").write_text(json.dumps(dict(d, per_seed=bad)))
        rc, err = _run(["plateau", "--steps", "1600", "--seeds", "8", *AVG, "--merge", str(part), "--out",
                        str(tmp_path / "out"), "progress=false"], capsys)
        assert rc == 2
        _one_line(err, str(part / "summary.json"))
    (part / "summary.json").write_text("{not json")
    rc, err = _run(["plateau", "--steps", "1600", "--seeds", "8", "--merge", str(part), "--out", str(tmp_path / "o"),
                    "progress=false"], capsys)
    assert rc == 2
    _one_line(err, str(part / "summary.json"))


def _rewrite_anatomy(path: Path, change) -> None:
    rows = list(csv.DictReader(open(path, newline="")))
    change(rows)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_malformed_anatomy_named(part, tmp_path, capsys):
    argv = ["plateau", "--steps", "1600", "--seeds", "8", *AVG, "--merge", str(part), "--out", str(tmp_path / "out"),
            "progress=false"]
    _rewrite_anatomy(part / "anatomy.csv", lambda rows: rows[3].update(all_cos="n/a"))
    rc, err = _run(argv, capsys)
    assert rc == 2
    _one_line(err, str(part / "anatomy.csv"), "line 5")
    shutil.copy(KEPT / "anatomy.csv", part / "anatomy.csv")
    _rewrite_anatomy(part / "anatomy.csv", lambda rows: rows.pop(2))          # one seed lacks a snapshot
    rc, err = _run(argv, capsys)
    assert rc == 2
    _one_line(err, str(part / "anatomy.csv"), "different steps")
    shutil.copy(KEPT / "anatomy.csv", part / "anatomy.csv")                     # every seed at steps this run lacks
    _rewrite_anatomy(part / "anatomy.csv", lambda rows: [r.update(step=str(float(r["step"]) + 1)) for r in rows])
    rc, err = _run(argv, capsys)
    assert rc == 2
    _one_line(err, str(part / "anatomy.csv"), "not the same plan")


def test_malformed_budget_json_named(tmp_path, capsys):
    (tmp_path / "budget.json").write_text(json.dumps({"T_star": None, "steps": []}))
    rc, err = _run(["plateau", "--out", str(tmp_path)], capsys)
    assert rc == 2
    _one_line(err, str(tmp_path / "budget.json"))


def test_other_kind_of_summary_refused(part, tmp_path, capsys, no_training):
    """A plateau's folder holding a budget's summary, and a budget's holding a plateau's, are refused before anything
    trains; the plateau's own earlier summary is not (the plateau writes there again)."""
    d = json.loads((part / "summary.json").read_text())
    (tmp_path / "T1600").mkdir()
    (tmp_path / "T1600" / "summary.json").write_text(json.dumps(dict(d, meta=dict(
        d["meta"], experiment="budget", command="python -m powerclip.experiments budget --steps 1600 3200"))))
    rc, err = _run(["plateau", "--steps", "1600", "--seeds", "8", "--out", str(tmp_path), "progress=false"], capsys)
    assert rc == 2
    _one_line(err, "holds a budget's summary")
    (tmp_path / "budget" / "T800").mkdir(parents=True)
    shutil.copy(part / "summary.json", tmp_path / "budget" / "T800" / "summary.json")
    rc, err = _run(["budget", "--steps", "400", "800", "--out", str(tmp_path), "progress=false"], capsys)
    assert rc == 2
    _one_line(err, "holds a plateau's summary")
    shutil.copy(part / "summary.json", tmp_path / "T1600" / "summary.json")
    with pytest.raises(_Stop):
        E.main(["plateau", "--steps", "1600", "--seeds", "8", "--out", str(tmp_path), "progress=false"])
    assert no_training[-1][0] == "plateau"


def test_move_test_edges():
    m = E.PLATEAU_METRICS
    x = lambda v: {k: v for k in m}
    sd = {k: 0.0 for k in m}
    r = E.move_test({2: {0: x(1.0), 1: x(1.0)}, 4: {0: x(1.0), 1: x(1.0)}, 8: {0: x(2.0), 1: x(2.0)}}, sd, 4)
    assert [d["verdict"] for d in r["doublings"]] == ["flat", "moves"] and r["T_star"] == 2    # sd 0: any move moves
    assert math.isinf(r["doublings"][1]["t"][m[0]])
    r = E.move_test({2: {0: x(1.0)}, 4: {1: x(5.0)}}, {k: 1.0 for k in m}, 4)             # no seed ran both
    assert r["doublings"][0]["verdict"] == "undecided" and r["doublings"][0]["t"] == {} and r["T_star"] is None


def test_no_module_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "powerclip").rglob("*.py") if p.name != "_modidx.py"
            for n in [len(p.read_text().splitlines())] if n > 600}
    assert not long, long
