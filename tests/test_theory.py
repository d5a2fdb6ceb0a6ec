"""The `powerclip-theory` command: exit status, table, failure path (what a notebook cell cannot cover)."""
import subprocess
import sys

import powerclip.theory as theory


def test_module_runs_and_passes():
    # `python -m powerclip.theory` is what `make demo` runs; a small case count keeps this quick
    p = subprocess.run([sys.executable, "-m", "powerclip.theory", "--cases", "4"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "15/15 checks passed" in p.stdout
    assert "FAIL" not in p.stdout


def test_main_returns_1_when_a_check_fails(monkeypatch, capsys):
    bad = theory.CheckRow("deliberately failing check", 1, 1.0, 1e-12, False)
    monkeypatch.setattr(theory, "run_checks", lambda cases, seed: [bad])
    assert theory.main(["--cases", "1"]) == 1
    out = capsys.readouterr().out
    assert "deliberately failing check" in out and "FAIL" in out and "0/1 checks passed" in out


def test_a_broken_aggregator_is_caught(monkeypatch):
    # failure injection: an NLA-T1 that forgets the region padding mask must break the closed form of Theorem 1
    real = theory.nla_t1
    monkeypatch.setattr(theory, "nla_t1", lambda Q, rv, nv, tau=1e-3, act="softplus":
                        real(Q, rv.new_ones(rv.shape), nv, tau, act))
    rows = theory.check_theorem1(n_cases=20, M_max=6)
    assert not rows[1].passed  # the closed-form error row sees the extra tau*log2 per padded region
