"""The one config tree: the training run and each algorithm's options, as dataclasses that
round-trip to JSON with type checks (STYLE.md "Configs", "One source of truth").

Every default is defined once, here. :class:`TrainConfig` holds what every algorithm shares (the
network, the batch size ``B``, the learning-rate schedule, the devices, evaluation); its field
``algorithm_params`` holds the chosen algorithm's own options as a typed
:class:`AlgorithmConfig` subclass (given as a dict, e.g. from JSON or ``--algo-param``).
:class:`xmc_engine.XMCClassifier` derives its parameters from :class:`TrainConfig`'s fields and
``xmc-engine train --print-config`` prints the whole tree. Measured reasons for the defaults are
in ``bench/RESULTS.md``.

This module imports nothing from the engine but :mod:`xmc_engine.errors` and the fault-spec
parser of :mod:`xmc_engine.faults` (itself a leaf), so every layer can read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from xmc_engine.errors import ConfigError
from xmc_engine.faults import parse_faults

__all__ = [
    "ALGORITHMS",
    "AUTO_MERGE_PERIOD_PAPER_WEIGHTS",
    "AUTO_MERGE_PERIOD_TOUCHED",
    "AUTO_PER_ITEM_WEIGHTS",
    "AUTO_WEIGHTS_LABELS",
    "AUTO_WEIGHTS_LOSSES",
    "BACK_TO_BEST_STALE_Z",
    "BACK_TO_BEST_Z",
    "BATCH_RULES",
    "DEFAULT_LR",
    "DEFAULT_LR_BCE",
    "DEFAULT_LR_DECAY",
    "EVAL_ROWS",
    "FLAG_RULES",
    "HELDOUT_LOGITS",
    "KEEP_BEST_MIN_ROWS",
    "KEEP_BEST_Z",
    "LOSSES",
    "LOSS_PROBE_HELDOUT",
    "LOSS_PROBE_HELDOUT_SHARE",
    "LOSS_PROBE_MIN_ROWS",
    "LOSS_PROBE_SAMPLES",
    "LOSS_PROBE_SECOND_LOOK_SHARE",
    "LOSS_PROBE_SOFTMAX_Z",
    "LOSS_PROBE_SOFTMAX_Z_SAMPLED",
    "OPTIMIZERS",
    "OUTPUTS",
    "PLATEAU_FACTOR",
    "PLATEAU_HOLDOUT_ROWS",
    "PLATEAU_MIN_ROWS",
    "PROBED_SOFTMAX_DECAY",
    "TRAIN_LOSSES",
    "WEIGHT_BY",
    "AdaptiveConfig",
    "AlgorithmConfig",
    "AverageConfig",
    "ConfigMixin",
    "CrossbowConfig",
    "EASGDConfig",
    "SingleConfig",
    "SyncConfig",
    "TrainConfig",
]

#: Optimizers of :class:`~xmc_engine.model.MLPReplica`.
OPTIMIZERS = ("sgd", "adagrad")
#: Training losses of the output layer: the softmax cross-entropy against ``y/|y|``, or the
#: one-vs-all logistic loss (binary cross-entropy).
TRAIN_LOSSES = ("softmax", "bce")
#: :class:`TrainConfig` ``loss`` values: a training loss, or ``"auto"`` (a short probe picks
#: one, :func:`xmc_engine.training.choose_loss`).
LOSSES = (*TRAIN_LOSSES, "auto")
#: ``loss="auto"``'s probe (:func:`xmc_engine.training.choose_loss`): each loss trains the
#: first ``LOSS_PROBE_SAMPLES`` rows of the run's own first epoch (fewer on a small set, where
#: ``LOSS_PROBE_HELDOUT`` rows and a batch must remain) and is scored by P@1 on the
#: ``LOSS_PROBE_HELDOUT`` rows that epoch trains next (``LOSS_PROBE_HELDOUT_SHARE`` of the rows
#: at most); below ``LOSS_PROBE_MIN_ROWS`` rows there is no probe and the softmax trains.
#: 20,000 samples were chosen on the shared sets (``bench/RESULTS.md``, "Defaults", the
#: training loss): with one epoch over 10,000 rows the probe of the time (before
#: ``LOSS_PROBE_SOFTMAX_Z``) picked the softmax on stackex_cs, rcv1sub1 and stackex_cooking,
#: where the logistic loss is ahead after 5 epochs. The first epoch's start since
#: ``bench/RESULTS.md``, "The probe trains the start of the run's first epoch".
LOSS_PROBE_SAMPLES = 20_000
LOSS_PROBE_HELDOUT = 2_000
LOSS_PROBE_MIN_ROWS = 2_000
#: The largest share of the training rows the probe holds out: on a set of under
#: ``LOSS_PROBE_SAMPLES`` rows it is what the fits do not train of the first epoch. 0.05
#: against 0.1 (``bench/bench_probe_heldout.py``, ``bench/RESULTS.md``, "Defaults", "How many
#: rows the probe holds out", with the probe of the time, whose held-out rows the run trained
#: last): on 3,000 synthetic rows where the softmax is ahead its margin fell from 2.38 to 0.33
#: standard errors and the probe picked the logistic loss. Not taken.
LOSS_PROBE_HELDOUT_SHARE = 0.1
#: The probe keeps the logistic loss unless the softmax is ahead of it on the held-out rows by
#: more than ``LOSS_PROBE_SOFTMAX_Z`` standard errors of the paired difference in P@1 (per row:
#: 1 where only the softmax's top label is right, -1 where only the logistic loss's is,
#: :func:`xmc_engine.training.pick_loss`). Held-out P@1 alone tells the losses apart by chance
#: on a small set (500 held-out rows: a standard error of about 0.02), and there the logistic
#: loss is the better bet: continued from the probe it was ahead on all nine shared sets, and
#: the softmax far ahead on the synthetic shapes, by 7 to 24 standard errors (``python
#: bench/bench_loss_rule.py``, ``bench/RESULTS.md``, "Defaults", "Which loss when the probe
#: cannot tell").
LOSS_PROBE_SOFTMAX_Z = 2.0
#: The same margin where the run trains the sampled output layer (``output="auto"`` picks it on
#: large label spaces). There the probe's 20,000 samples are a small part of an epoch (4 % at
#: the Amazon-670K shape) and the softmax's lead grows with training where it has one: with
#: frequency negatives the margin at the Amazon-670K shape was +13.8 / +1.44 / +9.88 / +6.75 /
#: +5.21 over seeds 0-4, and seed 1, at 2, trained the logistic loss: P@1 0.6816 against the
#: softmax's 0.7586 after 150 s on one device; at 100,000 labels the seed of margin +1.6 lost
#: P@5 0.03 with the logistic loss. On debian_builddeps, the one
#: shared set with the sampled layer, the logistic loss is ahead (0.8551 against 0.8326, ten
#: seeds) and its margins were -4.24..+0.86 over seeds 0-9, all below 1 (``bench/RESULTS.md``,
#: "The loss probe on the sampled output layer"). No margin separates the two sets: over more
#: seeds debian_builddeps reached +0.88 (40 seeds) and the Amazon-670K shape fell to +0.63 (15
#: seeds; one of them trains the logistic loss at 1), and a probe of a sixth of that epoch
#: did not widen the gap (``bench/bench_probe_margin.py``; "The margin over more seeds"); a
#: second look (:data:`LOSS_PROBE_SECOND_LOOK_SHARE`) decides where the first is thin.
LOSS_PROBE_SOFTMAX_Z_SAMPLED = 1.0
#: The loss probe's second look (:func:`xmc_engine.training.second_look_samples`): where the
#: run trains the sampled output layer, the first look's rows are less than this share of the
#: epoch and the softmax is ahead by a margin above 0 but not above :data:`LOSS_PROBE_SOFTMAX_Z`,
#: both losses train again on this share of the epoch and that look decides (with
#: :data:`LOSS_PROBE_SOFTMAX_Z_SAMPLED`). At the Amazon-670K shape (``bench/bench_probe_margin.py
#: --data synthetic-amazon670k --seeds 0-14``, ``bench/RESULTS.md``, "The loss probe's second
#: look") the first look's margins were +0.63 to +13.81; the two under 2 (+0.63, which had
#: trained the logistic loss, and +1.12) were +4.66 and +7.56 after a sixth of the epoch, so the
#: softmax trains on all fifteen seeds, at 33-35 s of probing instead of about 15 s on those
#: two; seed 14 then ends 150 s of one device at P@1 0.7826 where the logistic loss it trained
#: before ends at 0.7352. A sixth is the one longer probe measured: after a sixth of the epoch
#: the margins were +1.17 to +8.07 over the fifteen seeds ("The margin over more seeds"), all
#: above 1; shorter second looks were not measured. Every shared set's probe sees more than a
#: sixth of its epoch and looks once (debian_builddeps, the one with the sampled layer: the
#: logistic loss on all forty seeds, as before).
LOSS_PROBE_SECOND_LOOK_SHARE = 1 / 6
#: ``TrainConfig.ensemble`` on one CPU device of several cores: the members train side by side,
#: one thread each, unless the first member's thread calibration found all the device's
#: threads at least this many times as fast as one for its step. A member trained beside
#: another on the 2-core machine took 0.9x-1.4x its seconds alone (means per shared set,
#: ``K`` = 2 and 3; the most: imdb, 1.41x), so two lanes train members at least 2 / 1.41 = 1.4
#: times as fast as one lane; the calibration found two threads 0.1x-1.4x as fast as one on
#: the shared sets (``bench/bench_ensemble.py --lanes``, ``bench/RESULTS.md``, "Ensembles").
LANES_MAX_SPEEDUP = 1.4
#: ``TrainConfig.keep_best``: the best held-out epoch's model replaces the last one where its
#: held-out hits are ahead of the last model's by more than this many standard errors of the
#: paired per-row difference (:func:`xmc_engine.training.paired_z`, the loss probe's
#: statistic). Without a margin (the higher held-out P@1 wins), 10 epochs at the synthetic
#: 100,000-label shape kept epoch 9's model by chance over 2,000 held-out rows, 0.004 test P@1
#: below the last (``bench/RESULTS.md``, "Defaults", "The best epoch's model").
KEEP_BEST_Z = 2.0
#: ``TrainConfig.back_to_best``: at a halving, training goes on from the best epoch's model
#: where its held-out hits are ahead of those just read by more than this many standard errors
#: of the paired difference (the same statistic as :data:`KEEP_BEST_Z`), or by more than
#: :data:`BACK_TO_BEST_STALE_Z` where the best epoch is at least two epochs old (the held-out
#: P@1 has not risen for two epochs). Chosen by ``bench/bench_continue_probe.py --option
#: back_to_best`` (``bench/RESULTS.md``, "Defaults", "Going back to the best epoch's model at a
#: halving"): a margin of 1 throughout gained imdb 0.002-0.004 P@1 on one device and 0.0065
#: with ``adaptive``, but went back on three synthetic shapes whose held-out P@1 was still
#: rising (a dip of one epoch, late) and cost them up to 0.0024; with 1 only for a best epoch
#: two or more epochs old, imdb kept those gains (+0.0024 / +0.0042 at 5 / 10 epochs on one
#: device, +0.0100 with ``adaptive``, ten seeds) and it never acted on the synthetic shapes.
BACK_TO_BEST_Z = 2.0
BACK_TO_BEST_STALE_Z = 1.0
#: Output-layer modes of training (:class:`TrainConfig` ``output``); inference is always exact.
#: ``"auto"`` picks one of the first two from the data (:meth:`TrainConfig.output_for`).
OUTPUTS = ("exact", "sampled", "auto")
#: What :func:`xmc_engine.validation.normalize_rows` does to each feature row before the model
#: sees it (:class:`TrainConfig` ``normalize``).
NORMALIZE = ("l2", "none")
#: How a sampled step draws its negatives (:class:`TrainConfig` ``negative_sampling``). The
#: default, ``"frequency"``, was chosen by ``bench/bench_sampled.py --engine-defaults
#: --negative-sampling uniform frequency`` (``bench/RESULTS.md``, "Negatives by label frequency
#: by default"): with every other default, P@1 +0.017 / +0.024 over uniform on the synthetic
#: 30K / 100K-label shapes after 10 epochs (every seed), +0.0025 on debian_builddeps (P@3 / P@5
#: +0.003, every seed), and about +0.06 for one device and ``adaptive`` in 150 s at the
#: Amazon-670K shape.
NEGATIVE_SAMPLING = ("uniform", "frequency", "lsh")
#: ``output="auto"`` (the default) trains the sampled output layer when the label space is at
#: least this many times a sampled step's output width (the base batch's expected positive labels
#: plus ``negatives``), the exact softmax otherwise (:meth:`TrainConfig.output_for`). Chosen by
#: ``bench/bench_sampled.py --engine-defaults`` (``bench/RESULTS.md``, "Sampled output layer"):
#: with every other default, sampling reached the exact model's P@1 - 0.01 3.3x sooner at ratio
#: 13.5 (debian_builddeps), 2.3x at 7.8 and 7.2x at 23 (synthetic 10K / 30K labels); below 1
#: (delicious, debian_debtags) a batch's positives cover most labels and it buys nothing. 8 is
#: conservative: 7.8 already won, nothing between 0.5 and 7.8 was measured.
AUTO_SAMPLED_RATIO = 8.0
#: Neighbours of each of the two votes blended into predictions (``TrainConfig.neighbours``,
#: :mod:`xmc_engine.neighbours`): the training rows nearest a query row in the network's last
#: hidden layer, and in the input features. Chosen with :data:`NEIGHBOURS_NETWORK_WEIGHT` by
#: ``bench/bench_neighbours.py --grid`` (``bench/RESULTS.md``, "Neighbour votes at
#: prediction"): of 10, 25, 50 and 100 neighbours x network weights 0.3-0.7, 25 at 0.5 had the
#: best mean P@1 and P@5 over the eight shared sets that train the logistic loss (3 seeds).
NEIGHBOURS_K = 25
#: Each neighbour's vote is its cosine similarity to this power (1 to 8 gave P@k within 0.001
#: on debian_builddeps; a higher power leans on the nearest rows).
NEIGHBOURS_POWER = 3.0
#: The network's probability's share of a label's score; the mean of the two neighbour votes
#: has the rest (chosen with :data:`NEIGHBOURS_K`).
NEIGHBOURS_NETWORK_WEIGHT = 0.5
#: ``neighbours="auto"`` votes with the training rows up to this many of them: the exact search
#: costs every query row a product with every training row. Measured ("Neighbour votes at
#: prediction", three seeds): the largest shared set, imdb (96,735 training rows), still gained
#: (P@1 +0.003) and ranked its 24,184 test rows in 10 s against 0.05 s for the network alone;
#: larger sets were not measured.
NEIGHBOURS_MAX_ROWS = 100_000
#: The training losses with which ``neighbours="auto"`` votes: the logistic loss, which the loss
#: probe picks on every shared dataset and where the votes raised P@k; on the synthetic shapes,
#: where it picks the softmax, the votes lowered P@1 ("Neighbour votes at prediction").
NEIGHBOURS_LOSSES = ("bce",)
#: With the softmax ``neighbours="auto"`` votes where ``loss="auto"``'s probe found it ahead of
#: the logistic loss by fewer than this many standard errors (the ``loss_probe`` record's
#: ``z``): the softmax won a close call, as on the shared sets' few seeds that pick it (their
#: margins reach +3.5 over ten seeds, ``bench/results/loss_rule_probe_start.json``), not by far,
#: as on the synthetic shapes (+10.7 and up), where the votes lose. Measured: "Neighbour votes
#: at prediction", the softmax forced on the shared sets.
NEIGHBOURS_SOFTMAX_Z = 6.0
#: Each optimizer's learning rate when ``TrainConfig.lr`` is ``None``: of
#: ``bench/bench_defaults.py``'s grid, the value with the best mean P@1 over the datasets
#: (``bench/RESULTS.md``, "Defaults"). Adagrad's 0.05 is within 0.03 of each dataset's best
#: learning rate; SGD's best varies from 0.25 (bibtex) to 4 (debian_debtags).
DEFAULT_LR = {"sgd": 2.0, "adagrad": 0.05}
#: Adagrad's learning rate when ``TrainConfig.lr`` is ``None`` and ``loss="bce"``: of 0.05 / 0.1 /
#: 0.2, the best mean P@1 at 5 epochs over the eleven sets of ``bench/bench_defaults.py
#: --loss-study`` (0.6179 against 0.6143 at 0.05) and over the nine shared ones (0.6103 against
#: 0.6088). SGD with the logistic loss was not measured: it keeps its softmax rate.
DEFAULT_LR_BCE = {"sgd": DEFAULT_LR["sgd"], "adagrad": 0.1}
#: Each optimizer's learning-rate decay ``λ`` (``lr / (1 + λ e)`` over whole epochs ``e``) when
#: ``TrainConfig.lr_decay`` is ``None``. Adagrad's 0.5: ``bench/bench_defaults.py --decay-study``
#: (``bench/RESULTS.md``, "Defaults", learning-rate decay): of lr 0.02 / 0.05 / 0.1 x decay
#: 0 / 0.25 / 0.5 / 1 on ten datasets, lr 0.05 with decay 0.5 had the best mean P@1 at 5 epochs
#: (0.6056 against 0.5947 without decay) and the smallest worst shortfall against a dataset's
#: best configuration at 5 and at 15 epochs (0.023 / 0.022 against 0.061 / 0.108 without
#: decay, which overfits on the small sets). SGD (the paper's, not in that study) keeps none.
DEFAULT_LR_DECAY = {"sgd": 0.0, "adagrad": 0.5}
#: ``lr_decay="auto"`` below :data:`PLATEAU_MIN_ROWS` training rows where ``loss="auto"``'s probe
#: compared the two losses and found the softmax clearly ahead (it trains the softmax): this
#: decay instead of :data:`DEFAULT_LR_DECAY`. The fixed decay was chosen on the shared sets,
#: which overfit after a few epochs and where the probe picks the logistic loss; the sets where
#: it picks the softmax learn for longer. ``bench/bench_defaults.py --schedule-study``
#: (``bench/RESULTS.md``, "The decay where the probe picks the softmax"): with every other
#: default, no decay against 0.5 raised P@1 on the synthetic shapes by 0.022 / 0.021 (synth1k,
#: 5 / 15 epochs, three seeds) and by about 0.04 (synth10k), while the softmax forced on the
#: nine shared sets lost 0.009 / 0.023 of mean P@1 without decay (so a loss given, or a set too
#: small for the probe, keeps the fixed decay).
PROBED_SOFTMAX_DECAY = 0.0
#: ``TrainConfig.lr_decay="plateau"``: the rate is multiplied by ``PLATEAU_FACTOR`` after every
#: epoch whose P@1 on ``PLATEAU_HOLDOUT_ROWS`` training rows held out of training (drawn with
#: the run's seed) is not above the best of the epochs before
#: (:class:`~xmc_engine.scheduler.controller.Plateau`).
PLATEAU_FACTOR = 0.5
PLATEAU_HOLDOUT_ROWS = 2_000
#: The plateau rule stops training after the first epoch that leaves its multiplier below this
#: (six halvings without recovery: the rate is 1/64 of the base). Chosen by
#: ``bench/bench_plateau_stop.py`` (``bench/RESULTS.md``, "When the plateau rule stops"): over
#: the committed 15-minute runs at the Amazon-670K shape, stopping there cost at most 0.0006
#: test P@1 against training to the end and saved 10 % of their training time (up to 352 s of
#: a 900 s run, whose rate had gone on halving to 2e-7); stopping below 1/16 or 1/8 cost up to
#: 0.0014 / 0.0024. In a real run (the same seed) it stopped after 521 s, P@1 0.7930.
PLATEAU_STOP_SCALE = 1 / 32
#: ``lr_decay="auto"`` (the default) with Adagrad: the plateau rule on data with at least this
#: many training rows (where the held-out rows are at most 5 % of them), the fixed decay of
#: :data:`DEFAULT_LR_DECAY` below, where holding rows out costs more than the rule gains.
PLATEAU_MIN_ROWS = 40_000
#: ``TrainConfig.keep_best`` with the fixed decay ``lr_decay="auto"`` gives below
#: :data:`PLATEAU_MIN_ROWS`: from this many training rows the run holds
#: :data:`PLATEAU_HOLDOUT_ROWS` of them out of training as the plateau rule does (a tenth at
#: most), reads their P@1 after each epoch without changing the rate, and ends with the best
#: epoch's model where the last one is clearly behind it (:data:`KEEP_BEST_Z`). Below it the
#: run trains every row and ends with its last model. Kept at the plateau rule's threshold by
#: ``bench/bench_keep_best.py --every-row`` (``bench/RESULTS.md``, "Defaults", "The best
#: epoch's model below 40,000 rows"): at 10 epochs on ten sets of 4,500-30,000 rows the held-out
#: rows cost 0.001-0.015 P@1 on nine, and keeping the best epoch won it back only on rcv1sub1
#: (level) and debian_builddeps (P@1 +0.0025, but P@3 -0.009 and P@5 -0.013).
KEEP_BEST_MIN_ROWS = PLATEAU_MIN_ROWS
#: Logits a block of :func:`xmc_engine.model.heldout_hits` holds at most (rows x label chunk,
#: 64 MiB): the plateau rule's workspace.
HELDOUT_LOGITS = 1 << 24
#: Batch-size rules of :class:`~xmc_engine.scheduler.controller.BatchSizeController`.
BATCH_RULES = ("step", "proportional", "fixed")
#: When adaptive normalization applies (:class:`~xmc_engine.scheduler.merge.NormTrend`).
FLAG_RULES = ("norm_rise", "always", "never")
#: merge weights of a W1 row (AdaptiveConfig.row_weights; "auto" resolves to one of them)
ROW_WEIGHTS = ("updates", "touched", "sum", "sum_sqrt", "sum_sqrt_unequal")
#: the row weights of those that merge each W1 row over the replicas that changed it (per row)
PER_ROW_WEIGHTS = ("touched", "sum", "sum_sqrt", "sum_sqrt_unequal")
#: the row weights that give a row ``k > 1`` replicas changed the sum of their changes, each
#: with the power of ``k`` the sum is scaled by (``"sum_sqrt"``: the sum over ``sqrt(k)``;
#: ``"sum_sqrt_unequal"``: that only in periods where the replicas' batches differed, from
#: ``AdaptiveConfig.sqrt_from_epoch`` on, the plain sum elsewhere,
#: :meth:`AlgorithmConfig.row_sum_power_for`)
ROW_SUM_POWERS = {"sum": 0.0, "sum_sqrt": 0.5, "sum_sqrt_unequal": 0.5}
#: merge weights of an output label (AdaptiveConfig.label_weights; "auto" likewise)
LABEL_WEIGHTS = ("updates", "positives")
#: The per-row / per-label merge weights that depart from the paper: what ``"auto"`` gives
#: below :data:`AUTO_WEIGHTS_LABELS` labels with the losses of :data:`AUTO_WEIGHTS_LOSSES`.
#: ``"sum"`` rather than ``"touched"`` for ``W1`` (both keep a row one replica changed whole;
#: ``"sum"`` gives a row several changed the sum of their changes, not their weighted mean):
#: on equal devices the weighted mean halved (thirded) every shared row's update and
#: ``adaptive`` missed the synthetic targets, with the sum it reached them, 2.5-3.1x sooner
#: than ``sync`` at 30,000 labels; level on ``cpu,cpu@0.5``, level in time and 0.005 P@1
#: lower on three unequal devices (``bench/RESULTS.md``, "The sum of the replicas' changes on
#: shared rows"). ``"sum_sqrt_unequal"`` rather than ``"sum"``: where the devices' batches
#: differ, the sum over ``sqrt(k)`` ended higher in nine of twelve comparisons over two runs
#: of the six heterogeneous cells of the synthetic 10,000-, 30,000- and 100,000-label shapes
#: (mean +0.004 P@1; +0.004 to +0.011 at 100,000 labels, within the runs' spread at 30,000),
#: level in time (0.74-1.30x); on two equal devices (equal batches) the plain sum ended 0.008
#: higher at 10,000 and 30,000 labels, so it stays there (5 seeds each, "The sum over the
#: square root of the number of replicas where the batches differ"); and only from the second
#: epoch (``AdaptiveConfig.sqrt_from_epoch``), "The square root from the second epoch".
AUTO_PER_ITEM_WEIGHTS = {"row_weights": "sum_sqrt_unequal", "label_weights": "positives"}
#: What configs saved before ``"auto"`` existed merged with (their ``from_saved`` value).
PER_ITEM_WEIGHTS = {"row_weights": "touched", "label_weights": "positives"}
#: ``AdaptiveConfig``'s ``"auto"`` merge weights, by the data's label count. Below this many
#: labels ``row_weights="auto"`` / ``label_weights="auto"`` are the per-row / per-label weights
#: (:data:`AUTO_PER_ITEM_WEIGHTS`), from it on the paper's (``"updates"``); and
#: ``weights_from_epoch="auto"`` (for per-row / per-label weights given explicitly) is 0 below
#: and 1 from it on. The per-row / per-label weights win up to 100,000 labels (debian_builddeps,
#: the 30,000- and 100,000-label synthetic shapes; ``bench/RESULTS.md``, "Synthetic 30,000
#: labels"); from epoch 1 they were ahead of from the start at 335,000 labels and at the
#: Amazon-670K shape's 670,091 ("From which epoch the per-row / per-label weights apply"; level
#: at 150,000-220,000, the threshold inside that crossover); and with the held-out plateau
#: schedule (``lr_decay="auto"`` there) the paper's weights throughout ended 15 minutes at the
#: Amazon-670K shape 0.034 P@1 above them ("The merge weights under the plateau schedule").
#: And only with the losses of :data:`AUTO_WEIGHTS_LOSSES`. ``weight_by="auto"`` follows the same
#: line: the shares of rows below it, the paper's shares of updates from it on (at the
#: Amazon-670K shape in 15 minutes the shares of rows ended 0.012 / 0.026 P@1 below, "The merge
#: weights by samples").
AUTO_WEIGHTS_LABELS = 200_000
#: ``AdaptiveConfig.b_max="auto"``: the largest batch the step rule may give a device, in base
#: batches (``batch_size``). The paper's bound is 1,024 rows; where the slowest device cannot
#: make as many updates as the others even at ``b_min`` (three devices on two cores), the rule
#: kept raising the fastest one's batch, and linear scaling its rate, to 7x the base at
#: synthetic 100,000 labels, where its final P@1 stalled 0.014-0.024 below one device's; 4x
#: ended 0.015 higher at the same time to the target ("Why `adaptive` falls behind at 100,000
#: labels on three devices", ``bench/RESULTS.md``).
AUTO_B_MAX_BATCHES = 4
#: ``AdaptiveConfig.batch_scale="auto"``: ``adaptive``'s base batch ``B`` (the batch every
#: device starts at, the rate ``lr`` belongs to, ``b_max``'s unit) in ``batch_size``s where the
#: per-row merge weights apply (the softmax below :data:`AUTO_WEIGHTS_LABELS` labels) on at
#: least :data:`AUTO_BATCH_SCALE_MIN_ROWS` training rows; 1 elsewhere. ``sync`` steps one model
#: on ``n`` devices' batches at once, and one device at a larger batch ends higher on the
#: synthetic softmax shapes ("What the three-device gap at 10,000 labels is made of").
#: ``bench/RESULTS.md``, "The base batch of `adaptive` with the softmax": at 10 epochs, 3
#: seeds, a base batch of 128 against 64 ended higher on all 11 cells of the 1,000- to
#: 100,000-label shapes on three device sets (median final P@1 +0.001 to +0.019), sooner to
#: the target on seven, later on three (1.12x-1.54x).
AUTO_SOFTMAX_BATCH_SCALE = 2
#: ``batch_scale="auto"`` doubles the base batch only from this many training rows (the
#: ablation's smallest set had 10,000): on fewer, twice the batch halves an epoch's few steps,
#: and the tests' sets of a few hundred rows fell out of their quality bands; not measured
#: below it, so the paper's base batch stays there.
AUTO_BATCH_SCALE_MIN_ROWS = 10_000
#: ``AdaptiveConfig.merge_period="auto"``: the period, in samples, where a ``W1`` row's merge
#: weights are renormalized over the replicas that touched it (``row_weights`` resolving to
#: a per-row weight: the softmax below :data:`AUTO_WEIGHTS_LABELS` labels), and elsewhere
#: (:data:`AUTO_MERGE_PERIOD_PAPER_WEIGHTS`). A shorter period leaves more rows changed by one
#: replica alone, whose update the renormalized weights then keep whole; with the paper's
#: weights that mechanism is absent. Chosen by issue 15's runs at the synthetic shapes, whose
#: probe picks the softmax (``bench/RESULTS.md``, "A shorter merge period with the per-row
#: weights"); the real sets train the logistic loss with the paper's weights and keep 4,096.
AUTO_MERGE_PERIOD_TOUCHED = 1024
#: ``AdaptiveConfig.merge_period="auto"`` with the paper's merge weights: the period chosen in
#: ``bench/RESULTS.md``'s "The merge period against the label count" (no shorter period served
#: the real sets better).
AUTO_MERGE_PERIOD_PAPER_WEIGHTS = 4096
#: ``AdaptiveConfig.solo_epochs="auto"``: the epochs the first device trains alone at the start
#: of a run on the logistic loss below :data:`AUTO_WEIGHTS_LABELS` labels (none elsewhere).
#: There the merge is the paper's weighted mean, and early in training the mean of ``k``
#: replicas' steps makes about ``1/k`` of one model's progress: in step 3's runs ``adaptive``
#: needed 1.9x-3.7x one device's epochs to 80 % of the best P@1 on debian_debtags, delicious
#: and rcv1sub1, and 1.3x-2.4x to 97 % on the four real sets (``bench/RESULTS.md``, "One
#: device first, then the replicas"), where the synthetic shapes, trained with the softmax and
#: the per-row sum, need fewer epochs than one device from the start (they keep none). On
#: those four sets (5 seeds) half an epoch alone reached 97 % of the best 0.60x-0.94x as late
#: on nine of twelve cells (a quarter epoch did less) and ended higher on eight; with every
#: method in one run, one device's time was then 0.92x-1.22x of ``adaptive``'s on ten cells
#: (before: 0.45x-0.89x on seven) and the final P@1 within 0.005 of the best on ten (seven).
#: 0.75 and 1.0 epochs against 0.5 showed no direction (0.89x-1.17x the time, final P@1
#: -0.007..+0.005: "A longer solo phase, and one device's periods in it").
AUTO_SOLO_EPOCHS = 0.5
#: ``AdaptiveConfig.solo_epochs="auto"`` gives :data:`AUTO_SOLO_EPOCHS` on data of fewer
#: training rows than this (the plateau rule's threshold, :data:`PLATEAU_MIN_ROWS`). Measured:
#: it helped on the four real sets of 4,800-27,235 rows and cost imdb (96,735 rows, where the
#: averaged replicas need fewer epochs than one device from the start) 2.2x the time to its
#: target on two of three device sets and 0.003-0.005 of final P@1. In between, the synthetic
#: 10,000-label shape trained with the logistic loss gained from the phase at 30,000 and at
#: 60,000 rows (final P@1 +0.008 to +0.028 on two device sets), so this limit is not where the
#: phase stops helping; one shape and imdb (28 labels) do not place a better line.
AUTO_SOLO_MAX_ROWS = PLATEAU_MIN_ROWS
#: The training losses with which ``"auto"`` gives the per-row / per-label weights (below
#: :data:`AUTO_WEIGHTS_LABELS` labels); with the one-vs-all logistic loss it gives the paper's.
#: Measured with the defaults of ``ec71655`` (``bench/RESULTS.md``, "The merge weights by the
#: loss"), ``adaptive`` on ``cpu,cpu`` and ``cpu,cpu@0.5``, 5 seeds, the paper's weights against
#: the per-row / per-label ones: with the logistic loss (what ``loss="auto"`` picks on the
#: real sets) they reached the target in 0.65-0.71x the time on debian_debtags (final P@1
#: +0.007-0.008), 0.77-0.90x on delicious and 0.90-0.92x on debian_builddeps (final P@1 within
#: 0.002); with the softmax on debian_builddeps in 1.06-1.17x (final within 0.0025), and on the
#: synthetic 30,000-label shape, whose probe picks the softmax, see that section.
AUTO_WEIGHTS_LOSSES = ("softmax",)


def _paper_weights(n_labels: int, loss: str) -> bool:
    """Whether ``adaptive``'s ``'auto'`` options keep the paper's merge weights: from
    :data:`AUTO_WEIGHTS_LABELS` labels or with a loss outside :data:`AUTO_WEIGHTS_LOSSES`."""
    return n_labels >= AUTO_WEIGHTS_LABELS or loss not in AUTO_WEIGHTS_LOSSES


#: what a replica's merge weight is the share of (AdaptiveConfig.weight_by)
WEIGHT_BY = ("samples", "updates")
#: what a merge does to the replicas' Adagrad accumulators (AdaptiveConfig.optimizer_state)
OPTIMIZER_STATES = ("keep", "average", "reset")
#: a device's learning rate against its batch size (AdaptiveConfig.lr_scaling)
LR_SCALINGS = ("linear", "sqrt", "none")
#: Rows per chunk of top-k prediction (evaluation and ``predict_topk``); the memory planner
#: sizes the prediction workspace with it.
EVAL_ROWS = 4096


# -- JSON round trip with type checks --------------------------------------------------------------
def _type_ok(value, hint) -> bool:
    """Whether ``value`` (as read from JSON or given in Python) fits the annotation ``hint``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:  # a finite real: NaN and infinities pass no comparison check below
        return (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value))
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, (list, tuple)) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _type_name(hint) -> str:
    name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    return name.replace("float", "a finite float")


