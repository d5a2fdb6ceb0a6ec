# ---
# jupyter:
#   jupytext:
#     formats: nbs///ipynb,nbs/scripts///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %%
#| default_exp eval.__main__

# %%
#| export
import sys

from powerclip.eval.cli import main

# %%
#| hide
import subprocess
from pathlib import Path

# %% [markdown]
# # `python -m powerclip.eval`
#
# > The package run as a program is the evaluation command line of `66_eval_cli`.

# %% [markdown]
# `powerclip-eval` (the console script in `settings.ini`) calls `powerclip.eval.cli:main`; this module lets
# `python -m powerclip.eval ...` do the same.

# %%
#| export
# a notebook kernel also runs as __main__, but has no __file__: only `python -m powerclip.eval` runs here
if __name__ == '__main__' and '__file__' in globals():
    sys.exit(main())

# %%
_root = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / 'settings.ini').is_file())
_r = subprocess.run([sys.executable, '-m', 'powerclip.eval', 'run', '--help'], capture_output=True, text=True,
                    cwd=_root, timeout=300)
assert _r.returncode == 0 and '--checkpoint' in _r.stdout and '--method' in _r.stdout, _r.stderr
