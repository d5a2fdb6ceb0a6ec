# One command to set up, one to test, one to run the main job. Everything runs inside .venv.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

# Python caches compiled bytecode (.pyc) so that the next interpreter skips compiling; an environment that sets
# PYTHONDONTWRITEBYTECODE (this workplace's machines do) makes every interpreter compile torch, torchvision's
# torch._dynamo, transformers and timm from source again: `import open_clip` takes 10 s of CPU instead of 4-5, and
# `make test` starts a few hundred interpreters (CLI runs, torchrun ranks, spawned processes). The venv's packages are
# compiled at install (`--compile-bytecode`); the project's own modules are cached on first import.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo compare experiments eval-compare theory test check docs sync nbs export bench gpu-check gpu-wheels gpu-offline real-shards test-torch-lower clean-venv

install: $(STAMP)

# uv resolves and installs the pinned stack (torch CUDA build, which also runs on CPU) in about a minute.
$(STAMP): constraints.txt settings.ini setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip uv
	$(BIN)/uv pip install --compile-bytecode --python $(BIN)/python -c constraints.txt -e ".[dev]"
	touch $(STAMP)

## The main job on its built-in default: CLIP vs PowerCLIP-R vs PowerCLIP-gold on the built-in world, one seed.
demo: install
	$(BIN)/python -m powerclip.compare

## Every method (CLIP, FLIP, CLIP-PGS, A-CLIP, E-CLIP, FILIP, SPARC, C2LIP, C2LIP-CLIP, SmartCLIP, PowerCLIP-R,
## PowerCLIP-gold) on the world, each in its paper's regime, over seeds: means and spreads, paired differences to CLIP
## with 95 % intervals, learning curves (runs/compare/summary.md, curves.png). About an hour on 2 CPU cores; a longer
## budget or a GPU: make compare STEPS=2000 SEEDS="0 1 2 3 4" DEVICE=cuda PRECISION=bf16
STEPS ?=
SEEDS ?=
DEVICE ?=
PRECISION ?=
compare: install
	$(BIN)/python -m powerclip.compare --runs all $(if $(STEPS),--steps $(STEPS)) $(if $(SEEDS),--seeds $(SEEDS)) \
	  $(if $(DEVICE),--device $(DEVICE)) $(if $(PRECISION),--precision $(PRECISION))

