"""Teacher probe: FedHydra's label-free SA teacher on an uploads archive, no distillation.

For tuning the stratification and the peer check cheaply: Model Stratification runs once per archive
(as in a replay of `fedhydra` with the given settings), then each peer-check setting of
`--checks` (and each SA space of `--spaces`) builds its SA teacher from the same MS result, and the
teacher's test accuracy (without labels, the `ensemble_accuracy` of a replay) is printed and appended to
`results/teacher_probe.jsonl` (table `results/teacher_probe.md`: one row per archive, one column per
check). The student follows its teacher closely in the robust mode (the replays' `ensemble_accuracy`
vs `accuracy_final`), so this ranks settings in about a minute per archive instead of a replay's five.
Use it on tuning cells only (seeds >= 100, benchmarks/README.md).

  python -m benchmarks.teacher_probe benchmarks/runs/tuning/mnist-0.1-s100/uploads \
      --variants honest flip random scale10 minus --checks off rounds=1 rounds=2 judges=2
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

from benchmarks.records import RESULTS_DIR, append_record, code_version, load_records, machine, repo_relative
from benchmarks.robustness import VARIANTS, make_variant
from oneshot_fl.logs import setup_logging

log = logging.getLogger("oneshot_fl.bench")
TABLE = "teacher_probe"
STABILITY_SHIFTS = (1, 2, 3)  # the 'stable' check's settings, computed once per archive
STABILITY_NOISE = (0.0, 0.2)


def parse_check(text: str) -> dict | None:
    """'off' -> None (no peer check); 'rounds=1,judges=2' -> keyword arguments of `peer_check` (one judge
    where a name gives no `judges`, as the records made before the default became 2 were);
    'roundtrip[,power=P]' -> {"check": "roundtrip", ...}: keyword arguments of `round_trip`;
    'prior[,power=G]' -> {"check": "prior", ...}: the agreement check (two judges) on u * output_prior ** G;
    'stable[,shift=S,noise=N,power=G,judges=0]': the same on u * conviction_stability ** G (judges=0: no check);
    'discredit[,tau=T,min=N,iter=I,rival=R,pow=P,all=1,rec=G]': the agreement check, then `engine.trust.discredit` at
    T / N (0.1 / 1 unless given), with the variants tried beside it: I more checks with the judges reweighted by
    the discredited U_r, an unjudged pair discredited only where another client holds >= R of MS's U_r of its
    class, the judged pairs' trust ** P, a rejected client's judged pairs capped at its credit too;
    'recognise[,power=P,floor=F]': the agreement check (two judges), then `engine.trust.recognise` at P / F (2 /
    0.1 unless given); 'oracle[,power=P,behaves=1]': no check, U from the archive's uploaded label counts ** P (1
    unless given), which the method never reads: what SA would make of a stratification that found the data
    exactly; `behaves=1` rolls a flipped victim's counts with its rows (the shares its model acts on);
    'expel[,share=S,ratio=Q]': the agreement check (two judges), then `engine.trust.expel` at S / Q (0.6 / 0.5)."""
    if text == "off":
        return None
    out = {}
    items = text.split(",")
    if items[0] in ("roundtrip", "prior", "stable", "discredit", "recognise", "oracle", "expel"):
        out["check"] = items.pop(0)
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = float(value) if "." in value else int(value)
        except ValueError:
            out[key] = value  # a named option
    return out


def fedhydra_fleet(uploads: Path, sets: list[str], run_dir: Path):
    """(strategy, uploads, ClientEnsemble) of a `fedhydra` replay of the archive with these overrides, as the
    replay builds them; the caller closes the ensemble."""
    from oneshot_fl.archive import load_uploads
    from oneshot_fl.config import from_run_config
    from oneshot_fl.devices import set_threads
    from oneshot_fl.engine.teachers import ClientEnsemble
    from oneshot_fl.launch import parse_overrides
    from oneshot_fl.replay import replay_config
    from strategies import build_strategy
    from strategies.datafree import client_models

    cfg = from_run_config(replay_config(uploads, parse_overrides(["method='fedhydra'", *sets])))
    set_threads(cfg.threads)
    strategy = build_strategy(cfg, run_dir)
    ctx = strategy.ctx
    ups = load_uploads(uploads, ctx.num_classes, ctx.input_shape, strategy.roles, skip_other_roles=True)
    return strategy, ups, ClientEnsemble(client_models(ups, ctx), [up.arch for up in ups])


def fleet_outputs(uploads: Path, sets: list[str], cache: Path) -> dict:
    """What every check reuses: the MS result, the peers' agreement, the logit caps and every client's
    test-set logits, computed once per (archive, settings) and kept in `cache`."""
    import hashlib
    import inspect

    import torch

    import oneshot_fl.engine.stratify as stratify_module
    import oneshot_fl.engine.teachers as teachers_module
    import strategies.fedhydra as fedhydra_module

    from oneshot_fl.data.datasets import to_tensor
    from oneshot_fl.engine.trust import peer_distributions

    # the code that makes what is cached (MS, the peers' probabilities, the teacher's inputs); not the peer check
    sources = [inspect.getsource(m) for m in (stratify_module, teachers_module, fedhydra_module)]
    sources.append(inspect.getsource(peer_distributions))
    key = hashlib.sha256(json.dumps([str(uploads.resolve()), sets, sources]).encode()).hexdigest()[:16]
    path = cache / f"{uploads.parent.name}-{key}.pt"
    if path.is_file():
        return torch.load(path, weights_only=False)
    strategy, ups, ensemble = fedhydra_fleet(uploads, ["threads=1", *sets], cache / "run")
    ctx, p = strategy.ctx, strategy.params
    result = strategy.stratify(ensemble, ctx)
    space = p.resolved("sa_space")
    test_logits = torch.cat([ensemble.logits(to_tensor(ctx.test.images[f:f + 512]).to(ctx.device)).float().cpu()
                             for f in range(0, len(ctx.test), 512)], dim=1)  # (m, n, c)
    out = {"u": result.u, "u_r": result.u_r, "u_c": result.u_c,
           "distributions": peer_distributions(ensemble.models, result.samples, ctx.device),
           "scales": strategy.logit_caps(ensemble, result, ctx) if result.samples is not None else None,
           "space": space, "route": p.resolved("sa_route"), "min_evidence": p.peer_min_evidence,
           "test_logits": test_logits, "test_labels": torch.as_tensor(ctx.test.labels).long(),
           "clients": [up.partition_id for up in ups]}
    if result.samples is not None:
        with ensemble.bn_paused(), torch.no_grad():
            out["stability"] = {(shift, noise): conviction_stability(ensemble.models, result.samples, ctx.device,
                                                                     shift=shift, noise=noise)
                                for shift in STABILITY_SHIFTS for noise in STABILITY_NOISE}
    ensemble.close()
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def output_prior(distributions):
    """prior[j, k]: client k's mean probability of class j over the other clients' MS images, (c, m). A model
    trained on few examples of a class rarely answers it; tried as a factor on MS's score (stop 29, dropped:
    benchmarks/README.md). distributions: `peer_distributions`' (judge, maker, class, class); every (maker,
    class) pair has as many images, so the mean of its means is the mean over the images."""
    import torch

    m = distributions.shape[0]
    return torch.stack([distributions[k, [o for o in range(m) if o != k]].mean(dim=(0, 1)) for k in range(m)], dim=1)


def shifted(images, shift: int, generator):
    """Each image moved by its own random integer offset in [-shift, shift]^2, zeros shifted in."""
    import torch
    import torch.nn.functional as F

    n, _, h, w = images.shape
    padded = F.pad(images, (shift, shift, shift, shift))
    dy, dx = torch.randint(0, 2 * shift + 1, (2, n), generator=generator).tolist()
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def conviction_stability(models, samples, device, views: int = 8, shift: int = 2, noise: float = 0.0, seed: int = 0):
    """s[j, k]: client k's mean probability of class j on its own class-j MS images moved by a few pixels
    (and, with `noise`, Gaussian noise of that std added, clamped to [0, 1]), over `views` random views.

    A client that knows j is convinced by a shape it learned, which survives a small shift; a client
    that saw a handful of j is convinced by a pattern tuned to its weights, which mostly does not
    (adversarial patterns are brittle to translation). samples: (m, c, s, C, H, W) -> (c, m). Tried at
    stop 30 as a factor on MS's score (u * s ** power, `stable` checks; dropped: benchmarks/README.md)."""
    import torch
    import torch.nn.functional as F

    m, c, s = samples.shape[:3]
    gen = torch.Generator().manual_seed(seed)
    target = torch.arange(c).repeat_interleave(s)
    out = torch.zeros(c, m, dtype=torch.float64)
    for k, model in enumerate(models):
        flat = samples[k].reshape(c * s, *samples.shape[3:])
        for _ in range(views):
            view = shifted(flat, shift, gen) if shift > 0 else flat
            if noise > 0:
                view = (view + noise * torch.randn(view.shape, generator=gen)).clamp(0, 1)
            probs = F.softmax(model(view.to(device)).double(), dim=1).cpu()
            out[:, k] += probs[torch.arange(c * s), target].view(c, s).mean(dim=1) / views
    return out.float()