class ConfigMixin:
    """JSON round trip for config dataclasses: unknown keys and values of the wrong type are
    :class:`~xmc_engine.errors.ConfigError` naming the key and where it came from."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config"):
        """Build from a mapping (e.g. parsed JSON); ``source`` names it in error messages."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, unknown))} for "
                              f"{cls.__name__}; valid keys: {', '.join(sorted(names))}")
        hints = typing.get_type_hints(cls)
        for k, v in d.items():
            if not _type_ok(v, hints[k]):
                raise ConfigError(f"{source}: {cls.__name__}.{k} must be "
                                  f"{_type_name(hints[k])}, got {v!r}")
        try:
            return cls(**d)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "config"):
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        return cls.from_dict(d, source=source)

    def _is_auto(self, name: str, what: str) -> bool:
        """Whether field ``name`` (a number or ``'auto'``) is ``'auto'``; ``ConfigError`` naming
        ``what`` it must otherwise be for any other string."""
        value = getattr(self, name)
        if isinstance(value, str) and value != "auto":
            raise ConfigError(f"{name} must be {what} or 'auto', got {value!r}")
        return value == "auto"

    def _check_min(self, low, *names: str) -> None:
        """``ConfigError`` unless every field in ``names`` is ``>= low`` (one message for all)."""
        values = [getattr(self, n) for n in names]
        if any(v < low for v in values):
            raise ConfigError(f"{' and '.join(names)} must be >= {low}, got "
                              f"{', '.join(str(v) for v in values)}")

    def _check_choice(self, name: str, choices: tuple) -> None:
        """``ConfigError`` unless field ``name`` is one of ``choices``."""
        value = getattr(self, name)
        if value not in choices:
            raise ConfigError(f"{name} must be one of {choices}, got {value!r}")


