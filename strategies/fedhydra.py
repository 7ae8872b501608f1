"""FedHydra (Bai et al., "FedHydra: A Unified Solution to Diverse Heterogeneities in One-Shot Federated
Learning"): Model Stratification (Sec. 3.2), then SA-guided data-free distillation (Sec. 3.3).

The server's sequence, top to bottom in `make_aggregator`:
  1. MS: for every client k and class j a fresh generator is trained to convince client k alone of
     class j; how easily it succeeds is the competence score u_kj (engine/stratify.py).
  2. Expel (engine/trust.py): the other clients look at the images that convinced k of j. A client the
     peers mostly reject AND that does not recognise their images of its own classes is left out of the
     teacher. The check's per-pair trust only decides that; it does not reweight u (on honest fleets it
     moved weight away from real owners: benchmarks/results/ablation.md).
  3. U_r (whom to trust for class j) and U_c (what client k is good at) from the scores.
  4. SA (Eqs. 8-11) weights the clients' outputs with them, for the generator's CE and for the student's
     KL + beta hard-label CE (Eq. 19). The expelled clients leave the teacher bank altogether (neither
     their logits nor their BN statistics reach the generator or the student).

`fedhydra.mode` picks one of two fixed recipes (RECIPES): `paper`, the method as published, and
`robust` (the default), what the ablation in benchmarks/README.md supports. Paper mode also trains the
student as published (one step per epoch on that epoch's synthetic batch, a constant rate) unless the run
config sets distill.pool or distill.lr-schedule (config.distill_schedule); its log says which. stratification.json
reports what the run did and how well MS found the data (the uploaded label counts are used for that
report only: a client can lie about them). One exception, a fleet of differentially private uploads: there the
scores of step 3 are the clients' released label histograms (`released_scores`), which the DP mechanism
releases inside each client's budget; MS still makes the images the peer check of step 2 judges them by.
Why: DP-SGD models are less confident, and neither MS (its U is near uniform on DP and non-DP fleets alike)
nor the calibrated SA tells a class's owners from the others any more (benchmarks/results/archive/dp_recipe.md).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import torch

from oneshot_fl import plots
from oneshot_fl.config import distill_schedule, knob
from oneshot_fl.engine.stratify import Stratification, normalise, stratify, stratify_sequential
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import Calibration, RunningCalibration, StratifiedAggregation
from oneshot_fl.engine.trust import PeerCheck, agreement_of, expel, peer_check, peer_distributions, peer_graph
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.results import write_json
from strategies.fedhydra_report import stratification_report, tracking
from strategies.datafree import DataFreeDistillation

log = logging.getLogger("oneshot_fl.strategy")


@dataclass(frozen=True)
class Recipe:
    """What FedHydra's server does. Two fixed recipes (RECIPES); the ablation benchmark varies one field at a time."""
    score: str  # MS score: "paper" (Eq. 2, relative loss range) | "prob-auc" (mean class probability, bounded)
    stop_loss: float  # an MS run stops once its CE is below this (the score then moves by < 1 %); 0 = never
    ms_batch: int  # noise batch of an MS run (the bounded score is a batch mean); 0 = distill.synth-batch
    expel: bool  # leave out clients the peer check marks as confidently wrong about their own classes
    sa_space: str  # "logits" (Eq. 8-11 as written) | "calibrated" (each client's logits on its own scale)
    sa_route: str  # "label" (by the synthetic sample's label, Eq. 8) | "class" (by the output class: label-free)
    bn_cap: float  # a client's BN loss counts for at most this x the median client's; 0 = plain mean
    peer_min_evidence: float = 0.25  # peers' share of U_r[j] needed to judge a (class, client) pair
    peer_judges: int = 2  # peers needed to judge a pair (no single peer decides a one-against-one dispute)
    expel_rejected: float = 0.6  # expel: the share of a client's judged MS weight the peers reject, at least
    expel_recognition: float = 0.5  # expel: its claim recognition below this x the median client's
    # the calibrated space's statistics: "running" (kept across the distillation's batches as BN keeps its running
    # statistics, started from the kept clients' answers to MS's images: an image's answer never depends on the rest
    # of its batch) | "batch" (each batch's own; the ablation's variant)
    calibration: str = "running"