def rounded(u_r, digits: int = 4) -> list[list[float]]:
    """U_r for a record: 4 decimals say which client holds which class (a diagnostic; the accuracy is the figure),
    and the full float32 digits made the records file grow by ~1 MB per probe sweep."""
    return [[round(v, digits) for v in row] for row in u_r.tolist()]


def label_counts_of(uploads: Path, clients: list[int], flipped: int | None = None):
    """(c, m) the label counts the archive's clients uploaded, in the fleet's client order (diagnosis only).
    `flipped`: that client's counts rolled the way `robustness`' flip rolls its classifier rows, so that they
    count what its model answers (its class-j data now fires logit j+1), not what it saw."""
    import torch

    from oneshot_fl.archive import load_manifest

    by_client = {entry["partition_id"]: entry["label_counts"] for entry in load_manifest(uploads)["uploads"]}
    counts = torch.tensor([by_client[k] for k in clients], dtype=torch.float32).T
    if flipped is not None and flipped in clients:
        column = clients.index(flipped)
        counts[:, column] = torch.roll(counts[:, column], 1)
    return counts


def discredit_variant(fleet: dict, agree, kwargs: dict):
    """(U_r, U_c) of the agreement check (two judges) followed by `engine.trust.discredit` at tau / min, with the
    variants tried beside it (stop 30, benchmarks/README.md): `iter` more checks with the judges reweighted by the
    discredited U_r; `rival`: an unjudged pair keeps its trust where no other client holds >= rival of MS's
    U_r[j]; `pow`: the judged pairs' trust ** pow; `all`: a rejected client's judged pairs capped at its credit;
    `rec`: `engine.trust.recognise` at that power for the rejected clients (stop 31)."""
    import torch

    from oneshot_fl.engine.stratify import normalise
    from oneshot_fl.engine.trust import discredit, peer_check, recognise

    u, ms_u_r = fleet["u"], fleet["u_r"]
    below, rejections = kwargs.get("tau", 0.1), kwargs.get("min", 1)
    check = discredit(peer_check(u, ms_u_r, agree, min_evidence=fleet["min_evidence"], judges=2), u, ms_u_r,
                      below=below, rejections=rejections)
    for _ in range(kwargs.get("iter", 0)):
        again = peer_check(u, check.u_r, agree, min_evidence=fleet["min_evidence"], judges=2, rounds=1)
        check = discredit(again, u, ms_u_r, below=below, rejections=rejections)
    if kwargs.get("rec", 0):  # `fedhydra.peer-recognition-of = suspects`: recognition for the rejected clients
        check = recognise(check, u, fleet["distributions"], power=kwargs["rec"], clients=check.rejected >= rejections)
    trust = check.trust if check.recognised is None else check.trust * check.recognised
    if kwargs.get("rival", 0):
        m = ms_u_r.shape[1]
        rival = torch.stack([ms_u_r[:, [o for o in range(m) if o != k]].max(dim=1).values for k in range(m)], dim=1)
        trust = torch.where(~check.verifiable & (rival < kwargs["rival"]), torch.ones_like(trust), trust)
    if kwargs.get("pow", 1) != 1:
        trust = torch.where(check.verifiable, trust ** kwargs["pow"], trust)
    if kwargs.get("all", 0):
        trust = torch.minimum(trust, check.credit[None, :])
    return normalise(u * trust)


