"""Named presets: values for every run-config knob whose pyproject default is 0 ("= preset").

The presets (smoke, cpu, paper) are described once, in PRESET_DESCRIPTIONS, which
`oneshot-fl list presets` prints with every key each preset sets.

A preset value may itself be a placeholder: NO_CAP (-1, no size limit) or PER_DATASET (-1, the
paper's value for the run's dataset, from oneshot_fl.paper_settings: `per_dataset_table`). The run records
what they resolved to (oneshot_fl.config.resolved_config).
"""

from __future__ import annotations

from oneshot_fl.paper_settings import PAPER_CVAE, PAPER_FUSION

NO_CAP = -1  # explicit "no limit" for the size caps below
PER_DATASET = -1  # the paper's value for the run's dataset (the method module's table, e.g. FedMHO's Table III)

PRESETS: dict[str, dict[str, int | float]] = {
    "smoke": {
        "local.epochs": 1,
        "local.dp.epochs": 1,
        "local.batch-size": 32,
        "local.lr": 0.01,
        "local.max-samples": 512,
        "eval.test-samples": 1000,
        "distill.epochs": 4,
        "distill.generator-steps": 10,
        "distill.synth-batch": 32,
        "distill.nz": 32,
        "distill.ngf": 16,
        "distill.pool-max-batches": 4,
        "distill.kd-steps": 10,
        "distill.eval-every": 1,
        "fedhydra.ms-steps": 3,
        "cvae.epochs": 1,
        "fedmho.synthetic-samples": 200,
        "fedmho.epochs": 1,
        "fedcvae.synthetic-samples": 200,
        "fedcvae.epochs": 1,
    },
    # Tuned on 2 cores (FMNIST niid-bench 0.5, 5 clients, seed 0, one uploads archive): ngf 16,
    # T_G 20 and 50 student steps per epoch ended higher than ngf 32 / T_G 30 / 20 steps
    # (DENSE 75.9% vs 67.3%, FedHydra with sa-space probs 81.5% vs 80.3%) in less time
    # (677 s vs 899 s, 606 s vs 777 s).
    "cpu": {
        "local.epochs": 10,
        # DP-SGD's clipped, noised steps learn less per pass than SGD's: on the tuning fleets (MNIST NIID-Bench 0.5,
        # epsilon 8, seeds 101/104/105) 20 passes gave FedHydra 93.54% against 92.22% at 10, for 2.3x client time
        # (benchmarks/results/archive/dp_recipe.md); the accountant spreads the same epsilon over the extra steps.
        "local.dp.epochs": 20,
        "local.batch-size": 128,
        "local.lr": 0.01,
        "local.max-samples": NO_CAP,
        "eval.test-samples": NO_CAP,
        "distill.epochs": 30,
        "distill.generator-steps": 20,
        "distill.synth-batch": 64,
        "distill.nz": 256,
        "distill.ngf": 16,
        "distill.pool-max-batches": 40,
        "distill.kd-steps": 50,
        "distill.eval-every": 5,
        "fedhydra.ms-steps": 30,
        "cvae.epochs": PER_DATASET,
        "fedmho.synthetic-samples": 6000,
        "fedmho.epochs": PER_DATASET,
        "fedcvae.synthetic-samples": 6000,
        "fedcvae.epochs": PER_DATASET,
    },
    "paper": {
        "local.epochs": 200,
        "local.dp.epochs": 200,
        "local.batch-size": 128,
        "local.lr": 0.01,
        "local.max-samples": NO_CAP,
        "eval.test-samples": NO_CAP,
        "distill.epochs": 200,
        "distill.generator-steps": 30,
        "distill.synth-batch": 256,
        "distill.nz": 256,
        "distill.ngf": 64,
        "distill.pool-max-batches": 200,
        "distill.kd-steps": 200,
        "distill.eval-every": 1,
        "fedhydra.ms-steps": 30,
        "cvae.epochs": PER_DATASET,
        "fedmho.synthetic-samples": 6000,
        "fedmho.epochs": PER_DATASET,
        "fedcvae.synthetic-samples": 6000,
        "fedcvae.epochs": PER_DATASET,
    },
}

PRESET_KEYS = frozenset(PRESETS["cpu"])

PRESET_DESCRIPTIONS = {
    "smoke": "seconds per run, for tests and CI (tiny shards, a small generator, a few epochs)",
    "cpu": "a useful run on a 2-core machine in minutes (benchmarks/ shows what it reaches)",
    "paper": "the papers' hyperparameters (E=200, B=128, SGD 0.01, T_g=200, T_G=30, b=256, ngf=64); "
             "hours on a CPU, meant for a GPU",
}

NO_CAP_MEANINGS = {"local.max-samples": "no cap", "eval.test-samples": "the whole test set"}
# Knobs whose placeholder (epochs -1 = PER_DATASET, lr 0) means the paper's value for the run's dataset.
PER_DATASET_KEYS = ("cvae.epochs", "cvae.lr", "fedmho.epochs", "fedmho.lr", "fedcvae.epochs", "fedcvae.lr")


def per_dataset_table(key: str) -> dict[str, int | float]:
    """{dataset: value} of a PER_DATASET_KEYS knob, from oneshot_fl.paper_settings: cvae.* from PAPER_CVAE
    (FedMHO Table III; cvae.lr of cvae-large is LARGE_CVAE_LR whatever the dataset), <method>.* from that
    method section's PAPER_FUSION table."""
    if key not in PER_DATASET_KEYS:
        raise KeyError(f"{key} has no per-dataset value (known: {', '.join(PER_DATASET_KEYS)})")
    section, name = key.split(".", 1)
    if section == "cvae":
        return {dataset: row[name] for dataset, row in PAPER_CVAE.items()}
    if section not in PAPER_FUSION:
        raise KeyError(f"{key}: no method section {section!r} has a per-dataset table")
    column = ("epochs", "lr").index(name)
    return {dataset: values[column] for dataset, values in PAPER_FUSION[section].items()}


def describe_value(key: str, value) -> str:
    """A preset's value as `oneshot-fl list presets` prints it: placeholders spelled out."""
    if value == PER_DATASET and key in PER_DATASET_KEYS:
        table = per_dataset_table(key)
        return "per dataset (" + ", ".join(f"{dataset} {v:g}" for dataset, v in table.items()) + ")"
    if value == NO_CAP and key in NO_CAP_MEANINGS:
        return f"{NO_CAP_MEANINGS[key]} ({NO_CAP})"
    return f"{value:g}" if isinstance(value, float) else str(value)


def preset_lines(name: str, default: str = "") -> list[str]:
    """One preset for `oneshot-fl list presets`: its name (marked when it is the `default`) and description, then
    every key it sets."""
    return [f"{name}{' (default)' if name == default else ''}  {PRESET_DESCRIPTIONS[name]}",
            *(f"  {key}: {describe_value(key, value)}" for key, value in PRESETS[name].items())]


def apply_preset(flat: dict, preset: str) -> dict:
    """Fill every preset-governed key that is still 0 ("= preset") from `preset`."""
    values = PRESETS[preset]
    out = dict(flat)
    for key, value in values.items():
        if out.get(key, 0) in (0, 0.0, ""):
            out[key] = value
    return out