# -- the algorithms' own options -----------------------------------------------------------------
@dataclass
class AlgorithmConfig(ConfigMixin):
    """Options every algorithm has: how the trainer treats the device set.

    Attributes
    ----------
    rejoin_after : int or None
        A device whose worker failed is dropped from the run; it rejoins from the merged model
        after this many further merge periods (``0``: the next one). ``None``: never.
    fault : str or None
        Fault injection for tests (:mod:`xmc_engine.faults`); ``None`` reads ``XMC_FAULT``.
    """

    #: Warm-up (epochs) of the learning-rate ramp when ``TrainConfig.lr_warmup_epochs`` is
    #: ``None``. None: for ``adaptive`` on ``cpu,cpu@0.5`` a warm-up of 0 or 0.05 epochs gave
    #: the highest P@1 at each early evaluation on delicious and debian_debtags, and a
    #: one-epoch ramp (the paper warms up, arXiv 2110.07029 §IV) held debian_debtags at the
    #: popularity baseline for half an epoch (``bench/RESULTS.md``, "Defaults"). A subclass
    #: may override it.
    default_warmup_epochs: ClassVar[float] = 0.0

    rejoin_after: int | None = None
    fault: str | None = None

    @property
    def per_row_weights(self) -> bool:
        """Whether a row-sparse merge weights each ``W1`` row over the replicas that changed
        it (:attr:`AdaptiveConfig.row_weights` ``'touched'`` or one of the sums); the
        paper's weights elsewhere."""
        return getattr(self, "row_weights", "updates") in PER_ROW_WEIGHTS

    @property
    def row_sum(self) -> bool:
        """Whether the per-row merge gives a row several replicas changed the sum of their
        changes (:attr:`AdaptiveConfig.row_weights` ``'sum'``, ``'sum_sqrt'`` or
        ``'sum_sqrt_unequal'``; scaled by :meth:`row_sum_power_for`) rather than their
        weighted mean."""
        return getattr(self, "row_weights", "updates") in ROW_SUM_POWERS

    def row_sum_power_for(self, batch_sizes, epoch: int = 0) -> float:
        """With :attr:`row_sum`: the sum of ``k`` replicas' changes to a row is scaled by
        ``k ** -power``, ``power`` 0 for ``'sum'``, 0.5 for ``'sum_sqrt'``, and for
        ``'sum_sqrt_unequal'`` 0.5 where the period's ``batch_sizes`` (one per replica)
        differ and ``epoch`` (0-based) is at least :attr:`AdaptiveConfig.sqrt_from_epoch`, else
        0."""
        rw = getattr(self, "row_weights", "updates")
        if rw == "sum_sqrt_unequal" and (len(set(batch_sizes)) == 1
                                         or epoch < getattr(self, "sqrt_from_epoch", 0)):
            return 0.0
        return ROW_SUM_POWERS.get(rw, 0.0)

    @property
    def per_label_weights(self) -> bool:
        """Whether it weights each label over the replicas that held it as a positive
        (:attr:`AdaptiveConfig.label_weights` ``'positives'``); the replicas must then
        record the labels they see (``track_labels``)."""
        return getattr(self, "label_weights", "updates") == "positives"

    def __post_init__(self):
        if self.rejoin_after is not None and self.rejoin_after < 0:
            raise ConfigError(f"rejoin_after must be >= 0 or None, got {self.rejoin_after}")
        if self.fault is not None:
            parse_faults(self.fault, source="fault")  # ConfigError naming the bad entry


