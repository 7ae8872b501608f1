"""Preview a partition before a run: label-count table and flwr-datasets plot of every client."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oneshot_fl import plots
from oneshot_fl.config import ConfigError, from_run_config, merge_overrides, parse_overrides, resolve_data_dir
from oneshot_fl.data.datasets import DATASETS, load_split
from oneshot_fl.data.partition import label_counts, partition_indices
from oneshot_fl.results import classes_without_data, label_count_table
from oneshot_fl.seeding import derive_seed


def preview_partition(run_config_args: list[str], out: Path, force: bool = True) -> str:
    """Write the partition's label table and plot into `out`. With force=False (`oneshot-fl partition`
    without --force) a folder that already holds files is refused before anything is computed; otherwise
    label_counts.md / .png there are replaced and nothing else is touched."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give the folder to write the label table and plot to")
    if not force and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already exists and is not empty; pass --force to overwrite its label table "
                          "and plot, or choose another --out")
    cfg = from_run_config(merge_overrides(parse_overrides(run_config_args)))
    info = DATASETS[cfg.dataset]
    train = load_split(cfg.dataset, "train", str(resolve_data_dir(cfg)), cfg.download)
    shards = partition_indices(train.labels, cfg.partition, cfg.num_clients, cfg.alpha,
                               cfg.min_partition_size, derive_seed(cfg.seed, "partition"))
    counts = np.stack([label_counts(train.labels[s], info.num_classes) for s in shards])
    out.mkdir(parents=True, exist_ok=True)
    table = label_count_table([(f"p{k}", row) for k, row in enumerate(counts)])
    (out / "label_counts.md").write_text(table)
    plots.label_distribution(counts, out / "label_counts.png",
                             f"{cfg.dataset}, {plots.partition_text(cfg.partition, cfg.alpha)}, K={cfg.num_clients}, "
                             f"seed={cfg.seed}: label counts per client", class_names=info.class_names)
    empty = classes_without_data(counts)
    warning = (f"\nclasses {empty} are held by no client: a global model cannot learn them from this fleet"
               if empty else "")
    return table + warning + f"\nwritten to {out}/label_counts.md and label_counts.png"