RECIPES = {
    "paper": Recipe(score="paper", stop_loss=0.0, ms_batch=0, expel=False, sa_space="logits", sa_route="label",
                    bn_cap=0.0),
    "robust": Recipe(score="prob-auc", stop_loss=0.01, ms_batch=16, expel=True, sa_space="calibrated",
                     sa_route="class", bn_cap=10.0),
}
PEER_SAMPLES = 16  # images per (client, class) MS run that the peers look at


@dataclass(frozen=True)
class FedHydraParams:
    mode: str = knob("robust", choices=tuple(RECIPES))
    ms_steps: int = knob(30, lo=1)  # T_G of each (client, class) stratification run
    lambda_bn: float = knob(1.0, lo=0.0)
    lambda_adv: float = knob(1.0, lo=0.0)
    beta: float = knob(1.0, lo=0.0)


@dataclass
class Weighting:
    """The teacher's weights and how they were reached: U_r, U_c (c, m), the check (None where the recipe makes
    none) and the clients left out of the teacher ((m,) bool, None where nobody is)."""
    u_r: torch.Tensor
    u_c: torch.Tensor
    check: PeerCheck | None
    left_out: torch.Tensor | None


def weigh(u: torch.Tensor, distributions: torch.Tensor | None, recipe: Recipe,
          peers: torch.Tensor | None = None) -> Weighting:
    """MS scores u (c, m) and the peers' view of the MS images (engine/trust.peer_distributions, over the
    `peers` graph: None = every other client) -> the weights: U_r, U_c from u, without the clients expel
    leaves out (their columns 0)."""
    if not recipe.expel:
        return Weighting(*normalise(u), check=None, left_out=None)

    def check_of(keep: torch.Tensor) -> PeerCheck:  # the agreement check on these clients, as if alone
        kept = u[:, keep]
        return peer_check(kept, normalise(kept)[0], agreement_of(distributions[keep][:, keep]),
                          min_evidence=recipe.peer_min_evidence, judges=recipe.peer_judges,
                          peers=None if peers is None else peers[keep][:, keep])

    check = expel(check_of, u, distributions, rejected_above=recipe.expel_rejected,
                  recognition_below=recipe.expel_recognition, peers=peers)
    if not bool(check.expelled.any()):
        return Weighting(*normalise(u), check=check, left_out=None)
    kept = ~check.expelled
    u_r, u_c = torch.zeros_like(u), torch.zeros_like(u)
    # normalised over the kept clients alone: the very values a fleet without the expelled clients gets
    u_r[:, kept], u_c[:, kept] = normalise(u[:, kept])
    return Weighting(u_r, u_c, check=check, left_out=check.expelled)


def released_scores(uploads) -> torch.Tensor:
    """(c, m): each client's released (noised, rounded, clipped at 0) count of every class: U_r then gives each
    client its share of a class's examples, U_c each class its share of the client's."""
    return torch.stack([torch.as_tensor(up.label_counts, dtype=torch.float32) for up in uploads], dim=1)


def stratified_teacher(ensemble, weighting: Weighting, recipe: Recipe,
                       samples: torch.Tensor | None = None) -> StratifiedAggregation:
    """SA over the clients the weighting keeps. The expelled clients leave the teacher bank (`keep_only`): no
    logits, no BN statistics for the generator, so the distillation is the one the fleet without them gets.
    `samples`: MS's images (m, c, s, C, H, W); the running calibration starts from the kept clients' answers to the
    kept clients' images."""
    u_r, u_c = weighting.u_r, weighting.u_c
    kept = torch.ones(u_r.shape[1], dtype=torch.bool)
    if weighting.left_out is not None:
        kept = ~weighting.left_out
        ensemble.keep_only(kept)
        u_r, u_c = u_r[:, kept], u_c[:, kept]
    calibration = None
    if recipe.sa_space == "calibrated" and recipe.calibration == "running":
        start = None
        if samples is not None:
            with ensemble.bn_paused():  # the clients answer MS's images; the generator's BN loss is not involved
                start = reference_calibration(ensemble, samples[kept])
        calibration = RunningCalibration(initial=start)
    return StratifiedAggregation(u_r, u_c, recipe.sa_space, recipe.sa_route, calibration=calibration)