@dataclass
class SingleConfig(AlgorithmConfig):
    """Options of ``single`` (one device).

    Attributes
    ----------
    merge_period : int
        Samples between the trainer's barriers: a log record, and where evaluations and
        checkpoints may happen (the first barrier at or after each mark). Small enough for
        fine-grained evaluation, large enough that a barrier costs nothing measurable.
    """

    merge_period: int = 1024

    def __post_init__(self):
        super().__post_init__()
        self._check_min(1, "merge_period")


@dataclass
class AdaptiveConfig(AlgorithmConfig):
    """Options of Adaptive SGD (arXiv 2110.07029 §III; :mod:`xmc_engine.algorithms.adaptive`).

    Attributes
    ----------
    merge_period : int or 'auto'
        ``S``, samples per merge period ("mega-batch"). ``'auto'`` (the default):
        :data:`AUTO_MERGE_PERIOD_TOUCHED` (1,024) where ``row_weights`` resolves to
        ``'touched'`` or a sum and the row-sparse merge applies (CPU devices), else
        :data:`AUTO_MERGE_PERIOD_PAPER_WEIGHTS` (4,096) (:meth:`merge_period_for`; the run
        log's ``start`` record gives the value).
    b_min, b_max, delta_b : int
        Batch-size bounds and step (the paper's 32, 1024, 32). ``b_max="auto"`` (the default):
        :data:`AUTO_B_MAX_BATCHES` times the base batch (256 rows at the default 64;
        :meth:`b_max_for`, the run log's ``start`` record gives the value).
    rule : {'step', 'proportional', 'fixed'}
        Batch-size adaptation (:class:`~xmc_engine.scheduler.controller.BatchSizeController`):
        the paper's step rule, ``b_i`` proportional to the measured speed, or none.
    deadband : float
        Step rule: leave a device alone while its update count is within this fraction of the
        mean (at least half an update; 0 = the paper's strict rule, which oscillates between two
        grid points around the steady state).
    momentum : float
        ``μ`` of the central momentum ``z_t = w̄_t + μ (z_{t−1} − z_{t−2})``, in [0, 1).
    weight_by : {'auto', 'samples', 'updates'}
        What a replica's merge weight ``p_i`` is the share of: the training rows it stepped on
        in the period (``'samples'``) or its updates (``'updates'``, the paper's
        ``p_i = c_i / Σ c``). The two agree while the batches are equal; once the batch sizes
        have adapted so that every device makes the same number of updates, the paper's
        weights are uniform, while the fast device has trained on more rows, in larger
        batches, at a larger rate (``lr_scaling``). ``'auto'`` (the default): ``'samples'``
        below :data:`AUTO_WEIGHTS_LABELS` labels, ``'updates'`` from there on
        (:meth:`resolved`; the run log's ``start`` record gives the value). Measured at
        ``ed28a3b`` (``bench/RESULTS.md``, "The merge weights by samples"), ``adaptive`` alone:
        on delicious, debian_debtags and debian_builddeps on ``cpu,cpu@0.5`` and
        ``cpu,cpu@0.5,cpu@0.25`` (5 seeds) the paper's shares took 0.99-1.21x the time to the
        target (median 1.16x), on the synthetic 30,000-label shape they missed it where the
        samples' shares reached it; at the Amazon-670K shape in 15 minutes the samples' shares
        ended 0.012 and 0.026 P@1 below the paper's (two seeds), at 335,000 labels in 3 epochs
        0.006 above (3 seeds).
    boost : bool
        Adaptive normalization (largest weight +``boost_factor``, smallest −) on/off. Off by
        default (the paper's method has it on): without it Adagrad runs reached the target
        sooner on every heterogeneous device set of issue 15's ablation, at the same final P@1
        within the seeds' spread (``bench/RESULTS.md``, "Adaptive SGD with defaults").
    boost_factor : float
        Relative raise/lower of the largest/smallest weight (the paper's 0.1).
    flag_rule : {'norm_rise', 'always', 'never'}
        When the boost applies (:class:`~xmc_engine.scheduler.merge.NormTrend`).
    sparse_merge : bool
        Merge and broadcast only the ``W1`` rows the replicas changed in the period, where the
        backend tracks rows and ``momentum == 0``; the merged model is the same to float32
        rounding. ``False`` forces the dense merge.
    row_weights : {'auto', 'touched', 'sum', 'sum_sqrt', 'sum_sqrt_unequal', 'updates'}
        Merge weights of a ``W1`` row. ``'updates'`` (the paper): every row gets each replica's
        merge weight ``p_i`` (``weight_by``). ``'touched'``: a row's weights are
        renormalized over the replicas that changed it in the period, so a rare feature's row
        seen by one replica keeps that replica's update whole instead of shrinking it by its
        weight (needs the row-sparse merge: a backend that tracks rows, ``sparse_merge``,
        ``momentum == 0``; the paper's weights elsewhere). ``'sum'``: the same, and a row
        several replicas changed becomes the central row plus the sum of their changes (as if
        one model had made all their steps; ``'touched'`` gives their weighted mean).
        ``'sum_sqrt'``: that sum over the square root of the number ``k`` of replicas that
        changed the row (between ``'touched'``'s mean, ``1/k``, and ``'sum'``).
        ``'sum_sqrt_unequal'``: ``'sum_sqrt'`` in the periods where the batch rule had
        given the replicas different batches (devices of different speed), from epoch
        ``sqrt_from_epoch`` on, ``'sum'`` where they trained at the same batch and before it.
        ``'auto'`` (the default): ``'sum_sqrt_unequal'`` with the softmax loss below
        :data:`AUTO_WEIGHTS_LABELS` labels (:data:`AUTO_PER_ITEM_WEIGHTS`), ``'updates'``
        from there on and with the logistic loss (:data:`AUTO_WEIGHTS_LOSSES`; :meth:`resolved`;
        the run log's ``start`` record gives the value).
    label_weights : {'auto', 'positives', 'updates'}
        The same choice for the output layer, by label: ``'positives'``
        renormalizes the weights of ``W2``'s column ``l`` and ``b2[l]`` over the replicas whose
        batches held label ``l`` as a positive in the period (a label no replica saw keeps the
        paper's weights); same conditions as ``row_weights``; ``'auto'`` (the default):
        ``'positives'`` where ``row_weights="auto"`` gives the per-row weights, else
        ``'updates'``.
        With the softmax below that size both defaults depart from the paper, chosen by
        issue 15's ablation
        (``bench/RESULTS.md``, "Adaptive SGD with defaults", per-row and per-label weights):
        at 30,000 labels (the sampled output layer) on ``cpu,cpu@0.5`` the paper's weights
        ended at P@1 0.567 and did not reach the target in the median run, the two together at
        0.590 (the best method's level) reaching it in 2.1 s; on debian_builddeps 0.88-0.90x the
        time; on the small exact-softmax sets level within the seeds' spread (0.79-1.37x) then,
        and behind the paper's weights with the logistic loss that ``loss="auto"`` picks there
        now (which keeps the paper's, :data:`AUTO_WEIGHTS_LOSSES`). From
        it on, where the held-out plateau schedule keeps the full rate for as long as held-out
        P@1 rises, the paper's weights did better: at the Amazon-670K shape in 15 minutes P@1
        0.7790 against 0.7452 (``bench/RESULTS.md``).
    weights_from_epoch : int or 'auto'
        The epoch (0-based) from which ``row_weights`` / ``label_weights`` apply; the merges
        of earlier epochs use the paper's weights (0: from the start). ``'auto'`` (the
        default): 1 for data of at least :data:`AUTO_WEIGHTS_LABELS` labels, 0 below
        (:meth:`weights_from_epoch_for`; the run log's ``start`` record gives the value);
        it matters there only where ``row_weights`` / ``label_weights`` are given, since their
        ``'auto'`` is the paper's weights at that size.
        On large label spaces the renormalized weights in the first epoch, the one at the full
        learning rate, cost P@1 (0.5318 against 0.5764 after it at the Amazon-670K shape), a
        deficit the later epochs did not make up (0.7022 against 0.7432 after 15 minutes);
        up to 100,000 labels they win from the start.
    sqrt_from_epoch : int
        With ``row_weights="sum_sqrt_unequal"``: the epoch (0-based) from which a shared row's
        sum is divided by ``sqrt(k)`` in the periods whose batches differed; the merges of
        earlier epochs give it the plain sum. 1 (the default): on debian_builddeps and
        delicious trained with the softmax, which reach the target within about an epoch, the
        square root from the start reached it 1.1x-2.1x later than the plain sum, from epoch 1
        on level with the sum, while keeping its final P@1 on the synthetic shapes
        (``bench/RESULTS.md``, "The square root from the second epoch").
    optimizer_state : {'keep', 'average', 'reset'}
        What a merge does to each replica's Adagrad accumulators (nothing with SGD). ``'keep'``:
        every replica keeps its own across merges. ``'average'``: every replica gets the
        merge-weighted average of them (one optimizer state for the merged model; within one
        node, and one more copy of the accumulators on the merging device, which the memory
        planner does not count). ``'reset'``: zeros, as for a new model.
    lr_scaling : {'linear', 'sqrt', 'none'}
        Device ``i``'s learning rate against its batch ``b_i``: ``lr(t) b_i / B`` (the paper's
        linear scaling), ``lr(t) sqrt(b_i / B)``, or ``lr(t)`` for every device.
    solo_epochs : float or 'auto'
        The first device alone trains the periods that start before this many epochs (the
        others wait); at the first period after, every replica starts from its model and its
        Adagrad accumulators (one node only; a multi-node run ignores it). 0: every device
        trains from the start. ``'auto'`` (the default): :data:`AUTO_SOLO_EPOCHS` (0.5) on the
        logistic loss below :data:`AUTO_WEIGHTS_LABELS` labels and :data:`AUTO_SOLO_MAX_ROWS`
        training rows, where the merge is the paper's weighted mean, which early in training
        loses most of the replicas' progress; 0 elsewhere. A run that goes on from the loss
        probe's fit (the default where the probe runs) starts where that fit, one device's
        training of 0.7-0.9 epochs on such a set, stopped: the phase is then over. In the
        phase the central model catches up with that device only where it is read (an
        evaluation, a checkpoint) and at the phase's end, so its barriers cost what one
        device's do; a solo device that fails loses the periods since the last catch-up.
    batch_scale : float or 'auto'
        ``adaptive``'s base batch ``B`` is ``batch_scale x batch_size`` (rounded; at least
        ``b_min``): the batch every device starts at and the equal-speed batch of the step
        rule, the batch whose rate is ``lr`` under ``lr_scaling``, and with ``b_max="auto"``
        the unit of ``b_max``. ``'auto'`` (the default): :data:`AUTO_SOFTMAX_BATCH_SCALE` (2:
        128 rows at the default ``batch_size``) with the softmax below
        :data:`AUTO_WEIGHTS_LABELS` labels on at least :data:`AUTO_BATCH_SCALE_MIN_ROWS`
        training rows, 1 elsewhere (:meth:`batch_scale_for`; the run log's
        ``start`` record gives the value). The loss probe and the other algorithms train at
        ``batch_size``. A departure from the paper, whose ``B`` is the single-device batch.
    delta_stats : bool
        Instrumentation: each merge logs the size of every replica's change since the last
        merge on the ``W1`` rows it alone changed and on shared rows, and on ``W2``'s head and
        tail label columns (:func:`~xmc_engine.scheduler.merge.delta_stats`; host replicas
        only). Costs a pass over the changed rows and all of ``W2`` per replica and merge.
    """

    merge_period: int | str = "auto"
    b_min: int = 32
    b_max: int | str = "auto"
    delta_b: int = 32
    rule: str = "step"
    deadband: float = 0.05
    momentum: float = 0.0
    weight_by: str = "auto"
    boost: bool = False
    boost_factor: float = 0.1
    flag_rule: str = "norm_rise"
    sparse_merge: bool = True
    row_weights: str = "auto"
    label_weights: str = "auto"
    weights_from_epoch: int | str = "auto"
    sqrt_from_epoch: int = 1
    optimizer_state: str = "keep"
    lr_scaling: str = "linear"
    solo_epochs: float | str = "auto"
    batch_scale: float | str = "auto"
    delta_stats: bool = False

    def weights_from_epoch_for(self, n_labels: int) -> int:
        """The epoch from which ``row_weights`` / ``label_weights`` apply on data with
        ``n_labels`` labels: ``weights_from_epoch``, or for ``'auto'`` 1 from
        :data:`AUTO_WEIGHTS_LABELS` labels on, else 0."""
        if self.weights_from_epoch != "auto":
            return int(self.weights_from_epoch)
        return 1 if n_labels >= AUTO_WEIGHTS_LABELS else 0

    def batch_scale_for(self, n_labels: int, loss: str, n_rows: int | None = None) -> float:
        """``batch_scale``, or for ``'auto'`` :data:`AUTO_SOFTMAX_BATCH_SCALE` with the softmax
        below :data:`AUTO_WEIGHTS_LABELS` labels on at least :data:`AUTO_BATCH_SCALE_MIN_ROWS`
        training rows (``n_rows``; ``None``, not known: 1), else 1. ``loss="auto"`` (not yet
        probed, as when planning memory) counts as the softmax: the larger batch."""
        if self.batch_scale != "auto":
            return float(self.batch_scale)
        per_item = not _paper_weights(n_labels, "softmax" if loss == "auto" else loss)
        enough = n_rows is not None and n_rows >= AUTO_BATCH_SCALE_MIN_ROWS
        return float(AUTO_SOFTMAX_BATCH_SCALE) if per_item and enough else 1.0

    def base_batch(self, batch_size: int, n_labels: int | None = None,
                   loss: str = "auto", n_rows: int | None = None) -> int:
        """``B``, the base batch for the run's ``batch_size``: ``batch_scale`` times it,
        rounded, at least ``b_min``; ``n_labels``, ``loss`` and ``n_rows`` resolve ``'auto'``
        (:meth:`batch_scale_for`), a resolved config needs none of them."""
        if self.batch_scale == "auto" and n_labels is None:
            raise ValueError("batch_scale='auto': base_batch needs n_labels to resolve it")
        scale = self.batch_scale_for(n_labels, loss, n_rows)
        return max(int(round(scale * int(batch_size))), self.b_min)

    def b_max_for(self, batch_size: int) -> int:
        """The largest batch the step rule may give a device for base batch ``batch_size``:
        ``b_max``, or for ``'auto'`` :data:`AUTO_B_MAX_BATCHES` x ``batch_size`` (at least
        ``b_min``)."""
        if self.b_max != "auto":
            return int(self.b_max)
        return max(AUTO_B_MAX_BATCHES * int(batch_size), self.b_min)

    def merge_period_for(self, row_weights: str, tracks_rows: bool = True) -> int:
        """The period of a run whose ``W1`` rows are merged with ``row_weights`` (resolved):
        ``merge_period``, or for ``'auto'`` :data:`AUTO_MERGE_PERIOD_TOUCHED` with the
        per-row weights (``'touched'`` or a sum), which need the row-sparse merge
        (``sparse_merge``, ``momentum == 0`` and replicas whose backend ``tracks_rows``: the
        CPU's, not a GPU's), else :data:`AUTO_MERGE_PERIOD_PAPER_WEIGHTS`, the period of the
        paper's weights."""
        if self.merge_period != "auto":
            return int(self.merge_period)
        per_row = (row_weights in PER_ROW_WEIGHTS and self.sparse_merge and self.momentum == 0
                   and tracks_rows)
        return AUTO_MERGE_PERIOD_TOUCHED if per_row else AUTO_MERGE_PERIOD_PAPER_WEIGHTS

    def resolved(self, n_labels: int, loss: str, batch_size: int | None = None,
                 tracks_rows: bool = True, n_rows: int | None = None) -> AdaptiveConfig:
        """These options with every ``'auto'`` replaced by its value for data with
        ``n_labels`` labels trained with ``loss`` (``"softmax"`` or ``"bce"``;
        :data:`AUTO_WEIGHTS_LABELS`, :data:`AUTO_WEIGHTS_LOSSES`), ``merge_period`` by the
        ``row_weights`` that gives and ``tracks_rows`` (:meth:`merge_period_for`),
        ``batch_scale`` (:meth:`batch_scale_for`) and, where ``batch_size`` (the run's batch)
        is given, ``b_max`` in base batches (:meth:`b_max_for`, :meth:`base_batch`), and
        ``solo_epochs`` by the loss, the labels and ``n_rows`` (the training rows; ``None``:
        not known, no limit): what a run uses and logs."""
        large = n_labels >= AUTO_WEIGHTS_LABELS
        paper = _paper_weights(n_labels, loss)
        auto = {name: "updates" if paper else value
                for name, value in AUTO_PER_ITEM_WEIGHTS.items() if getattr(self, name) == "auto"}
        if self.weight_by == "auto":
            auto["weight_by"] = "updates" if large else "samples"
        if self.solo_epochs == "auto":
            few = n_rows is None or n_rows < AUTO_SOLO_MAX_ROWS
            auto["solo_epochs"] = AUTO_SOLO_EPOCHS if paper and not large and few else 0.0
        if self.batch_scale == "auto":
            auto["batch_scale"] = self.batch_scale_for(n_labels, loss, n_rows)
        if batch_size is not None:  # b_max="auto" counts base batches
            auto["b_max"] = self.b_max_for(self.base_batch(batch_size, n_labels, loss, n_rows))
        auto["merge_period"] = self.merge_period_for(auto.get("row_weights", self.row_weights),
                                                     tracks_rows)
        return dataclasses.replace(self, **auto,
                                   weights_from_epoch=self.weights_from_epoch_for(n_labels))

    def __post_init__(self):
        super().__post_init__()
        if self._is_auto("merge_period", "a number of samples"):
            self._check_min(1, "delta_b")
        else:
            self._check_min(1, "merge_period", "delta_b")
        if not self._is_auto("weights_from_epoch", "an epoch >= 0"):
            self._check_min(0, "weights_from_epoch")
        self._check_min(0, "sqrt_from_epoch")
        if not self._is_auto("solo_epochs", "a number of epochs >= 0"):
            self._check_min(0, "solo_epochs")
        if not self._is_auto("batch_scale", "a number > 0") and not self.batch_scale > 0:
            raise ConfigError(f"batch_scale must be > 0 or 'auto', got {self.batch_scale!r}")
        self._check_choice("row_weights", ("auto", *ROW_WEIGHTS))
        self._check_choice("label_weights", ("auto", *LABEL_WEIGHTS))
        self._check_choice("optimizer_state", OPTIMIZER_STATES)
        self._check_choice("lr_scaling", LR_SCALINGS)
        self._check_choice("weight_by", ("auto", *WEIGHT_BY))
        if self._is_auto("b_max", "a batch size"):
            self._check_min(1, "b_min")
        elif not 1 <= self.b_min <= self.b_max:
            raise ConfigError(f"need 1 <= b_min <= b_max, got {self.b_min}, {self.b_max}")
        self._check_choice("rule", BATCH_RULES)
        self._check_min(0, "deadband")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0.0 <= self.boost_factor < 1.0:
            raise ConfigError(f"boost_factor must be in [0, 1), got {self.boost_factor}")
        self._check_choice("flag_rule", FLAG_RULES)