def two_judges(keep=None, *, u, distributions, min_evidence):
    """The default agreement check (two judges, judges weighted by u's own U_r) on MS scores u, on the clients
    `keep` marks as if they were the whole fleet (None: every client)."""
    from oneshot_fl.engine.stratify import normalise
    from oneshot_fl.engine.trust import agreement_of, peer_check

    if keep is not None:
        u, distributions = u[:, keep], distributions[keep][:, keep]
    return peer_check(u, normalise(u)[0], agreement_of(distributions), min_evidence=min_evidence, judges=2)


def probe(uploads: Path, checks: list[str], sets: list[str], cache: Path,
          spaces: list[str] | None = None, variant: str = "honest", victim: int = 0) -> list[dict]:
    """The label-free teacher's test accuracy for every (SA space, peer check); spaces default to the run's.
    The test set goes through the teacher in batches of 512, as a replay's `ensemble_accuracy` does (the
    calibrated space standardises each client over the batch)."""
    from oneshot_fl.engine.stratify import normalise
    from oneshot_fl.engine.teachers import StratifiedAggregation
    from oneshot_fl.engine.trust import RECOGNITION_FLOOR, agreement_of, expel, peer_check, recognise, round_trip

    fleet = fleet_outputs(uploads, sets, cache)
    judged = {"u": fleet["u"], "distributions": fleet.get("distributions"), "min_evidence": fleet.get("min_evidence")}
    rows = []
    for space in spaces or [fleet["space"]]:
        for name in checks:
            kwargs = parse_check(name)
            kind = kwargs.pop("check", None) if kwargs is not None else "off"
            if kind == "off":
                u_r, u_c = fleet["u_r"], fleet["u_c"]
            elif kind == "roundtrip":
                check = round_trip(fleet["u"], fleet["u_r"], fleet["distributions"], **kwargs)
                u_r, u_c = check.u_r, check.u_c
            elif kind == "discredit":
                u_r, u_c = discredit_variant(fleet, agreement_of(fleet["distributions"]), kwargs)
            elif kind == "oracle":
                flipped = victim if kwargs.get("behaves", 0) and variant == "flip" else None
                u_r, u_c = normalise(label_counts_of(uploads, fleet["clients"], flipped) ** kwargs.get("power", 1))
            elif kind == "expel":
                check = expel(functools.partial(two_judges, **judged), fleet["u"], fleet["distributions"],
                              rejected_above=kwargs.get("share", 0.6), recognition_below=kwargs.get("ratio", 0.5))
                u_r, u_c = check.u_r, check.u_c
            elif kind == "recognise":
                check = recognise(two_judges(**judged), fleet["u"], fleet["distributions"],
                                  power=kwargs.get("power", 2.0), floor=kwargs.get("floor", RECOGNITION_FLOOR))
                u_r, u_c = check.u_r, check.u_c
            elif kind == "stable":
                factor = fleet["stability"][(kwargs.get("shift", 2), float(kwargs.get("noise", 0.0)))]
                u = fleet["u"] * factor ** kwargs.get("power", 1)
                check = two_judges(**{**judged, "u": u}) if kwargs.get("judges", 2) else None
                u_r, u_c = (check.u_r, check.u_c) if check is not None else normalise(u)
            elif kind == "prior":
                u = fleet["u"] * output_prior(fleet["distributions"]) ** kwargs.get("power", 1)
                check = two_judges(**{**judged, "u": u})
                u_r, u_c = check.u_r, check.u_c
            else:
                check = peer_check(fleet["u"], fleet["u_r"], agreement_of(fleet["distributions"]),
                                   **{"min_evidence": fleet["min_evidence"], "judges": 1, **kwargs})
                u_r, u_c = check.u_r, check.u_c
            teacher = StratifiedAggregation(u_r, u_c, space, fleet["route"], fleet["scales"])
            logits, labels = fleet["test_logits"], fleet["test_labels"]
            correct = sum(int((teacher(logits[:, f:f + 512]).argmax(dim=1) == labels[f:f + 512]).sum())
                          for f in range(0, len(labels), 512))
            acc = correct / len(labels)
            rows.append({"archive": repo_relative(uploads) or str(uploads), "check": name, "teacher_accuracy": acc,
                         "space": space, "clients": fleet["clients"], "u_r": rounded(u_r), "sets": sets})
            log.info("%s  space %-10s check %-20s teacher %.4f", uploads.parent.name, space, name, acc)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+", type=Path, help="uploads archives (folders with manifest.json)")
    parser.add_argument("--variants", nargs="+", default=["honest"], choices=VARIANTS)
    parser.add_argument("--victim", type=int, default=0)
    parser.add_argument("--checks", nargs="+", default=["off", "rounds=2"],
                        help="peer-check settings: 'off', key=value[,key=value] of engine.trust.peer_check, "
                             "roundtrip[,power=P] (engine.trust.round_trip), prior[,power=G] (the agreement "
                             "check on MS's score times each client's output prior ** G), stable[,...], "
                             "discredit[,...], recognise[,...], expel[,...] or oracle[,...] (see parse_check)")
    parser.add_argument("--spaces", nargs="+", default=None,
                        help="SA spaces to compare on the same MS result (default: the run's fedhydra.sa-space)")
    parser.add_argument("--set", nargs="*", default=[], help="run-config overrides (server side)")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/oneshot-fl-teacher-probe"),
                        help="where each archive's MS result and test logits are kept between calls")
    args = parser.parse_args(argv)
    setup_logging()
    for archive in args.archives:
        for variant in args.variants:
            target = archive.parent.parent / f"{archive.parent.name}-{variant}-v{args.victim}" / "uploads"
            uploads = make_variant(archive, variant, args.victim, target)
            for row in probe(uploads, args.checks, args.set, args.cache, args.spaces, variant, args.victim):
                row.update({"table": TABLE, "variant": variant, "victim": args.victim, "code": code_version(),
                            "machine": machine()})
                append_record(row)
            render()
    return 0


