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
# Read the notebooks in order:
#
# | notebooks | idea |
# |---|---|
# | `12_theory_t2r`, `13_theory_r2t`, `14_approximation` | the theory: LSE bound, softplus powerset expansion (Thm. 1), cosh powerset identity and sandwich (Thm. 2), the Fig. 5/7 experiment |
# | `10_powerset`, `11_loss` | the loss as pure tensor functions, checked against exact enumeration |
# | `20_parsing`, `21_regions`, `22_world`, `23_data` | what feeds the loss: parse trees, region masks, a built-in compositional world, shards |
# | `30_model`, `50_train` | open_clip towers with patch and token embeddings; the one trainer |
#
# Set up and test with the two commands of the README (`make demo`, `make test`).