@dataclass
class AverageConfig(AlgorithmConfig):
    """Options of model averaging, the paper's "GD" baseline: ``merge_period`` and
    ``sparse_merge`` as for :class:`AdaptiveConfig`, so that only the algorithm differs."""

    merge_period: int = 4096
    sparse_merge: bool = True

    def __post_init__(self):
        super().__post_init__()
        self._check_min(1, "merge_period")


@dataclass
class SyncConfig(AlgorithmConfig):
    """Options of synchronous data-parallel SGD (:mod:`xmc_engine.algorithms.sync`).

    Attributes
    ----------
    split_global_batch : bool
        ``False``: ``batch_size`` is the per-device batch and the global batch is ``n B`` (the
        DDP / Horovod convention). ``True``: ``batch_size`` is the global batch, split equally
        (must divide by the number of devices).
    lr_scaling : bool
        Linear scaling rule (Goyal et al. 2017): multiply the learning rate by
        ``global batch / batch_size``.
    """

    split_global_batch: bool = False
    lr_scaling: bool = False


@dataclass
class EASGDConfig(AlgorithmConfig):
    """Options of Elastic Averaging SGD (Zhang et al. 2015; :mod:`xmc_engine.algorithms.easgd`).

    Attributes
    ----------
    tau : int
        ``τ``, local steps per device between elastic updates (period ``S = n τ B``); 16 is the
        middle of the paper's grid {1, 4, 16, 64}.
    beta : float
        ``β = n α``, the moving rate of the centre (the paper's 0.9), in (0, 1].
    alpha : float
        ``α``, the elastic coefficient; ``0`` means ``β / n``.
    """

    tau: int = 16
    beta: float = 0.9
    alpha: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        self._check_min(1, "tau")
        if not 0.0 < self.beta <= 1.0:
            raise ConfigError(f"beta must be in (0, 1], got {self.beta}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1] (0 = beta / n), got {self.alpha}")