def render() -> Path:
    """results/teacher_probe.md: the latest teacher accuracy per (archive, check, overrides)."""
    latest = {}
    for row in load_records(TABLE):
        name = Path(row["archive"]).parent.name + (" " + " ".join(row["sets"]) if row["sets"] else "")
        # records before --spaces were all of the space then the default: capped logits
        check = row["check"] + ("" if row.get("space", "capped") == "capped" else f" {row['space']}")
        latest[(name, check)] = row["teacher_accuracy"]
    archives = sorted({a for a, _ in latest})
    checks = sorted({c for _, c in latest}, key=lambda c: (c != "off", c))
    lines = ["# Teacher probe (tuning cells only)", "",
             "Test accuracy (%) of FedHydra's label-free SA teacher, no distillation, one MS run per archive and "
             "every peer-check setting (and SA space, named when not `capped`) on it. Command: "
             "`python -m benchmarks.teacher_probe` (benchmarks/README.md); "
             "records: `teacher_probe.jsonl`.", "",
             "| archive | " + " | ".join(checks) + " |", "|---|" + "---|" * len(checks)]
    for a in archives:
        cells = [f"{100 * latest[(a, c)]:.2f}" if (a, c) in latest else "-" for c in checks]
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    out = RESULTS_DIR / f"{TABLE}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main())
