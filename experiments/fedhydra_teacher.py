"""FedHydra's teacher on tuning fleets: which clients it listens to for each class, and whether its answer to an
image depends on the rest of the batch. No distillation: the teacher's label-free accuracy on the test set.

Every fleet here is a tuning fleet (seeds >= 100, never a reported cell). Two stages:

  cache    per fleet, once: the clients (trained in-process, as the ClientApp trains them), every client's test
           logits, one Model Stratification of the robust recipe with the images it leaves, and every client's
           logits on all of those images. Stored under benchmarks/runs/teacher/<fleet>/ (git-ignored).
  measure  from the cache alone (seconds per fleet): for every competence score and every calibration, the
           teacher's test accuracy (at test batches of 1, 32 and 512 where the calibration reads the batch), the
           rank correlation of U_r with each client's per-class test recall (which the method never reads), and a
           leave-one-out pass (the teacher of the fleet without each one client). One record per fleet (a row per
           score x calibration) in benchmarks/results/fedhydra_teacher.jsonl; the table in fedhydra_teacher.md.

  python -m experiments.fedhydra_teacher cache --fleets grey-mnist-0.1-k5-s100 ...
  python -m experiments.fedhydra_teacher measure
Cost: `cache` is client training plus one MS per fleet (grey 5-client fleets: about 5 minutes on one core;
CIFAR-10 fleets: 40-60 minutes); `measure` is seconds per fleet.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import shutil
import tempfile
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from benchmarks.inprocess_fleet import cached_uploads
from benchmarks.poisoning import make_variant
from benchmarks.records import code_version, machine, record_from_result
from launcher.launch import run_config_items
from launcher.replay import replay, replay_config
from oneshot_fl.archive import load_uploads
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.data.datasets import to_tensor
from oneshot_fl.devices import set_threads
from oneshot_fl.engine.stratify import normalise
from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
from oneshot_fl.engine.teachers import (CALIBRATION_FLOOR, ClientEnsemble, MeanLogits, RunningCalibration,
                                        Teacher, calibrate)
from oneshot_fl.engine.trust import recognition
from oneshot_fl.logs import setup_logging
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from strategies import build_strategy
from strategies import datafree
from strategies.datafree import client_models
from strategies.fedhydra import RECIPES, FedHydra, reference_calibration, weigh

log = logging.getLogger("oneshot_fl.bench")
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "runs" / "teacher"
RESULTS = ROOT / "benchmarks" / "results"
TABLE = "fedhydra_teacher"
CONF = ROOT / "benchmarks" / "conf"
STARTED_AT = code_version()  # the code this process imported (a record names it, whatever the tree is by then)
POISONS = ("flip", "random", "scale10", "minus")


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@dataclass(frozen=True)
class Fleet:
    """kind: grey (one architecture), greyhet (grey-hetero-cpu.toml), c10 (cnn3-bn), c10het (the CIFAR-10 file)."""
    kind: str
    dataset: str
    alpha: float
    clients: int
    seed: int
    poison: str = "honest"
    victim: int = 0  # the client poisoned or left out (the leave-one-out replays leave out each in turn)

    @property
    def honest_name(self) -> str:
        return f"{self.kind}-{self.dataset}-{self.alpha:g}-k{self.clients}-s{self.seed}"

    @property
    def name(self) -> str:
        victim = f"{self.victim}" if self.victim else ""
        return self.honest_name + ("" if self.poison == "honest" else f"-{self.poison}{victim}")

    def overrides(self) -> dict:
        conf = {"greyhet": "grey-hetero-cpu.toml", "c10het": "cifar10-hetero-cpu.toml"}.get(self.kind)
        base = _flatten(tomllib.loads((CONF / conf).read_text())) if conf else {}
        return {**base, "dataset": self.dataset, "partition": "niid-bench", "alpha": self.alpha,
                "num-clients": self.clients, "seed": self.seed, "threads": 1, "server-threads": 1}


def fleets() -> list[Fleet]:
    grey = [Fleet("grey", d, a, k, 100) for d in ("mnist", "fmnist") for a in (0.1, 0.3) for k in (5, 10)]
    greyhet = [Fleet("greyhet", d, a, 5, 100) for d in ("mnist", "fmnist") for a in (0.1, 0.3)]
    cifar = [Fleet(kind, "cifar10", a, 5, 100) for kind in ("c10", "c10het") for a in (0.1, 0.5)]
    poisoned = [Fleet("grey", d, 0.1, 5, 100, p) for d in ("mnist", "fmnist") for p in POISONS]
    return grey + greyhet + cifar + poisoned


def fleet_named(name: str) -> Fleet:
    """A fleet of `fleets()` by name, or one of them without client k: `<honest fleet>-minus<k>` (client 0:
    `-minus`)."""
    for fleet in fleets():
        if fleet.name == name:
            return fleet
        for k in range(fleet.clients):
            if fleet.poison == "honest" and name == f"{fleet.name}-minus{k or ''}":
                return replace(fleet, poison="minus", victim=k)
    raise SystemExit(f"unknown fleet {name!r}; known: {', '.join(f.name for f in fleets())}")


# --- stage 1: the cache ------------------------------------------------------------------------------------

def honest_uploads(fleet: Fleet) -> Path:
    cfg = from_run_config(merge_overrides({**fleet.overrides(), "method": "fedavg"}))
    folder = CACHE / fleet.honest_name / "uploads"
    cached_uploads(folder, cfg, [(p, "classifier", cfg.arch_for(p)) for p in range(cfg.num_clients)])
    return folder


def fleet_uploads(fleet: Fleet) -> Path:
    honest = honest_uploads(fleet)
    if fleet.poison == "honest":
        return honest
    return make_variant(honest, fleet.poison, fleet.victim, CACHE / fleet.name / "uploads")


@torch.no_grad()
def _logits(model, images: torch.Tensor, device, batch: int = 512) -> torch.Tensor:
    return torch.cat([model(images[f:f + batch].to(device)).float().cpu() for f in range(0, len(images), batch)])


@contextmanager
def fleet_bank(fleet: Fleet):
    """(cfg, strategy, ctx, models, ensemble) of a robust FedHydra replay of the fleet's archive, as replay builds
    them (the fleet's server settings; one thread; a scratch run folder)."""
    uploads = fleet_uploads(fleet)
    server = {k: v for k, v in fleet.overrides().items() if k.split(".")[0] in ("distill", "fedhydra", "eval")}
    cfg = from_run_config(replay_config(uploads, {**server, "method": "fedhydra", "threads": 1}))
    set_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        strategy = build_strategy(cfg, Path(tmp) / "run")
        ctx = strategy.ctx
        ups = load_uploads(uploads, ctx.num_classes, ctx.input_shape, strategy.roles, skip_other_roles=True)
        models = client_models(ups, ctx)
        ensemble = ClientEnsemble(models, [up.arch for up in ups])
        try:
            yield cfg, strategy, ctx, ups, models, ensemble
        finally:
            ensemble.close()


def build_cache(fleet: Fleet) -> Path:
    """benchmarks/runs/teacher/<fleet>/cache.pt: what `measure` reads."""
    out = CACHE / fleet.name / "cache.pt"
    if out.is_file():
        return out
    with fleet_bank(fleet) as (_, strategy, ctx, ups, models, ensemble):
        test = to_tensor(ctx.test.images)
        test_logits = torch.stack([_logits(m, test, ctx.device) for m in models])  # (m, n, c)
        ms = strategy.stratify(ensemble, ctx)
        samples = ms.samples  # (m, c, s, C, H, W)
        flat = samples.reshape(-1, *samples.shape[3:])
        ms_logits = torch.stack([_logits(m, flat, ctx.device) for m in models]).view(
            len(models), *samples.shape[:3], ctx.num_classes)  # (judge, owner, class, s, c)
    torch.save({"fleet": fleet.name, "test_logits": test_logits, "test_labels": torch.as_tensor(ctx.test.labels),
                "u": ms.u, "losses": ms.losses, "steps_run": ms.steps_run, "ms_seconds": ms.seconds,
                "ms_logits": ms_logits, "partition_ids": [up.partition_id for up in ups],
                "archs": [up.arch for up in ups], "label_counts": [list(up.label_counts) for up in ups],
                "code_version": code_version()}, out)
    log.info("%s: cache written (MS %.0fs)", fleet.name, ms.seconds)
    return out


SYNTH_EPOCHS = 16  # generator epochs of the synthetic reference (one kept batch each)


def build_synthetic_reference(fleet: Fleet) -> Path:
    """benchmarks/runs/teacher/<fleet>/synth.pt: every client's logits on SYNTH_EPOCHS batches of a generator
    trained as the distillation's is (CE through the clients' mean logits + the BN-statistics loss, the fleet's
    generator settings; no student term), the reference a calibration fixed before distillation could read."""
    out = CACHE / fleet.name / "synth.pt"
    if out.is_file():
        return out
    with fleet_bank(fleet) as (cfg, strategy, ctx, _, models, ensemble):
        dcfg = cfg.distill
        channels, size, _ = ctx.input_shape
        student = build(cfg.global_arch, ctx.input_shape, ctx.num_classes, seed=0).to(ctx.device)
        synth = GeneratorSynthesizer(Teacher(ensemble, MeanLogits()), student,
                                     GeneratorSpec(dcfg.nz, dcfg.ngf, size, channels),
                                     GeneratorLoss(ce=1.0, bn=strategy.params.lambda_bn, adv=0.0), ctx.num_classes,
                                     dcfg.synth_batch, dcfg.generator_steps, dcfg.lr_generator, ctx.seed("reference"),
                                     ctx.device)
        images = torch.cat([synth.synthesize().images.detach().cpu() for _ in range(SYNTH_EPOCHS)])
        logits = torch.stack([_logits(m, images, ctx.device) for m in models])  # (m, N, c)
    torch.save({"fleet": fleet.name, "logits": logits, "code_version": code_version()}, out)
    log.info("%s: synthetic reference written (%d images)", fleet.name, len(images))
    return out


# --- stage 2: scores, calibrations, teachers ------------------------------------------------------------------

def recall_of(test_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(c, m): client k's recall of class j on the test set (report only)."""
    c = test_logits.shape[2]
    pred = test_logits.argmax(dim=2)  # (m, n)
    return torch.stack([(pred[:, labels == j] == j).float().mean(dim=1) for j in range(c)])


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of two vectors (average ranks for ties); nan where either is constant."""
    if float(a.std()) == 0 or float(b.std()) == 0:
        return float("nan")
    return float(spearmanr(a.numpy(), b.numpy()).statistic)


def tracking(u_r: torch.Tensor, recall: torch.Tensor) -> float:
    """Mean over classes of the rank correlation between U_r[j, :] and the clients' recall of j."""
    values = [spearman(u_r[j], recall[j]) for j in range(u_r.shape[0])]
    values = [v for v in values if v == v]
    return float(np.mean(values)) if values else float("nan")


def peer_probs(ms_logits: torch.Tensor) -> torch.Tensor:
    """D[k', k, j, :] as engine.trust.peer_distributions: judge k' on the images that convinced k of j."""
    return F.softmax(ms_logits, dim=-1).mean(dim=3)


def scores(u: torch.Tensor, D: torch.Tensor) -> dict[str, torch.Tensor]:
    """Candidate competence scores, each (c, m), from MS's scores u and the clients' view of every MS image."""
    m, c = D.shape[0], D.shape[2]
    others = (1.0 - torch.eye(m))[:, :, None, None]  # [k, k']: k' != k
    # prior[j, k]: how often client k calls another client's MS image j (its label prior, over all classes' images)
    prior = ((D * others).sum(dim=(1, 2)) / (others.sum() / m * c)).T
    hit = (torch.diagonal(D, dim1=2, dim2=3) * others[:, :, :, 0]).sum(dim=1).T / max(m - 1, 1)
    recog = recognition(D)
    # whit[j, k]: hit weighted by the peers' own MS competence on j (their class-j images show j if they know j)
    w = normalise(u)[0].T[None, :, :] * others[:, :, :, 0]  # [k, k', j]
    whit = ((torch.diagonal(D, dim1=2, dim2=3) * w).sum(dim=1) / w.sum(dim=1).clamp_min(1e-12)).T
    return {"ms": u, "prior": prior, "hit": hit, "recog": recog, "ms*prior": u * prior, "ms*recog": u * recog,
            "ms*hit": u * hit, "whit": whit, "ms*whit": u * whit, "ms^2": u ** 2, "ms^4": u ** 4,
            "(ms*hit)^2": (u * hit) ** 2, "(ms*whit)^2": (u * whit) ** 2}


def fixed_stats(ms_logits: torch.Tensor, own: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's mean and spread of its top logit over the MS images (all of them, or only the others')."""
    m = ms_logits.shape[0]
    top = ms_logits.amax(dim=-1)  # (judge, owner, c, s)
    mu, sd = torch.zeros(m), torch.zeros(m)
    for k in range(m):
        values = top[k] if own else top[k][torch.arange(m) != k]
        mu[k], sd[k] = values.mean(), values.std()
    return mu, sd


def weighted_stats(ms_logits: torch.Tensor, u_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's mean and spread of its top logit over the MS images, the images of pair (k', j) weighted by
    U_r[j, k'] / c: every class weighs the same, and within it the images of the clients competent on it count."""
    m, c, s = ms_logits.shape[1:4]
    top = ms_logits.amax(dim=-1)  # (judge, owner, c, s)
    w = (u_r.T / c)[:, :, None].expand(m, c, s) / s  # (owner, c, s), sums to 1
    mu = (top * w).sum(dim=(1, 2, 3))
    var = (w * (top - mu[:, None, None, None]) ** 2).sum(dim=(1, 2, 3))
    return mu, var.sqrt()


def calibrated_fixed(logits: torch.Tensor, mu: torch.Tensor, sd: torch.Tensor) -> torch.Tensor:
    sd = torch.maximum(sd, CALIBRATION_FLOOR * sd.median())
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    return (logits - mu[:, None, None]) / sd[:, None, None]


def teacher_accuracy(values: torch.Tensor, u_r: torch.Tensor, labels: torch.Tensor) -> float:
    """Route by output class: P[i, j] = sum_k U_r[j, k] values_k[i, j]."""
    pred = torch.einsum("ck,kbc->bc", u_r, values).argmax(dim=1)
    return float((pred == labels).float().mean())


def batched(fn, logits: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([fn(logits[:, f:f + batch]) for f in range(0, logits.shape[1], batch)], dim=1)


def expelled(u: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """The robust recipe's expel on MS's scores (as strategies.fedhydra.weigh makes it)."""
    weighting = weigh(u, D, RECIPES["robust"])
    return torch.zeros(u.shape[1], dtype=torch.bool) if weighting.left_out is None else weighting.left_out


CALIBRATIONS = ("batch", "fixed-ms", "fixed-others", "fixed-ur", "fixed-synth", "shift", "logits")


def teachers(cache: dict, keep: torch.Tensor, use_expel: bool = True) -> dict:
    """{(score, calibration): (accuracy at batch 512, {batch: acc}, tracking)} for the clients `keep` marks."""
    test_logits, labels = cache["test_logits"][keep], cache["test_labels"]
    ms_logits = cache["ms_logits"][keep][:, keep]
    u = cache["u"][:, keep]
    D = peer_probs(ms_logits)
    out_mask = expelled(u, D) if use_expel else torch.zeros(int(keep.sum()), dtype=torch.bool)
    kept = ~out_mask
    recall = recall_of(test_logits, labels)
    spaces = {"fixed-ms": fixed_stats(ms_logits[kept][:, kept]), "fixed-others": fixed_stats(ms_logits[kept][:, kept],
                                                                                              own=False)}
    rows = {}
    for name, score in scores(u[:, kept], D[kept][:, kept]).items():
        u_r = torch.zeros(u.shape)
        u_r[:, kept] = normalise(score)[0]
        track = tracking(u_r[:, kept], recall[:, kept])
        z = test_logits[kept]
        for cal in CALIBRATIONS:
            if cal == "batch":
                by_batch = {b: teacher_accuracy(batched(calibrate, z, b), u_r[:, kept], labels) for b in (1, 32, 512)}
                acc = by_batch[512]
            else:
                if cal == "logits":
                    values = z
                elif cal == "shift":
                    values = z - z.amax(dim=2, keepdim=True)
                elif cal == "fixed-synth":
                    if "synth_logits" not in cache:
                        continue
                    top = cache["synth_logits"][keep][kept].amax(dim=2)
                    values = calibrated_fixed(z, top.mean(dim=1), top.std(dim=1))
                elif cal == "fixed-ur":
                    values = calibrated_fixed(z, *weighted_stats(ms_logits[kept][:, kept], u_r[:, kept]))
                else:
                    values = calibrated_fixed(z, *spaces[cal])
                acc = teacher_accuracy(values, u_r[:, kept], labels)
                by_batch = {}
            rows[(name, cal)] = {"teacher_accuracy": acc, "by_batch": by_batch, "tracking": track,
                                 "left_out": out_mask.nonzero().flatten().tolist()}
    return rows


def expel_signals(cache: dict) -> dict:
    """The robust recipe's expel on the whole fleet, per client: the share of its judged claims the peers reject,
    how well it recognises its peers' images of the classes it claims, and whether both bars were crossed."""
    check = weigh(cache["u"], peer_probs(cache["ms_logits"]), RECIPES["robust"]).check
    return {"rejected_share": check.rejected_share.tolist(), "claim_recognition": check.claim_recognition.tolist(),
            "expelled": check.expelled.tolist()}


def measure(fleet: Fleet, use_expel: bool = True) -> dict:
    cache = torch.load(CACHE / fleet.name / "cache.pt", weights_only=False)
    if (CACHE / fleet.name / "synth.pt").is_file():
        cache["synth_logits"] = torch.load(CACHE / fleet.name / "synth.pt", weights_only=False)["logits"]
    m = cache["test_logits"].shape[0]
    everyone = torch.ones(m, dtype=torch.bool)
    full = teachers(cache, everyone, use_expel)
    loo = {}
    if fleet.poison == "honest":
        for k in range(m):
            keep = everyone.clone()
            keep[k] = False
            loo[k] = teachers(cache, keep, use_expel)
    recall = recall_of(cache["test_logits"], cache["test_labels"])
    signals = expel_signals(cache)
    client_acc = [float((cache["test_logits"][k].argmax(1) == cache["test_labels"]).float().mean()) for k in range(m)]
    rows = []
    for (score, cal), row in full.items():
        deltas = [loo[k][(score, cal)]["teacher_accuracy"] - row["teacher_accuracy"] for k in sorted(loo)]
        rows.append({"score": score, "calibration": cal, **row, "loo_delta": deltas,
                     "loo_max_gain": max(deltas) if deltas else None})
    # one record per fleet: what belongs to the fleet (clients, recall, expel) is written once, not per row
    return {"table": TABLE, "fleet": fleet.name, "poison": fleet.poison, "expel": use_expel, "rows": rows,
            "client_accuracy": client_acc, "recall": recall.tolist(), "expel_signals": signals,
            "archs": cache["archs"], "cache_code_version": cache["code_version"], "code_version": STARTED_AT,
            "machine": machine(), "recorded_at": datetime.now().isoformat(timespec="seconds")}


# --- stage 3: replays (distillation included) of calibration variants ----------------------------------------

CALIBRATION_VARIANTS = ("batch", "fixed-ms", "running-ms", "running")


def calibrated_fedhydra(kind: str):
    """FedHydra (robust) whose calibrated SA reads `kind`'s statistics: batch (each batch's own),
    fixed-ms (fixed before distillation from the kept clients' MS images), running-ms / running (running
    statistics over the distillation's batches, started from the MS images' or from the first batch's)."""
    class Variant(FedHydra):
        captured: dict = {}  # the teacher and context of the last run, for its accuracy after distillation

        def stratify(self, ensemble, ctx):
            self._ms = super().stratify(ensemble, ctx)
            return self._ms

        def make_aggregator(self, ensemble, uploads, ctx):
            before = list(ensemble.models)
            aggregator, report = super().make_aggregator(ensemble, uploads, ctx)
            if kind == "batch":
                aggregator.calibration = None  # each batch's own statistics (the product's running ones replaced)
                return aggregator, report
            after = {id(m) for m in ensemble.models}  # expel's survivors
            kept = torch.tensor([id(m) in after for m in before])
            reference = reference_calibration(ensemble, self._ms.samples[kept])
            if kind == "fixed-ms":
                aggregator.calibration = reference
            else:
                aggregator.calibration = RunningCalibration(initial=reference if kind == "running-ms" else None)
                aggregator.calibration.updating = False  # the teacher's test accuracy before distillation
            return aggregator, report

        def make_synthesizer(self, teacher, student, ctx):
            Variant.captured = {"teacher": teacher, "ctx": ctx}
            if isinstance(teacher.aggregator.calibration, RunningCalibration):
                teacher.aggregator.calibration.updating = True
            return super().make_synthesizer(teacher, student, ctx)

    def after_distillation() -> float | None:
        """The teacher's test accuracy with the statistics it ended with (running variants; None otherwise)."""
        teacher, ctx = Variant.captured["teacher"], Variant.captured["ctx"]
        calibration = teacher.aggregator.calibration
        if not isinstance(calibration, RunningCalibration):
            return None
        with calibration.frozen():
            return datafree.teacher_accuracy(teacher, ctx)

    Variant.after_distillation = staticmethod(after_distillation)
    return Variant


def replay_variant(fleet: Fleet, kind: str, server_seed: int | None = None) -> dict:
    """The student of `fleet`'s uploads under calibration `kind`. `server_seed` (default: the fleet's seed) seeds
    only the server's streams (initialisation, synthesis): the same uploads at another server seed measure how far
    a student moves by chance, the noise a leave-one-out gain is read against."""
    uploads = fleet_uploads(fleet)
    server = {k: v for k, v in fleet.overrides().items() if k.split(".")[0] in ("distill", "fedhydra", "eval")}
    server_seed = fleet.seed if server_seed is None else server_seed
    folder = f"replay-{kind}"
    if server_seed != fleet.seed:
        server["seed"] = server_seed
        folder += f"-server{server_seed}"
    run_dir = CACHE / fleet.name / folder
    if run_dir.exists():
        shutil.rmtree(run_dir)
    # the minus fleet is the fleet without client 0: one upload fewer than its num-clients
    quorum = {"min-clients": fleet.clients - 1} if fleet.poison == "minus" else {}
    sets = run_config_items({**server, **quorum, "method": "fedhydra", "threads": 1})
    variant = calibrated_fedhydra(kind)
    result = replay(uploads, sets, run_dir=run_dir, strategy_cls=variant)
    return record_from_result(f"{TABLE}_replays", {**result, "code_version": STARTED_AT}, {"calibration": kind},
                              {"fleet": fleet.name, "poison": fleet.poison, "calibration": kind,
                               "server_seed": server_seed,
                               "teacher_after_distillation": variant.after_distillation()})


def latest_records() -> dict[tuple, dict]:
    """(fleet, score, calibration, expel) -> the newest record."""
    out = {}
    path = RESULTS / f"{TABLE}.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        for r in score_rows(json.loads(line)):
            out[(r["fleet"], r["score"], r["calibration"], r["expel"])] = r
    return out


def score_rows(record: dict) -> list[dict]:
    """A fleet's measure record as one dict per score x calibration, each with the fleet's fields."""
    fleet = {k: v for k, v in record.items() if k != "rows"}
    return [{**fleet, **row} for row in record["rows"]]


def expel_section(records: dict) -> list[str]:
    """Per fleet, expel's two signals for each client (measure's expel_signals), the bars beside them."""
    robust = RECIPES["robust"]
    lines = []
    for fleet in sorted({f for (f, *_) in records}):
        r = next((r for (f, *_), r in records.items() if f == fleet and r.get("expel_signals")), None)
        if r is None:
            continue
        sig = r["expel_signals"]
        median = float(np.median(sig["claim_recognition"]))
        cells = [f"{k}: {share:.2f} / {rec:.3f}" + (" **out**" if out else "")
                 for k, (share, rec, out) in enumerate(zip(sig["rejected_share"], sig["claim_recognition"],
                                                           sig["expelled"]))]
        lines.append(f"| {fleet} | {median:.3f} | " + " · ".join(cells) + " |")
    if not lines:
        return []
    return ["", "## Expel's signals per client (whole fleet, robust recipe)", "",
            f"Per client k: the share of its judged claims the peers reject / how well it recognises its peers' images "
            f"of the classes it claims. Expelled (**out**) where the share is >= {robust.expel_rejected} and the "
            f"recognition < {robust.expel_recognition} x the fleet's median (column 2). A flipped or random client is "
            "client 0 of its fleet.", "", "| fleet | median recognition | client: rejected share / recognition |",
            "|---|---|---|", *lines]


def noise_lines(reseeded: dict[tuple, dict]) -> list[str]:
    """Per (fleet, calibration) replayed at more than one server seed: the student at each seed and their spread,
    the chance movement of a student on fixed uploads (`replay --server-seeds`)."""
    seeds: dict[tuple, dict[int, float]] = defaultdict(dict)
    for (fleet, kind, seed), r in reseeded.items():
        seeds[(fleet, kind)][seed] = 100 * r["accuracy_final"]
    lines = []
    for (fleet, kind), by_seed in sorted(seeds.items()):
        if len(by_seed) < 2:
            continue
        values = list(by_seed.values())
        students = ", ".join(f"server seed {s}: {a:.2f}" for s, a in sorted(by_seed.items()))
        spread = f"range {max(values) - min(values):.2f}, std {statistics.stdev(values):.2f}"
        lines.append(f"- {fleet} ({kind}): {students}; {spread}")
    if not lines:
        return []
    gains = []  # a fleet without client k against the whole fleet, each the mean over the server seeds both have
    for (fleet, kind), by_seed in sorted(seeds.items()):
        whole = seeds.get((fleet.rsplit("-minus", 1)[0], kind)) if "-minus" in fleet else None
        common = sorted(set(by_seed) & set(whole or {}))
        if len(common) >= 2:
            without, with_all = (statistics.mean(d[s] for s in common) for d in (by_seed, whole))
            gains.append(f"- {fleet} ({kind}): {without:.2f} against {with_all:.2f} with every client over server "
                         f"seeds {', '.join(map(str, common))}: {without - with_all:+.2f}")
    return ["", "Students on the same uploads at other server seeds (`replay --server-seeds`; the seed reaches only "
            "the server's initialisation and synthesis), the noise a leave-one-out gain is read against:", "", *lines,
            *(["", "Leave-one-out over server seeds (means of the students at the seeds both fleets were replayed "
                "at; points):", "", *gains] if gains else [])]


def render() -> Path:
    """benchmarks/results/fedhydra_teacher.md: per score x calibration, the honest fleets' mean teacher accuracy,
    U_r's mean rank correlation with recall, the largest leave-one-out gain, and the poisoned fleets' distance to
    the fleet without the poisoner."""
    records = latest_records()
    keys = sorted({(s, c, e) for (_, s, c, e) in records}, key=lambda k: (not k[2], k[0], CALIBRATIONS.index(k[1])))
    honest = sorted({f for (f, *_), r in records.items() if r["poison"] == "honest"})
    poisoned = sorted({f for (f, *_), r in records.items() if r["poison"] not in ("honest", "minus")})
    lines = [f"# FedHydra's label-free teacher on tuning fleets ({len(honest)} honest, {len(poisoned)} poisoned)", "",
             "Generated by `python -m experiments.fedhydra_teacher measure` from each fleet's cache (clients, their "
             "test logits, one MS of the robust recipe). Teacher: route by output class over the clients expel keeps. "
             "Columns: mean teacher accuracy (%) over the honest fleets; the mean over fleets of U_r's rank "
             "correlation with per-class test recall; the largest gain any one client's removal gives any honest "
             "fleet's teacher (points; the fleet's name in brackets); over the poisoned fleets (flip, random, x10 of "
             "client 0), the worst distance to the same fleet without client 0 (points).", "",
             "| score | calibration | expel | honest teacher | tracking | largest leave-one-out gain | "
             "poisoned - minus (worst) |", "|---|---|---|---|---|---|---|"]
    for score, cal, expel_on in keys:
        rows = [records[(f, score, cal, expel_on)] for f in honest if (f, score, cal, expel_on) in records]
        if not rows:
            continue
        acc = 100 * np.mean([r["teacher_accuracy"] for r in rows])
        track = np.nanmean([r["tracking"] for r in rows])
        gains = [(r["loo_max_gain"], r["fleet"]) for r in rows if r["loo_max_gain"] is not None]
        worst_gain = max(gains) if gains else None
        bars = []
        for f in poisoned:
            minus = f.rsplit("-", 1)[0] + "-minus"
            if (f, score, cal, expel_on) in records and (minus, score, cal, expel_on) in records:
                bars.append((100 * (records[(f, score, cal, expel_on)]["teacher_accuracy"]
                                    - records[(minus, score, cal, expel_on)]["teacher_accuracy"]), f))
        worst_bar = min(bars) if bars else None
        lines.append(f"| {score} | {cal} | {'yes' if expel_on else 'no'} | {acc:.2f} (n={len(rows)}) | {track:.2f} | "
                     + (f"{100 * worst_gain[0]:+.2f} ({worst_gain[1]})" if worst_gain else "") + " | "
                     + (f"{worst_bar[0]:+.2f} ({worst_bar[1]})" if worst_bar else "") + " |")
    lines += ["", "## Per fleet (default calibration of each score: batch over test batches of 512)", "",
              "| fleet | clients (%) | " + " | ".join(s for s in dict.fromkeys(k[0] for k in keys)) + " |",
              "|---|---|" + "---|" * len(dict.fromkeys(k[0] for k in keys))]
    for f in sorted({f for (f, *_) in records}):
        row = [records.get((f, s, "batch", True)) for s in dict.fromkeys(k[0] for k in keys)]
        any_row = next((r for r in row if r), None)
        if any_row is None:
            continue
        clients = " / ".join(f"{100 * a:.0f}" for a in any_row["client_accuracy"])
        lines.append(f"| {f} | {clients} | " + " | ".join(
            f"{100 * r['teacher_accuracy']:.2f}" + (f" [{r['loo_max_gain'] * 100:+.1f}]" if r["loo_max_gain"]
                                                     is not None else "") if r else "" for r in row) + " |")
    any_record = next(iter(records.values()), None)
    if any_record:
        lines += ["", "Brackets: the largest leave-one-out gain (points). Code: "
                  + ", ".join(sorted({r["code_version"] for r in records.values()})) + f"; machine: "
                  f"{any_record['machine']['processor']}, {any_record['machine']['cpus']} CPUs."]
    lines += expel_section(records)
    reseeded = {}  # (fleet, calibration, server seed) -> the newest record; older records ran at the fleet's seed
    path = RESULTS / f"{TABLE}_replays.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        r = json.loads(line)
        reseeded[(r["fleet"], r["calibration"], r.get("server_seed", r["seed"]))] = r
    replays = {(fleet, kind): r for (fleet, kind, seed), r in reseeded.items() if seed == r["seed"]}
    if replays:
        kinds = [k for k in CALIBRATION_VARIANTS if any(c == k for _, c in replays)]
        lines += ["", "## Replays: the student (distillation included) per calibration of the calibrated SA", "",
                  "`python -m experiments.fedhydra_teacher replay`: the robust recipe with the calibrated space's "
                  "statistics taken from each batch (`batch`, the default these replays replaced), fixed before "
                  "distillation from the kept clients' MS images (`fixed-ms`), or kept across the distillation's "
                  "batches as BN keeps running statistics, started from the MS images' (`running-ms`, today's "
                  "default) or from the first batch's (`running`). Cells: the student's final accuracy (%); in "
                  "brackets the teacher on the test set before distillation (batch: over test batches of 512; "
                  "blank where the record predates ensemble_accuracy_start) and, for the running variants, with "
                  "the statistics it ended with.", "",
                  "| fleet | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
        for fleet in sorted({f for f, _ in replays}):
            cells = []
            for kind in kinds:
                r = replays.get((fleet, kind))
                if r is None:
                    cells.append("")
                    continue
                after = r.get("teacher_after_distillation")
                # a record of an adapting teacher carries its start as ensemble_accuracy_start; an older record has
                # only ensemble_accuracy, the start where the run did not score the teacher again
                start = r.get("ensemble_accuracy_start") or (None if after == r["ensemble_accuracy"]
                                                             else r["ensemble_accuracy"])
                teacher = (f"{100 * start:.2f}" if start else "") + (f" -> {100 * after:.2f}" if after else "")
                cells.append(f"{100 * r['accuracy_final']:.2f} ({teacher})")
            lines.append(f"| {fleet} | " + " | ".join(cells) + " |")
        loo = []  # the students of the fleets without each one client, against the whole fleet's (running-ms)
        for fleet in sorted({f for f, _ in replays}):
            whole = replays.get((fleet, "running-ms"))
            without = {k: replays.get((f"{fleet}-minus{k if k else ''}", "running-ms")) for k in range(10)}
            without = {k: r for k, r in without.items() if r is not None}
            if whole is None or whole["poison"] != "honest" or not without:
                continue
            gains = {k: 100 * (r["accuracy_final"] - whole["accuracy_final"]) for k, r in without.items()}
            loo.append(f"- {fleet}: {100 * whole['accuracy_final']:.2f} with every client; without client "
                       + ", ".join(f"{k}: {100 * without[k]['accuracy_final']:.2f} ({gains[k]:+.2f})"
                                   for k in sorted(without))
                       + f"; largest gain {max(gains.values()):+.2f}")
        if loo:
            lines += ["", "Leave-one-out, students (running-ms, the fleet without client k against the whole "
                      "fleet; points):", "", *loo]
        lines += noise_lines(reseeded)
        lines += ["", "Replay code: " + ", ".join(sorted({r["code_version"] for r in replays.values()})) + "."]
    out = RESULTS / f"{TABLE}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("cache", "synth", "measure", "replay", "render", "list"))
    parser.add_argument("--variants", nargs="+", choices=CALIBRATION_VARIANTS, default=list(CALIBRATION_VARIANTS))
    parser.add_argument("--fleets", nargs="+", default=None)
    parser.add_argument("--no-expel", action="store_true", help="measure: the teachers without expel")
    parser.add_argument("--server-seeds", type=int, nargs="+", default=None,
                        help="replay: the same uploads at these server seeds (default: the fleet's own)")
    args = parser.parse_args(argv)
    if args.stage in ("measure", "replay") and code_version().endswith("-dirty"):
        parser.error("records come from committed code: commit first (or run from a worktree of a commit)")
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    chosen = [fleet_named(n) for n in args.fleets] if args.fleets else fleets()
    if args.stage == "list":
        print("\n".join(f.name for f in chosen))
        return 0
    if args.stage in ("cache", "synth"):
        torch.set_num_threads(1)
        for fleet in chosen:
            (build_cache if args.stage == "cache" else build_synthetic_reference)(fleet)
        return 0
    if args.stage == "replay":
        torch.set_num_threads(1)
        RESULTS.mkdir(parents=True, exist_ok=True)
        for fleet in chosen:
            for kind in args.variants:
                for server_seed in args.server_seeds or [fleet.seed]:
                    record = replay_variant(fleet, kind, server_seed)
                    with open(RESULTS / f"{TABLE}_replays.jsonl", "a") as fh:
                        fh.write(json.dumps(record) + "\n")
                    log.info("%s %s server seed %d: student %.4f", fleet.name, kind, server_seed,
                             record["accuracy_final"])
        return 0
    if args.stage == "render":
        print(render())
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"{TABLE}.jsonl", "a") as fh:
        for fleet in chosen:
            if not (CACHE / fleet.name / "cache.pt").is_file():
                log.warning("%s: no cache yet (run the cache stage)", fleet.name)
                continue
            fh.write(json.dumps(measure(fleet, not args.no_expel)) + "\n")
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