@dataclass
class CrossbowConfig(AlgorithmConfig):
    """Options of CROSSBOW synchronous model averaging (Koliousis et al. 2019).

    Attributes
    ----------
    tau : int
        SGD steps per learner between corrections (the paper's 1: every step).
    alpha : float
        Correction rate ``α``; ``0`` means ``1 / n``.
    momentum : float
        ``μ`` of the central model, in [0, 1) (the paper's 0.9).
    """

    tau: int = 1
    alpha: float = 0.0
    momentum: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        self._check_min(1, "tau")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1] (0 = 1 / n), got {self.alpha}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")


#: Algorithm name -> its options dataclass (the one list of algorithm names; the policies are
#: in :data:`xmc_engine.algorithms.POLICIES`).
ALGORITHMS: dict[str, type[AlgorithmConfig]] = {
    "single": SingleConfig,
    "adaptive": AdaptiveConfig,
    "average": AverageConfig,
    "sync": SyncConfig,
    "easgd": EASGDConfig,
    "crossbow": CrossbowConfig,
}


def algorithm_config(name: str, options=None, *, source: str = "algorithm_params"):
    """The typed options of algorithm ``name`` from ``options`` (a dict, an instance of its
    config class, or ``None`` for the defaults)."""
    try:
        cls = ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of "
                          f"{', '.join(ALGORITHMS)}") from None
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    if isinstance(options, AlgorithmConfig):
        # Another algorithm's options (e.g. ``dataclasses.replace(cfg, algorithm=...)``): keep
        # what was set away from its defaults; keys the new algorithm lacks are errors.
        default = type(options)()
        options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                   if getattr(options, f.name) != getattr(default, f.name)}
    if isinstance(options, dict):
        shared = sorted(set(options) & {f.name for f in dataclasses.fields(TrainConfig)})
        if shared:
            raise ConfigError(f"{source} of {name!r}: {', '.join(shared)}: option(s) of the run, "
                              f"not of the algorithm; set them as TrainConfig / XMCClassifier "
                              f"parameters (--{shared[0].replace('_', '-')} on the command line)")
    return cls.from_dict(options, source=f"{source} of {name!r}")


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class TrainConfig(ConfigMixin):
    """Everything a training run needs besides the data.

    Fields are the parameters of :class:`xmc_engine.XMCClassifier` and the long options of
    ``xmc-engine train``.

    Attributes
    ----------
    normalize : {'l2', 'none'}
        The feature rows the model trains and predicts on: ``"l2"`` (the default) scales each
        row to unit Euclidean norm (rows already of norm 1, as tf-idf data, are left as they
        are), ``"none"`` takes them as given. Chosen by ``bench/bench_defaults.py
        --normalize-study`` (``bench/RESULTS.md``, "Defaults"): on the six shared datasets
        whose rows are raw counts (bibtex, delicious, corel5k, stackex_cooking, stackex_cs,
        imdb) it raised P@1 after 5 epochs by 0.015 to 0.056.
    hidden : list of int
        Hidden layer widths (the first layer sparse-input, the rest dense).
    epochs : float
        Passes over the training rows.
    max_train_seconds : float or None
        Stop once this much training time has passed (evaluation excluded), at the first
        barrier after it (a merge period: well under a second on the CPU at the defaults);
        ``None``: train all ``epochs``. For comparisons at equal wall time.
    ensemble : int
        Networks trained each for ``epochs`` with every other setting
        (member ``j`` with seed :func:`xmc_engine.training.member_seed`, the first with
        ``seed`` itself; the others train the loss ``"auto"`` chose for the first), combined
        into one network of ``ensemble`` times the hidden width whose logits are the mean of
        theirs (:func:`xmc_engine.model.combine_members`). Side by side, one thread
        and one core each, where the run is one CPU device of several cores whose thread
        calibration did not find all of them :data:`LANES_MAX_SPEEDUP` times as fast as one
        (the ensemble's ``lanes``); else one after the other. It costs
        ``ensemble`` times the training samples, and prediction costs what a network that
        wide costs; ``max_train_seconds`` is shared out equally (each member's share is
        ``1 / ensemble`` of it one after the other, side by side ``1 /`` the members the
        busiest core trains, so that the whole ensemble trains about that long). 1 (the
        default): one network. Measured: ``bench/RESULTS.md``, "Ensembles".
    batch_size : int
        ``B``: every device's batch on one device and during warm-up; the base of Adaptive
        SGD's per-device batches. A shorter batch (an epoch's last rows) steps at the rate of
        its rows (:meth:`~xmc_engine.algorithms.base.Policy.batch_lr`).
    lr, lr_warmup_epochs : float; lr_decay : float, str or None
        The learning-rate schedule of every algorithm
        (:class:`~xmc_engine.scheduler.controller.Schedule`): a linear ramp over
        ``lr_warmup_epochs`` (``None``: the algorithm's own
        :attr:`AlgorithmConfig.default_warmup_epochs`, none for every algorithm), then
        ``lr / (1 + lr_decay (e − e_warm))`` over whole epochs ``e``. ``lr=None``: the
        optimizer's :data:`DEFAULT_LR`, or :data:`DEFAULT_LR_BCE` with ``loss="bce"``
        (:attr:`learning_rate`). ``lr_decay`` may also be ``"plateau"``: no decay by the
        epoch, but the rate halves (:data:`PLATEAU_FACTOR`) after every epoch whose P@1 on
        :data:`PLATEAU_HOLDOUT_ROWS` training rows held out of training is not above the best
        so far (the run log's ``plateau`` records; that evaluation counts as training time),
        and training stops once the rate is below :data:`PLATEAU_STOP_SCALE` of the base
        (a ``plateau_stop`` record; the model has stopped improving on held-out rows).
        ``"auto"``, the default: ``"plateau"`` with Adagrad on data of at least
        :data:`PLATEAU_MIN_ROWS` training rows, else the optimizer's fixed decay, or none
        (:data:`PROBED_SOFTMAX_DECAY`) where ``loss="auto"``'s probe found the softmax clearly
        ahead; ``None``: the optimizer's fixed :data:`DEFAULT_LR_DECAY` (0.5 for Adagrad, 0 for
        SGD)
        (:meth:`lr_decay_for`; the ``start`` record gives the value in effect).
    keep_best : bool
        With ``lr_decay="plateau"`` (whose held-out rows say how good each epoch's model is):
        the run ends with the model of the epoch whose held-out P@1 was the highest, where the
        last model is behind it by more than :data:`KEEP_BEST_Z` standard errors (the run
        log's ``keep_best`` record; the final evaluation is of that model). Without held-out
        rows there is nothing to choose by and the run ends with its last model. With
        ``lr_decay="auto"`` rows are held out for it from :data:`KEEP_BEST_MIN_ROWS` rows
        whatever decay ``"auto"`` gives (:meth:`holds_out`; today the plateau rule's
        threshold). Measured: ``bench/RESULTS.md``, "Defaults", "The best epoch's model" and
        "The best epoch's model below 40,000 rows".
    back_to_best : bool
        With ``lr_decay="plateau"``: where an epoch lowers the rate and its model's held-out
        P@1 is behind the best epoch's by more than :data:`BACK_TO_BEST_Z` standard errors
        (:data:`BACK_TO_BEST_STALE_Z` once the best epoch is two or more epochs old),
        training goes on from the best epoch's model (the central model and every replica;
        the optimizers' state stays) at the lowered rate (the ``plateau`` record's
        ``back_to``). Measured: ``bench/RESULTS.md``, "Defaults", "Going back to the best
        epoch's model at a halving".
    label_chunk : int or None
        Labels per chunk of the output layer (``None``: the whole ``B x n_labels`` logits).
    optimizer : {'sgd', 'adagrad'}
        Adagrad by default: on every dataset of ``bench/bench_defaults.py`` its best learning
        rate beat plain SGD's (the paper's optimizer) at equal epochs, by 0.03 to 0.46 P@1.
    loss : {'softmax', 'bce', 'auto'}
        The training loss of the output layer: ``"softmax"``, the cross-entropy of the softmax
        over the labels against the row's labels ``y/|y|`` (a row's positives share one unit of
        probability); ``"bce"``, the one-vs-all logistic loss, ``sum_l softplus(z_l) - y_l z_l``
        (every label its own binary problem; :mod:`xmc_engine.kernels.bce_output`). With the
        sampled output layer each drawn negative's term counts once
        (:data:`xmc_engine.output_layer.BCE_WEIGHTED_NEGATIVES`). Prediction ranks the logits
        either way; ``predict_proba`` gives the softmax or the sigmoids. ``"bce"`` (whose
        default Adagrad rate is 0.1, :data:`DEFAULT_LR_BCE`) is ahead on seven of the nine
        shared sets, the softmax far ahead on the synthetic shapes. ``"auto"``, the default:
        a short probe of each loss on the start of the run's first epoch picks one by P@1 on
        the rows that come next: the logistic loss unless the softmax is clearly ahead
        (:func:`xmc_engine.training.choose_loss`, :data:`LOSS_PROBE_SOFTMAX_Z`, with the
        sampled output layer :data:`LOSS_PROBE_SOFTMAX_Z_SAMPLED`; the run log's
        ``loss_probe`` record says what it saw, ``start`` which loss trained); chosen by
        ``bench/bench_defaults.py --loss-auto-study`` and ``bench/bench_loss_rule.py``
        (README, "Defaults").
    continue_probe : bool
        With ``loss="auto"`` in one process: the run continues the probe's winning fit
        instead of training the chosen loss again from the start, where that fit trained no
        more samples than the run asks. Every device's replica starts with the fit's model
        and Adagrad state, and the run counts its samples and training time as its own (the
        fit's seconds count against ``max_train_seconds``). The fit trained the first rows of
        the run's own first epoch, so the run goes on with the rest of that epoch: on one
        device it is the run of the chosen loss from the initialisation (bit for bit on one
        thread), without training its first rows twice
        (:func:`xmc_engine.training.choose_loss`; the ``loss_probe`` record's ``continued``).
        ``False``: every run starts from the initialisation (to compare runs from the same
        start). Measured: README, "Defaults".
    output : {'exact', 'sampled', 'auto'}
        The output layer of a training step. ``"exact"``: the softmax over all ``n_labels``.
        ``"sampled"``: the softmax over the batch's positive labels plus ``negatives`` labels
        drawn uniformly from the rest, with the sampled-softmax weight on the drawn ones
        (:func:`xmc_engine.output_layer.sample_candidates`); the step costs GEMMs of
        ``B x hidden x (positives + negatives)`` and updates only those ``W2`` columns.
        Prediction and evaluation are exact either way; ``label_chunk`` then applies to them
        only. ``"auto"``: ``"sampled"`` where the label space is large against a sampled step's
        width, else ``"exact"`` (:meth:`output_for`; the run log's ``start`` record says which);
        the default.
        When to choose which: README, "Sampled output layer".
    negatives : int
        ``K``, the negatives drawn per batch when ``output="sampled"`` (0: the other rows'
        positives only). Measured: ``bench/RESULTS.md``, "Sampled output layer".
    negative_sampling : {'frequency', 'uniform', 'lsh'}
        How ``output="sampled"`` draws its negatives: ``K`` draws in proportion to the
        training frequency of each label to the power 0.75 (the default;
        :class:`xmc_engine.output_layer.FrequencyProposal`); ``K`` distinct labels uniformly;
        or ``K`` draws half uniform, half from the labels whose ``W2`` column shares a SimHash
        bucket with a positive's (:class:`xmc_engine.output_layer.LSHProposal`). Under the
        softmax each non-uniform draw is weighted by the inverse of its probability of being
        drawn; under the logistic loss every drawn negative counts once
        (:data:`xmc_engine.output_layer.BCE_WEIGHTED_NEGATIVES`). Why the default:
        :data:`NEGATIVE_SAMPLING`; measured: ``bench/RESULTS.md``, "Sampled output layer".
    devices : str
        Device spec (:func:`~xmc_engine.devices.parse_devices`).
    algorithm : str
        A key of :data:`ALGORITHMS`.
    algorithm_params : dict or AlgorithmConfig
        The algorithm's options; stored as its typed config (``to_dict`` writes a dict).
    neighbours : int or 'auto'
        Predictions blend the network's probabilities with the labels of the training rows
        nearest each query row, ``neighbours`` of them in the last hidden layer and as many in
        the input features (:mod:`xmc_engine.neighbours`); the fitted model keeps its training
        rows for it. 0: the network alone. ``"auto"``, the default:
        :data:`NEIGHBOURS_K` where the model trained the logistic loss
        (:data:`NEIGHBOURS_LOSSES`), or the softmax that the loss probe found ahead by fewer
        than :data:`NEIGHBOURS_SOFTMAX_Z` standard errors, on up to
        :data:`NEIGHBOURS_MAX_ROWS` training rows, else 0 (:meth:`neighbours_for`).
        Evaluations during training score the network alone. Measured: ``bench/RESULTS.md``,
        "Neighbour votes at prediction".
    seed, threads, eval_every, eval_k, propensity_a, propensity_b
        Seed; CPU threads (``None``: all cores, split over CPU devices); evaluation every this
        many epochs (0: at the end); the largest ``k`` of the metrics; Jain et al. propensity
        parameters.
    """

    normalize: str = "l2"
    hidden: list[int] = field(default_factory=lambda: [128])
    epochs: float = 10
    max_train_seconds: float | None = None
    ensemble: int = 1
    batch_size: int = 64
    lr: float | None = None
    lr_warmup_epochs: float | None = None
    lr_decay: float | str | None = "auto"
    keep_best: bool = True
    back_to_best: bool = True
    label_chunk: int | None = None
    optimizer: str = "adagrad"
    loss: str = "auto"
    continue_probe: bool = True
    output: str = "auto"
    negatives: int = 1024
    negative_sampling: str = "frequency"
    devices: str = "cpu"
    algorithm: str = "single"
    algorithm_params: dict | AlgorithmConfig = field(default_factory=dict)
    seed: int = 0
    threads: int | None = None
    eval_every: float = 1.0
    eval_k: int = 5
    neighbours: int | str = "auto"
    propensity_a: float = 0.55
    propensity_b: float = 1.5

    def __post_init__(self) -> None:
        if isinstance(self.hidden, numbers.Integral) and not isinstance(self.hidden, bool):
            self.hidden = [self.hidden]
        if (isinstance(self.hidden, (str, bytes)) or not hasattr(self.hidden, "__iter__")
                or not all(isinstance(h, numbers.Integral) and not isinstance(h, bool)
                           for h in self.hidden)):
            raise ConfigError(f"hidden={self.hidden!r}: need a list of positive integer widths")
        self.hidden = [int(h) for h in self.hidden]
        self.validate()

    def validate(self) -> None:
        """Check every field (``ConfigError`` naming it); normalises ``algorithm_params``."""
        def bad(name, why):
            raise ConfigError(f"{name}={getattr(self, name)!r}: {why}")

        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if not _type_ok(getattr(self, f.name), hints[f.name]):
                bad(f.name, f"must be {_type_name(hints[f.name])}")
        if not self.hidden or any(h < 1 for h in self.hidden):
            bad("hidden", "need one or more positive layer widths")
        if not self.epochs > 0:
            bad("epochs", "must be > 0")
        if self.max_train_seconds is not None and not self.max_train_seconds > 0:
            bad("max_train_seconds", "must be > 0 (or None: no time limit)")
        if self.ensemble < 1:
            bad("ensemble", "must be >= 1 (1: one network)")
        if self.batch_size < 1:
            bad("batch_size", "must be >= 1")
        if self.lr is not None and not self.lr > 0:
            bad("lr", "must be > 0 (or None: the optimizer's default)")
        if self.lr_warmup_epochs is not None and not self.lr_warmup_epochs >= 0:
            bad("lr_warmup_epochs", "must be >= 0 (or None: the algorithm's own default)")
        if isinstance(self.lr_decay, str):
            if self.lr_decay not in ("plateau", "auto"):
                bad("lr_decay", "must be a number >= 0, 'plateau' or 'auto' (or None: the "
                                "optimizer's fixed decay)")
        elif self.lr_decay is not None and not self.lr_decay >= 0:
            bad("lr_decay", "must be >= 0, 'plateau' or 'auto' (or None: the optimizer's "
                            "fixed decay)")
        if self.label_chunk is not None and self.label_chunk < 1:
            bad("label_chunk", "must be >= 1 or None")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"unknown; choose one of {', '.join(OPTIMIZERS)}")
        if self.loss not in LOSSES:
            bad("loss", f"unknown; choose one of {', '.join(LOSSES)}")
        if self.output not in OUTPUTS:
            bad("output", f"unknown; choose one of {', '.join(OUTPUTS)}")
        if self.negatives < 0:
            bad("negatives", "must be >= 0 (0: only the batch's own positive labels)")
        if self.normalize not in NORMALIZE:
            bad("normalize", f"unknown; choose one of {', '.join(NORMALIZE)}")
        if self.negative_sampling not in NEGATIVE_SAMPLING:
            bad("negative_sampling", f"unknown; choose one of {', '.join(NEGATIVE_SAMPLING)}")
        if self.algorithm not in ALGORITHMS:
            bad("algorithm", f"unknown; choose one of {', '.join(ALGORITHMS)}")
        if self.threads is not None and self.threads < 1:
            bad("threads", "must be >= 1 or None")
        if not self.eval_every >= 0:
            bad("eval_every", "must be >= 0 (0 = only at the end)")
        if self.eval_k < 1:
            bad("eval_k", "must be >= 1")
        if (self.neighbours != "auto" if isinstance(self.neighbours, str)
                else self.neighbours < 0):
            bad("neighbours", "must be an integer >= 0 (0: the network alone) or 'auto'")
        if self.seed < 0:
            bad("seed", "must be >= 0")
        for name in ("propensity_a", "propensity_b"):
            if not getattr(self, name) > 0:
                bad(name, "must be > 0")
        self.algorithm_params = algorithm_config(self.algorithm, self.algorithm_params)

    def output_for(self, n_labels: int, labels_per_row: float) -> str:
        """The output layer a run on data with ``n_labels`` labels and ``labels_per_row``
        positives per training row trains: ``output``, or for ``"auto"`` ``"sampled"`` when
        ``n_labels >= AUTO_SAMPLED_RATIO * (batch_size * labels_per_row + negatives)`` (a
        sampled step's output width), else ``"exact"``."""
        if self.output != "auto":
            return self.output
        width = self.batch_size * float(labels_per_row) + self.negatives
        return "sampled" if n_labels >= AUTO_SAMPLED_RATIO * width else "exact"

    def neighbours_for(self, n_train: int, loss: str, probe_z: float | None = None) -> int:
        """The neighbours of each vote a model fitted on ``n_train`` rows with the training
        loss ``loss`` predicts with (:mod:`xmc_engine.neighbours`; 0: the network alone):
        ``neighbours`` as given, or for ``"auto"`` up to :data:`NEIGHBOURS_MAX_ROWS` training
        rows :data:`NEIGHBOURS_K` with a loss of :data:`NEIGHBOURS_LOSSES`, and with the softmax
        where the loss probe found it ahead by fewer than :data:`NEIGHBOURS_SOFTMAX_Z` standard
        errors (``probe_z``, ``None`` where no probe compared the losses: no votes); else 0."""
        return self.neighbours_decision(n_train, loss, probe_z)[0]

    def neighbours_decision(self, n_train: int, loss: str,
                            probe_z: float | None = None) -> tuple[int, str]:
        """:meth:`neighbours_for`'s number and what decided it, a phrase for the run's summary
        (``"given"`` where ``neighbours`` is a number)."""
        if self.neighbours != "auto":
            return int(self.neighbours), "given"
        if n_train > NEIGHBOURS_MAX_ROWS:
            return 0, (f"{n_train:,} training rows, above {NEIGHBOURS_MAX_ROWS:,}: every query "
                       f"row would be compared with each of them")
        name = {"bce": "the logistic loss", "softmax": "the softmax"}.get(loss, loss)
        if loss in NEIGHBOURS_LOSSES:
            return NEIGHBOURS_K, name
        if probe_z is None:
            return 0, f"{name} with no loss probe to compare it with the logistic loss"
        if probe_z < NEIGHBOURS_SOFTMAX_Z:
            return NEIGHBOURS_K, (f"{name}, which the loss probe found ahead of the logistic "
                                  f"loss by {probe_z:+.1f} standard errors, under "
                                  f"+{NEIGHBOURS_SOFTMAX_Z:g}")
        return 0, (f"the loss probe found {name} ahead of the logistic loss by {probe_z:+.1f} "
                   f"standard errors, +{NEIGHBOURS_SOFTMAX_Z:g} or more: there the network "
                   f"beats any neighbour")

    @property
    def learning_rate(self) -> float:
        """The base learning rate in effect: ``lr``, else the optimizer's :data:`DEFAULT_LR`
        (:data:`DEFAULT_LR_BCE` with ``loss="bce"``)."""
        if self.lr is not None:
            return float(self.lr)
        return (DEFAULT_LR_BCE if self.loss == "bce" else DEFAULT_LR)[self.optimizer]

    def lr_decay_for(self, n_train: int, probed: str | None = None) -> float | str:
        """The decay a run on ``n_train`` training rows uses: a number ``λ`` (``lr / (1 + λ
        e)``) or ``"plateau"``. ``lr_decay`` as given; ``None``: the optimizer's
        :data:`DEFAULT_LR_DECAY`; ``"auto"``: with Adagrad ``"plateau"`` from
        :data:`PLATEAU_MIN_ROWS` rows on, below it :data:`PROBED_SOFTMAX_DECAY` where
        ``probed`` is ``"softmax"``, else :data:`DEFAULT_LR_DECAY` (SGD: its own, 0).
        ``probed``: the loss ``loss="auto"``'s probe chose by comparing the two losses' fits
        (``None`` where none compared them: a loss given, a set too small for the probe)."""
        if self.lr_decay == "auto":
            if self.optimizer == "adagrad" and n_train >= PLATEAU_MIN_ROWS:
                return "plateau"
            if self.optimizer == "adagrad" and probed == "softmax":
                return PROBED_SOFTMAX_DECAY
            return DEFAULT_LR_DECAY[self.optimizer]
        if self.lr_decay == "plateau":
            return "plateau"
        return (float(self.lr_decay) if self.lr_decay is not None
                else DEFAULT_LR_DECAY[self.optimizer])

    def holds_out(self, n_train: int, decay: float | str | None = None) -> bool:
        """Does a run on ``n_train`` training rows hold rows out of training
        (:func:`xmc_engine.training.hold_out`)? With the plateau rule (``decay``, the value in
        effect; by default :meth:`lr_decay_for`'s), and with ``lr_decay="auto"`` and
        ``keep_best`` from :data:`KEEP_BEST_MIN_ROWS` rows on, whatever decay ``"auto"`` gave
        (a number given for ``lr_decay`` trains every row)."""
        decay = self.lr_decay_for(n_train) if decay is None else decay
        return decay == "plateau" or (self.lr_decay == "auto" and self.keep_best
                                      and n_train >= KEEP_BEST_MIN_ROWS)

    @property
    def warmup_epochs(self) -> float:
        """The warm-up in effect: ``lr_warmup_epochs``, else the algorithm's own default."""
        if self.lr_warmup_epochs is not None:
            return float(self.lr_warmup_epochs)
        return type(self.algorithm_params).default_warmup_epochs

    # -- JSON round trip -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> TrainConfig:
        if isinstance(d, dict) and isinstance(d.get("algorithm_params"), dict):
            # Check the options against the algorithm named in the same mapping.
            name = d.get("algorithm", cls.algorithm)
            if isinstance(name, str) and name in ALGORITHMS:
                d = {**d, "algorithm_params": algorithm_config(
                    name, d["algorithm_params"], source=f"{source}: algorithm_params")}
        return super().from_dict(d, source=source)

    @classmethod
    def from_saved(cls, d: dict[str, Any], *, source: str = "config") -> TrainConfig:
        """:meth:`from_dict` for a config the engine wrote itself (a saved model, a run
        folder): keys added since are given the value that reproduces the old behaviour, not
        today's default (``normalize``: ``"none"``, the rows as given, as they were trained;
        ``negative_sampling``: ``"uniform"``, the default before ``"frequency"``; ``neighbours``: 0,
        the network alone;
        ``adaptive``'s ``weights_from_epoch``: 0, ``row_weights`` / ``label_weights``
        ``"touched"`` / ``"positives"``, the per-row / per-label weights from the start,
        ``weight_by``: ``"updates"``, the paper's shares, and ``batch_scale``: 1, the run's
        batch as the base batch)."""
        if isinstance(d, dict):
            d = {"normalize": "none", "negative_sampling": "uniform", "neighbours": 0, **d}
            ap = d.get("algorithm_params")
            if d.get("algorithm", cls.algorithm) == "adaptive" and (ap is None
                                                                   or isinstance(ap, dict)):
                d["algorithm_params"] = {"weights_from_epoch": 0, **PER_ITEM_WEIGHTS,
                                         "weight_by": "updates", "batch_scale": 1,
                                         **(ap or {})}
        return cls.from_dict(d, source=source)

    @classmethod
    def from_json_file(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read the config ({exc})") from None
        return cls.from_json(text, source=str(path))
