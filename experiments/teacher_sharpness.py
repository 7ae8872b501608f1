"""How sharp is each teacher a student distils from? FedHydra's SA against the clients' mean logits, on one fleet.

A student learns from its teacher's distribution (KL at the run's distillation temperature), not from its argmax,
so a more accurate teacher need not make a better student. This command
puts both teachers on the same test images, SA in batches of the run's synthetic batch and in the batches its
recorded teacher accuracy was measured in (SA's calibrated space standardises each client over the batch, so the
batch size matters), and reports per teacher: accuracy, the mean entropy of its softmax at the distillation
temperature, its mean top probability and the mean spread (std over classes) of its logits; each client's own line
beside them.

  python -m experiments.teacher_sharpness RUN [RUN ...] [--out benchmarks/results/teacher_sharpness.md]

RUN: a FedHydra run folder that kept its uploads (`save-uploads`, as `benchmarks.hetero_table` runs and replays
do): its uploads/ and stratification.json (the U_r, U_c the run used). Test images are the run's own test subset.
Cost: one forward pass of every client over the run's test subset (no training; not timed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.records import code_version
from oneshot_fl.archive import load_manifest, load_uploads
from oneshot_fl.config import RunConfig, from_run_config, merge_overrides
from oneshot_fl.engine.teachers import StratifiedAggregation
from oneshot_fl.evaluation import predict_logits
from strategies.context import make_context
from strategies.datafree import client_models
from strategies.fedhydra import RECIPES

REPORTED_BATCH = 512  # the test batch of a run's recorded teacher accuracy (strategies.datafree.teacher_accuracies)


def teacher_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> dict[str, float]:
    """(n, c) logits -> accuracy, mean softmax entropy at `temperature` (nats), mean top probability, mean std of a
    sample's logits over the classes."""
    log_p = torch.log_softmax(logits / temperature, dim=1)
    p = log_p.exp()
    return {"accuracy": float((logits.argmax(dim=1) == labels).float().mean()),
            "entropy": float(-(p * log_p).sum(dim=1).mean()),
            "top_probability": float(p.max(dim=1).values.mean()),
            "logit_spread": float(logits.std(dim=1).mean())}


def server_config(run_config: dict, data_dir: str | None = None) -> RunConfig:
    """The archived run's configuration, on this machine's data. A replay's archive also names the archive it
    replayed (`replayed-from`, which the server adds to its own configuration): no run-config key, so left out."""
    run_config = {k: v for k, v in run_config.items() if k != "replayed-from"}
    return from_run_config(merge_overrides({**run_config, "data-dir": data_dir or run_config["data-dir"],
                                            "download": False}))


def measure(run_dir: Path, data_dir: str | None = None) -> dict:
    """One run folder -> {"teachers": {name: stats}, "clients": [(label, stats)], settings}."""
    context = load_manifest(run_dir / "uploads")["context"]
    run_config = context["run_config"]
    if run_config.get("method") != "fedhydra":
        raise SystemExit(f"{run_dir}: a FedHydra run folder is needed (this one ran {run_config.get('method')!r})")
    uploads = load_uploads(run_dir / "uploads", context["num_classes"], tuple(context["input_shape"]), ("classifier",))
    strat = json.loads((run_dir / "stratification.json").read_text())
    recipe = RECIPES[run_config["fedhydra.mode"]]
    u_r, u_c = torch.tensor(strat["used_u_r"]), torch.tensor(strat["used_u_c"])
    sa = StratifiedAggregation(u_r, u_c, recipe.sa_space, recipe.sa_route)

    # the server's own context: the run's test subset and device (the folder is only named, never made)
    cfg = server_config(run_config, data_dir)
    with tempfile.TemporaryDirectory() as scratch:
        ctx = make_context(cfg, Path(scratch) / "run")
    test, models = ctx.test, client_models(uploads, ctx)
    batch, temperature = run_config["distill.synth-batch"], run_config["distill.temperature"]
    logits = torch.stack([predict_logits(m, test.images, ctx.device) for m in models])  # (m, n, c)
    labels = torch.as_tensor(test.labels).long()

    def sa_in_batches(size: int) -> torch.Tensor:
        # a label-routed SA is asked for the class the generator targeted; here that is the true label
        return torch.cat([sa(logits[:, i:i + size], labels[i:i + size] if sa.needs_labels else None)
                          for i in range(0, len(labels), size)])

    name = f"SA, {recipe.sa_space} space, routed by {recipe.sa_route} (FedHydra)"
    teachers = {"mean of the clients' logits (DENSE, FedDF)": logits.mean(dim=0),
                f"{name}, batch {batch}: what its student is taught": sa_in_batches(batch),
                f"{name}, batch {REPORTED_BATCH}: its recorded teacher accuracy": sa_in_batches(REPORTED_BATCH)}
    return {"run": run_dir.name, "batch": batch, "temperature": temperature, "test_images": len(test),
            "teachers": {name: teacher_stats(z, labels, temperature) for name, z in teachers.items()},
            "clients": [(f"p{up.partition_id} {up.arch}", teacher_stats(logits[k], labels, temperature))
                        for k, up in enumerate(uploads)]}


def report(results: list[dict]) -> str:
    lines = ["# Teacher sharpness: FedHydra's SA against the clients' mean logits", "",
             f"`python -m experiments.teacher_sharpness RUN ...` (code {code_version()}). Per run folder: its test "
             "images; entropy (nats) and top probability of the softmax at its "
             "distillation temperature; logit spread = a sample's logits' std over the classes, averaged.", ""]
    for r in results:
        lines += [f"## {r['run']} ({r['test_images']} test images, batch {r['batch']}, temperature {r['temperature']})",
                  "", "| teacher | accuracy (%) | entropy | top probability | logit spread |", "|---|---|---|---|---|"]
        rows = list(r["teachers"].items()) + [(f"client {name}", s) for name, s in r["clients"]]
        for name, s in rows:
            lines.append(f"| {name} | {100 * s['accuracy']:.1f} | {s['entropy']:.3f} | {s['top_probability']:.3f} "
                         f"| {s['logit_spread']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="FedHydra run folders with uploads/ and stratification.json")
    parser.add_argument("--data-dir", default=None, help="where the test set is (default: the run's data-dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for run in args.runs:
        if not (run / "uploads").is_dir() or not (run / "stratification.json").is_file():
            parser.error(f"{run}: no uploads/ or stratification.json (a FedHydra run that kept its uploads)")
    text = report([measure(run, args.data_dir) for run in args.runs])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
