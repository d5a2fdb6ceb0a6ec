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

# %% [markdown]
# # powerclip
#
# > PowerCLIP — powerset alignment for contrastive image-text pre-training — as a literate, tested research repository.

# %% [markdown]
# PowerCLIP adds to the CLIP loss a triplet loss between the **powerset of image-region masks** and the
# **nodes of the caption's constituency parse tree**. Enumerating the powerset costs $O(2^M)$ for $M$ regions;
# the paper's non-linear aggregators (NLA-T1: softplus, NLA-T2: log-cosh) compute the same quantities, up to a
# proven error, in $O(M)$.
#
# Read the notebooks in order. A notebook imports only from lower-numbered notebooks (`.ci/check_notebooks.py`
# checks it on every CI run), so reading in order never meets a name before it is explained.
#
# | notebooks | module | idea |
# |---|---|---|
# | `10_powerset`, `10a_powerset_fast` | `powerset`, `powerset_fast` | the loss's math as pure tensor functions: exact $2^M$ enumeration (the oracle), the readable dense NLA form, and the fast path (packed nodes, blocked $\bar S$, analytic backward) checked against it in float64 |
# | `10b_sbar_triton` | `sbar_triton` | $\bar S$ as fused Triton kernels for the GPU (a forward with a per-text online log-sum-exp, two backward kernels that recompute the scores), a `torch.library` op that compiles in one graph; tested against float64 under Triton's interpreter |
# | `11_loss` | `loss` | CLIP's InfoNCE in its data-parallel local-rows form (`contrastive_rows`), the PowerCLIP loss |
# | `12_theory_t2r`, `13_theory_r2t`, `14_approximation` | `theory` | the theory: LSE bound, Thm. 1 (softplus), Thm. 2 (cosh), the Fig. 5/7 experiment, checked numerically |
# | `15_dist`, `16_measure`, `17_commandline` | `dist`, `measure`, `commandline` | the whole distributed contract (`gather`: one collective for float tensors with gradient, one for masks, ragged dims padded); fresh-process runs and peak memory for benchmarks; one command-line convention (one line, exit 2, `--debug`) and the one device check (`check_device`) |
# | `20_parsing`, `20a_tokens`, `21_regions`, `22_world`, `22a_seeds`, `22b_subcaptions`, `23_data` | `parsing`, `tokens`, `regions`, `world`, `seeds`, `subcaptions`, `data` | what feeds the loss: parse trees (`parsing`) and their token spans (`tokens`), region masks, a built-in compositional world, the one run seed and its streams derived by name (`seeds`), webdataset shards; `BatchNeeds` (a method asks, the pipeline builds only that), `Geometry` (from the model config) |
# | `30_model` | `model` | open_clip towers with patch and token embeddings, tiny configs, `select_patch_tokens` |
# | `40_methods` ... `48b_flair` | `methods`, `baselines.*` | the `Method` interface and registry, CLIP and PowerCLIP; FILIP, SPARC, FLIP, SmartCLIP, C2LIP, CLIP-PGS, A-CLIP (its views and colour augmentation in `46a_aclip_views`), E-CLIP, SigLIP (`48a_siglip`: the sigmoid loss, a MAP head), FLAIR (from its public code; its sub-captions in `22b_subcaptions`), each from its paper, with the differences from the authors' code written down |
# | `49a_config`, `49b_checkpoint`, `49c_accum` | `config`, `checkpoint`, `accum` | the run's config: a dataclass per component, presets and `key=value` overrides with every key and type checked; checkpoints that resume exactly (written atomically, the previous one kept), the open_clip weights alone, snapshots, the reading of a checkpoint to resume from; gradient accumulation (`accum_steps`) that gives the whole batch's gradient exactly (GradCache) |
# | `49d_train_eval`, `49e_optim`, `49f_trainlog`, `49g_faults`, `49h_runrecord`, `50_train` | `train_eval`, `optim`, `trainlog`, `faults`, `runrecord`, `train` | a machine's faults met in one line each (one trainer per folder by a lock, a full disk as exit 3, a damaged log repaired, a non-finite checkpoint never kept over a finite one: `faults`); what made a run (`run.json`: commit, libraries, the training process's thread count, device, per segment); evaluation while training (`eval_every`), its random states put back; AdamW with weight decay on the weight matrices only and its warm-up and cosine schedule (`optim`); the training log, `metrics.csv` (and TensorBoard) that reads as one uninterrupted run after a resume, read back as numbers and plotted (`trainlog`); the one trainer: `validate` checks a run and builds what needs no model, `build_run` assembles model, method, forward, optimiser and schedule once from it (the trainer, the benchmarks and the DDP tests call it); the step, the loop, `powerclip-train` |
# | `60_eval_metrics` ... `66a_eval_main` | `eval.*` | the one evaluation path: metrics with one tie rule (one rank function under recall and its per-item hits), data readers and the bad items they skip (`60a_eval_items`; regions: `61a_eval_region_data`), the model loader and the method's scorers, clip_benchmark, the task registry (`TASKS`), the evaluation while training (`64a_eval_training`), tables, `powerclip-eval` |
# | `67_heatmaps`, `68_eval_world_scores`, `69_stats` | `heatmaps`, `eval.world_scores`, `stats` | text-to-patch maps and the pointing game; a run's numbers on the world's held-out scenes with each scene's share, cached (the comparison's `HEADLINE`); intervals (paired t, bootstrap) and verdicts |
# | `69a_report`, `70_compare` | `report`, `compare` | `make demo` and `make compare`: every method planned and trained in its paper's regime (`compare`); statistics over seeds, paired differences, tables, csv and learning curves (`report`) |
# | `71_experiments`, `71a_plateau` | `ablations`, `experiments` | the paper's ablations (Tables 6, 7, 8, 10, 14, the margin, Fig. 8, Fig. 9) as comparisons against each table's reference row, and the loss's anatomy; CLIP's budget T\* (a rule with stated error rates), the plateau comparison under both poolings, and `python -m powerclip.experiments` |
# | `72_reproduce` | `reproduce` | `python -m powerclip.reproduce RUN_DIR`: a recorded run retrained from step 0 at its thread count, its log compared column by column (bitwise equal, or the step where it parts and which recorded facts differ), `--eval` rescoring its snapshot |
#
# Where the papers are ambiguous, the choice is written where it is made: the R2T normaliser $1/2^M$, the empty
# subset counted, leaves = words (`10_powerset`); $\lambda = 0.1$, margin $\gamma = 1$ (`11_loss`); NLA-T2's
# $-\tau Z$ bias kept (`14_approximation`, "Ambiguities and our choices").
#
# ## The map
#
# Imports point down this picture, never up (a module names only modules above it):
#
# ```
#  powerset ── powerset_fast ── loss         theory        dist   measure   commandline      (math, processes, commands)
#      │                          │
#  parsing ── tokens ── regions ── world ── data ── model                                    (inputs, towers)
#                                             │       │
#                                          methods ── baselines/*                            (what a method adds)
#                                             │
#                          config ── checkpoint ── train      eval/* ── heatmaps ── eval.world_scores    stats
#                                                    │                                  │  (one trainer, one evaluation)
#                                                    └─────────── report ── compare ────┘
#                                                                              │
#                                                                         experiments
# ```
#
# - `dist` is the only module that touches `torch.distributed`; `loss.contrastive_rows` is the only InfoNCE skeleton;
#   `commandline.check_device` checks every device a command or a run asks for (one that is there), and
#   `config.check_precision` every precision a run is given (the trainer's, the comparison's, the experiments').
# - `train` knows no method by name: it asks the method for its needs, forward pass, loss terms, own modules and
#   learning rates. `eval` knows no method by name either: it asks the method for its scorers (`Method.scorers`).
#
# ## Where new things go
#
# - **A new method** (a baseline): a notebook `4x_name` exporting `powerclip/baselines/name.py` with a config
#   dataclass of its paper's defaults and a `Method` subclass registered by name (`@register("name")`). It declares what
#   it needs of a batch (`needs()`), gathers through `dist.gather`, builds its InfoNCE from `loss.contrastive_rows`,
#   keeps training-time modules in `build_modules` (saved beside the model as `method_modules.pt`) and says how it is
#   scored (`scorers`). Add a preset of its paper's recipe in `powerclip/presets/`, a case in `tests/test_ddp.py`
#   (two processes equal one) and in `tests/test_baselines.py` (trains by name, resumes exactly), and a row in
#   `compare.RUNS` with its regime.
# - **A new metric or benchmark data set**: the metric as a pure function in `60_eval_metrics` (ties count against
#   the correct candidate); a reader in `61_eval_data` (regions: `61a_eval_region_data`); a paper benchmark in the
#   registry of `63_eval_benchmarks`.
# - **A new evaluation task**: its runner (an `Evaluator`, the reader's data, a scorer -> numbers in percent) and one
#   `Task` record registered in `64_eval_tasks` (`register_task`: its loader, runner, skip rule, headline metrics with
#   their display names, whether it is scored per scorer). `--tasks`, the runs, the skip report and the side-by-side
#   table read the registry; a paper table of it is one function in `PAPER_LAYOUTS` (`65_eval_tables`). The
#   comparison's numbers on the world are `68_eval_world_scores`' (`WORLD_TASKS`, `HEADLINE`).
# - **A speed or memory measurement**: a script in `benchmarks/` that reports a ratio against a baseline run in the
#   same session (`measure.run_isolated`, `PeakMemory`), checks its arguments with `benchmarks/_checks.py` inside
#   `commandline.usage_errors()`, and writes its results to `benchmarks/results/`; never a timed test.
# - **A data-preparation tool**: `data_prep/`, on the `commandline` convention, writing webdataset shards.
# - **Tests a notebook cell cannot hold** (several processes, a command line, a killed run): `tests/`.
#
# ## Working on the notebooks
#
# Every notebook `nbs/NAME.ipynb` is paired (jupytext, `jupytext.toml`) with a percent script `nbs/scripts/NAME.py`.
# Edit either, then:
#
# ```bash
# make sync                            # jupytext --sync, nbdev_clean, nbdev_export
# make nbs NB=nbs/10_powerset.ipynb    # re-execute a notebook so that its committed plots and tables are current
# make check                           # what CI checks first: pairs in sync, notebooks clean, the export current
# make docs                            # this site: every notebook a page, the module reference; offline, into _site/
# ```
#
# `nbdev_test` runs every cell of every notebook except those flagged `#| slow` (minutes on a CPU) or `#| cuda`
# (needs a GPU); `.venv/bin/nbdev_test --flags "slow cuda"` runs those too. The docs site (`docs/build_site.py`)
# shows each notebook with the outputs committed with it and runs nothing; this notebook is its home page.
# `nbdev_docs` renders the same notebooks with Quarto (`_quarto.yml`) for those who install it. `README.md` is
# written by hand: `settings.ini` keeps `nbdev_readme` from rendering this notebook over it.
#
# ## House rules
#
# Lines are at most 120 characters long: the notebooks' code cells (exported and test cells alike), the package
# `nbdev_export` writes from them (a notebook's `> subtitle` becomes its module's docstring, so it stays within 114
# characters), the benchmarks, the tests, `data_prep`, `docs` and `.ci`. Where there is logic, one statement per line:
# an `if` that raises puts the `raise` on the line below, no `a = 1; b = 2`, and a function body that does more than
# return a value starts below its `def`. A long docstring is wrapped over several lines, a long message split into
# implicitly concatenated strings.
#
# ruff (`ruff.toml`) is the linter: pycodestyle's errors (E501 line length, E701-E703 several statements on a line,
# ...), its warnings and pyflakes, read from the notebooks themselves. It is not the formatter: `ruff format` would
# undo the aligned per-parameter comments that nbdev's docments renders as tables and the shape comments lined up
# beside the code, so a long line is broken by hand, in the style around it (after a comma or before an operator,
# aligned with the opening bracket). `make check` runs `ruff check .`, then `.ci/check_notebooks.py` (scripts and
# notebooks paired, notebooks clean, the package exported and within 120 columns); `make test` runs `make check` first.
# After editing a notebook: `.venv/bin/ruff check nbs/NAME.ipynb`, then `make sync`.
#
# A measured number is written with the command that measured it and the machine it ran on. Set up and test with the
# two commands of the README (`make demo`, `make test`).