## Every task type of powerclip-eval on the comparison's seed-0 checkpoints: the real COCO sample (retrieval,
## SugarCrepe; needs ../shared/data) and a held-out world folder (retrieval, hard negatives, zero-shot,
## linear probe, Winoground); each run folder's config.yaml names its model and method, and every scorer the
## method offers is computed (FILIP: late interaction, then global); side-by-side tables in runs/eval/.
SHARED ?= ../shared/data
eval-compare: install
	$(BIN)/python -m powerclip.eval make-world runs/eval_world --n-images 200
	for d in runs/compare/seed0/*/; do [ -f $$d/model.pt ] || continue; n=$$(basename $$d); \
	  for data in $(SHARED)/coco_sample runs/eval_world; do [ -d $$data ] || continue; \
	    $(BIN)/python -m powerclip.eval run --checkpoint $$d --label $$n \
	      --data $$data --out runs/eval --no-progress || exit 1; done; done
	$(BIN)/python -m powerclip.eval table runs/eval --out runs/eval/table

## The float64 theory checks (Lemma A.1, powerset identities, Theorems 1-2), printed as a table.
theory: install
	$(BIN)/python -m powerclip.theory

## Everything CI runs: notebooks, scripts and package agree, the docs site builds, every cell runs, pytest passes.
## check and docs run side by side (each is one process: the second core would wait); pytest -n 2: each module with a
## costly set-up runs whole on one worker, longest first (tests/conftest.py).
## Every temporary file of the run (the notebooks' scratch folders, pytest's tmp_path, torchrun's) goes in SCRATCH,
## which each run empties first and a passing run removes: a run leaves at most its own behind. SCRATCH is a short
## path in /tmp, one per checkout: DataLoader workers pass tensors over Unix sockets made in TMPDIR, whose paths may
## not exceed 107 bytes. It needs about TEST_DISK_GB of free disk (training runs write checkpoints); with less it stops
## at once and says so, rather than failing test by test. A test that hangs is stopped after TEST_TIMEOUT seconds,
## with its traceback.
SCRATCH      ?= /tmp/powerclip-test-$(shell printf %s "$(CURDIR)" | cksum | cut -d' ' -f1)
TEST_DISK_GB ?= 4
TEST_TIMEOUT ?= 900
test: install
	@mkdir -p "$(SCRATCH)" && df -Pk "$(SCRATCH)" | awk -v need=$(TEST_DISK_GB) 'NR == 2 && $$4 < need * 1048576 { \
	  printf "make test: %.1f GB free for %s, it needs about %d GB\n", $$4 / 1048576, "$(SCRATCH)", need; exit 1 }'
	rm -rf "$(SCRATCH)" && mkdir -p "$(SCRATCH)"
	$(MAKE) --no-print-directory -j2 --output-sync=target check docs
	TMPDIR="$(SCRATCH)" $(BIN)/nbdev_test --n_workers 2 --timing
	TMPDIR="$(SCRATCH)" $(BIN)/python -m pytest -q -n 2 --durations=15 --timeout $(TEST_TIMEOUT) \
	  -o tmp_path_retention_policy=failed tests
	rm -rf "$(SCRATCH)"

## The house rules (ruff.toml): lines of at most 120 characters, one statement per line, no unused or undefined names,
## in the notebooks, benchmarks, tests and scripts (`ruff check --fix` mends the few it can); then paired scripts and
## notebooks in sync, notebooks clean, `nbdev_export` changes nothing, and the package within 120 columns too.
check: install
	$(BIN)/ruff check .
	$(BIN)/python .ci/check_notebooks.py

## The docs site, offline: every notebook a page (prose, math, code, committed outputs; nothing executed) and the
## module reference from the docstrings, into _site/ (open _site/index.html). Fails on a broken page or link. About a
## minute on 2 CPU cores. docs/build_site.py says how; _quarto.yml stays for `nbdev_docs` with Quarto.
docs: install
	$(BIN)/python docs/build_site.py

## After editing nbs/scripts/*.py: refresh the paired notebooks, export the package.
sync: install
	$(BIN)/jupytext --sync nbs/scripts/*.py
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export

## Re-execute notebooks so that their committed outputs (plots, tables) are current: `make nbs NB=nbs/10_powerset.ipynb`.
NB ?= nbs/[0-9]*.ipynb
nbs: sync
	for nb in $(NB); do $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1800 $$nb || exit 1; done
	$(BIN)/nbdev_clean
	$(BIN)/jupytext --sync nbs/*.ipynb

export: install
	$(BIN)/nbdev_export

## The powerset loss at scale (supplement Fig. 9): blocked fast path vs dense vs exact (2^M) vs the CLIP loss, time and
## memory saved for backward, real CC3M node counts; writes benchmarks/results/powerset_scale_*.{md,json,png} (~40 min).
bench: install
	$(BIN)/python benchmarks/powerset_scale.py

## On a machine with a GPU: everything it can show, one part at a time (resumable; --force redoes): loss parity against
## float64, PowerCLIP's ViT-B/16 bf16 step against CLIP's (against 4096 gathered captions, and 256 and 512 local),
## torch.compile, the loss's paths at R = 512, C = 4096, the other methods, real photos, memory, DDP, the comparison at
## 2000 steps; writes benchmarks/results/gpu_<device>/ and prints one table. Without a GPU: one line, exit status 2
## (GPU_CHECK="--dry-run" runs every part on the CPU at toy sizes; GPU_CHECK="--plan --budget 600" prints in a second
## which parts a 600 s job runs, from the seconds one H200 measured). make gpu-check GPU_CHECK="--parts step-C4096"
GPU_CHECK ?=
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK)

## Real photos for the GPU check's `real-shards` part (issue 38): ../shared/data/coco_sample's 239 photos and 1,195
## captions packed as img2dataset shards (one sample per caption, 224 px JPEGs, 16 shards, 18 MiB) into
## REAL_SHARDS/raw (data_prep/pack_coco_sample.py, under a minute), then annotated with spaCy trees and slic regions
## into REAL_SHARDS/annotated (data_prep/annotate_shards.py, CPU only: about 7 minutes on 2 busy cores). Copy
## runs/real_shards with the repository to a GPU node; the part is skipped, with one line, without them.
REAL_SHARDS ?= runs/real_shards
real-shards: install
	$(BIN)/python data_prep/pack_coco_sample.py $(SHARED)/coco_sample --out $(REAL_SHARDS)/raw --overwrite
	$(BIN)/python data_prep/annotate_shards.py $(REAL_SHARDS)/raw --out $(REAL_SHARDS)/annotated --regions slic \
	  --parser spacy --workers 2 --no-progress

## A GPU node with a preinstalled PyTorch and no network (issue 29). On a machine with the network, `make gpu-wheels`
## downloads into one folder (WHEELS) the wheels the training and GPU-check path needs beyond what such a node has
## (constraints-lower.txt, below its "offline wheels" line: open_clip_torch, ftfy, wcwidth, webdataset, braceexpand and
## what they import), for the node's Python and platform (WHEEL_PY, WHEEL_PLATFORMS); copy that folder and the
## repository to the node. There `make gpu-offline` installs them with no network into TARGET (never torch,
## torchvision or numpy: the node's own stay; the repository is read from PYTHONPATH, not installed) and runs the GPU
## check (default --budget 540: one 10-minute job) into GPU_OUT: summary.md, results.json, the log, to copy back.
## A second job with the same command continues it. The node's python: make gpu-offline PY=python3.12
WHEELS ?= runs/gpu_wheels
WHEEL_PY ?= 3.12
WHEEL_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
TARGET ?= runs/gpu_site
GPU_OUT ?= runs/gpu_check_out
gpu-wheels:
	mkdir -p $(WHEELS)
	sed -n '/^# offline wheels/,$$p' constraints-lower.txt | grep -v '^#' | \
	  xargs $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) --implementation cp \
	    $(addprefix --platform ,$(WHEEL_PLATFORMS)) -d $(WHEELS)
	ls $(WHEELS); du -sh $(WHEELS)

gpu-offline:
	$(PY) -m pip install -q --no-index --no-deps --upgrade --target $(TARGET) $(WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(abspath $(TARGET))$${PYTHONPATH:+:$$PYTHONPATH} $(PY) benchmarks/gpu_check.py --out $(GPU_OUT) \
	  $(GPU_CHECK)

## The lower bound, proved: runs/venv-lower gets constraints-lower.txt's stack (torch 2.11, torchvision 0.26, the
## newest numpy the registry serves; none of spaCy, benepar, sam2, clip_benchmark, nbdev), then a 20-step training of
## PowerCLIP on the world, every method's step on the simulated CUDA device (tests/test_cuda_dry_run.py), and the
## Triton S-bar under triton 3.6's interpreter (tests/test_sbar_triton.py: skipped with the reason where that
## interpreter cannot run a loop with runtime bounds under the newest numpy). CI runs it after `make test` (.ci/run).
## The first run downloads torch 2.11 with its CUDA libraries (4.8 GB installed): 34 s from the registry with an empty
## uv cache, then about 2 minutes for the training and the tests on 2 busy cores.
LOWER ?= runs/venv-lower
test-torch-lower: install
	[ -x $(LOWER)/bin/python ] || $(BIN)/uv venv -q --python $(PY) $(LOWER)
	$(BIN)/uv pip install -q --compile-bytecode --python $(LOWER)/bin/python -c constraints-lower.txt \
	  -r constraints-lower.txt pytest pytest-timeout psutil
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(LOWER)/bin/python -c "import torch, torchvision, numpy; \
	  print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'numpy', numpy.__version__)"
	rm -rf runs/torch_lower/train20*    # this target's own scratch run (overwrite=true would keep each old one)
	PYTHONPATH=$(CURDIR) $(LOWER)/bin/python -m powerclip.train --preset smoke --method powerclip max_steps=20 \
	  resume=never out_dir=runs/torch_lower/train20
	PYTHONPATH=$(CURDIR) $(LOWER)/bin/python -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dry_run.py \
	  tests/test_sbar_triton.py

## The paper's ablations on the world (71_experiments): Tables 6, 7, 8, 10, 14, the margin and Fig. 8 (EXP=all), each
## writing runs/experiments/NAME/summary.md with paired differences to PowerCLIP-R; EXP=fig9 runs the cost benchmark,
## EXP=anatomy measures why PowerCLIP-R loses here (gradients of the two terms, S-bar against the margin, mask coverage).
## About 20 minutes per table on 2 CPU cores (shared rows train once); make experiments EXP="table6 table14" SEEDS="0 1 2"
EXP ?= all
experiments: install
	$(BIN)/python -m powerclip.experiments $(EXP) $(if $(STEPS),--steps $(STEPS)) $(if $(SEEDS),--seeds $(SEEDS)) \
	  $(if $(DEVICE),--device $(DEVICE)) $(if $(PRECISION),--precision $(PRECISION))

clean-venv:
	rm -rf $(VENV)