@torch.no_grad()
def reference_calibration(ensemble, samples: torch.Tensor, batch_size: int = 512) -> Calibration:
    """Every client of the bank on every image of `samples` (MS's, (k, c, s, C, H, W)): the statistics its calibrated
    logits start from, before any synthetic batch of the distillation has been seen."""
    flat = samples.reshape(-1, *samples.shape[3:])
    device = ensemble.device
    return Calibration.of(torch.cat([ensemble.logits(flat[f:f + batch_size].to(device)).float().cpu()
                                     for f in range(0, len(flat), batch_size)], dim=1))


class FedHydra(DataFreeDistillation):
    name = "fedhydra"
    Params = FedHydraParams

    @property
    def recipe(self) -> Recipe:
        return RECIPES[self.params.mode]

    def resolved_settings(self) -> dict:
        """The values this run uses (the recipe of its mode with the MS batch resolved), for result.json."""
        return {"mode": self.params.mode, **asdict(self.recipe), "ms_batch": self.ms_batch(),
                "ms_steps": self.params.ms_steps}

    def ms_batch(self) -> int:
        return self.recipe.ms_batch or self.cfg.distill.synth_batch

    def make_aggregator(self, ensemble, uploads, ctx):
        """MS, the peer check and SA (the module docstring's steps 1-4); the report is stratification.json's summary
        for result.json's `global` block."""
        recipe = self.recipe
        ensemble.bn_cap = recipe.bn_cap
        if self.params.mode == "paper":
            log.info("%s", self.paper_mode_line())
        with ctx.timer.phase("stratification"):
            result = self.cached_stage("stratification", Stratification, ctx, lambda: self.stratify(ensemble, ctx))
            distributions = peers = None
            if recipe.expel:
                peers = peer_graph(len(ensemble), ctx.seed("peer-graph"))  # all others up to MAX_PEERS + 1 clients
                with ensemble.bn_paused():
                    distributions = peer_distributions(ensemble.models, result.samples, ctx.device, peers=peers)
            scores, scores_from = result.u, "ms"
            if uploads and all(up.dp is not None for up in uploads):
                scores, scores_from = released_scores(uploads), "released-label-histograms"
                log.info("%s: differentially private fleet: the class scores are the %d clients' released label "
                         "histograms (their DP-SGD models leave MS's scores near uniform)", self.name, len(uploads))
            weighting = weigh(scores, distributions, recipe, peers)
        summary = self.report(result, weighting, scores_from, uploads, ctx)
        return stratified_teacher(ensemble, weighting, recipe, result.samples), {"stratification": summary}

    def paper_mode_line(self) -> str:
        """The log line of a paper-mode run: the published method in every stage, or which distillation setting the
        run config changed."""
        pool, schedule = distill_schedule(self.cfg)
        own = [f"distill.{key}={value!r} as the run config sets it (the paper's: {paper!r})"
               for key, value, paper in (("pool", pool, "paper"), ("lr-schedule", schedule, "constant"))
               if value != paper]
        student = "; ".join(own) or ("one student step per epoch on that epoch's synthetic batch, at a constant "
                                     "learning rate (distill.pool='paper', distill.lr-schedule='constant')")
        return (f"{self.name} paper mode: the published method (Eq. 2 scores, no peer check, SA on the logits routed "
                f"by the synthetic label); the student: {student}")

    def stratify(self, ensemble, ctx) -> Stratification:
        recipe, dcfg = self.recipe, self.cfg.distill
        channels, size, _ = ctx.input_shape
        spec = GeneratorSpec(dcfg.nz, dcfg.ngf, size, channels)
        # the same U either way (each pair stops at the same step); vmapped pairs pay off on GPUs only
        run = stratify if ctx.device.type == "cuda" else stratify_sequential
        log.info("stratification: %d clients x %d classes, T_G=%d, %s score", len(ensemble), ctx.num_classes,
                 self.params.ms_steps, recipe.score)
        with ensemble.bn_paused():  # MS's loss is the CE alone
            return run(ensemble.models, ctx.num_classes, spec, self.params.ms_steps, self.ms_batch(),
                       dcfg.lr_generator, ctx.seed("stratification"), ctx.device, score=recipe.score,
                       stop_loss=recipe.stop_loss, keep_samples=PEER_SAMPLES if recipe.expel else 0)

    def report(self, result: Stratification, weighting: Weighting, scores_from: str, uploads, ctx) -> dict:
        """stratification.json, the U_r / U_c heat maps and the log lines of what the server did; returns the
        summary result.json carries (tracking, one owner per class, the server's action). `scores_from`: what the
        class scores came from (MS, or a DP fleet's released label histograms)."""
        recipe = self.recipe
        report = stratification_report(result, weighting.check, [up.label_counts for up in uploads],
                                       recipe.sa_route, recipe.sa_space, used_u_r=weighting.u_r)
        report.update({"clients": [f"p{up.partition_id} {up.arch}" for up in uploads], "scores_from": scores_from,
                       "settings": self.resolved_settings(),
                       "used_u_r": weighting.u_r.tolist(), "used_u_c": weighting.u_c.tolist()})
        write_json(ctx.run_dir / "stratification.json", report)
        for key, values, title in (("u_r", weighting.u_r, "U_r: whom to trust for each class (rows sum to 1)"),
                                   ("u_c", weighting.u_c, "U_c: what each client is good at (columns sum to 1)")):
            plots.heatmap(values.numpy(), ctx.run_dir / f"stratification_{key}.png", title, "client", "class",
                          xticklabels=report["clients"])
        log.info("stratification done in %.1fs (%s score); U_r top weight per class: %s; rank correlation "
                 "of U_r with the uploaded label shares (report only): mean %.2f", result.seconds, result.score,
                 [round(float(v), 3) for v in weighting.u_r.max(dim=1).values], report["tracking"]["mean_spearman"])
        log.info("FedHydra (%s): SA on %s, routed by %s; %s", self.params.mode, recipe.sa_space, recipe.sa_route,
                 report["server_action"])
        return {k: report[k] for k in ("tracking", "one_owner_per_class", "server_action")}

    def test_report(self, report: dict, recall: torch.Tensor, uploads, ctx) -> None:
        """stratification.json gets each client's per-class test recall (c, m) and how the U_r the teacher used ranks
        the clients of each class against it (competence, where the label counts say exposure); the heat map beside
        U_r's. The method never reads the test set: this runs after the teacher is built."""
        path = ctx.run_dir / "stratification.json"
        stratification = json.loads(path.read_text())
        used = torch.tensor(stratification["used_u_r"])
        against_recall = tracking(used, list(recall.T.numpy()))
        stratification["recall"] = recall.tolist()
        stratification["tracking"]["recall"] = against_recall
        write_json(path, stratification)
        report["stratification"]["tracking"]["recall"] = against_recall
        plots.heatmap(recall.numpy(), ctx.run_dir / "stratification_recall.png",
                      "each client's test recall per class (report only; compare U_r)", "client", "class",
                      xticklabels=stratification["clients"])
        log.info("rank correlation of the U_r the teacher used with the clients' per-class test recall (report only): "
                 "mean %.2f", against_recall["mean_spearman"])

    def generator_loss(self) -> GeneratorLoss:
        p = self.params
        return GeneratorLoss(ce=1.0, bn=p.lambda_bn, adv=p.lambda_adv, adv_mask="none")  # FedHydra Eq. 16: unmasked

    def student_beta(self) -> float:
        return self.params.beta
