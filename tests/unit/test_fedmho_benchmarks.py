"""The FedMHO benchmarks' fleets and the cause table's variants (no training)."""

import torch

from benchmarks import fedmho_causes
from benchmarks.fedmho_table import fedcvae_server
from benchmarks.fleets import FEDMHO_CLIENT_DEFAULTS as CLIENT_DEFAULTS
from benchmarks.fleets import fedmho_fleet as fleet_overrides
from oneshot_fl.config import merge_overrides
from oneshot_fl.engine.decoders import SyntheticSet


def test_the_fedcvae_fleet_trains_cvae_large_at_paper_scale_only():
    paper = fleet_overrides("fedcvae", "mnist", 0.5, 0, "paper", "vgg9", {})
    assert paper["cvae.arch"] == "cvae-large"  # FedMHO Table I: FEDCVAE = CVAE-large on every client
    assert "cvae.arch" not in fleet_overrides("fedmho-md", "mnist", 0.5, 0, "paper", "vgg9", {})
    cpu = fleet_overrides("fedcvae", "mnist", 0.5, 0, "cpu", "vgg9-small", dict(CLIENT_DEFAULTS))
    assert "cvae.arch" not in cpu  # CVAE-small (the cpu records keep their keys)


def test_every_cause_setting_is_a_valid_run_config():
    for setting in fedmho_causes.SETTINGS:
        for method in setting.methods:
            sets = {**setting.server, **(setting.fedcvae_server if method == "fedcvae" else {}),
                    **fedmho_causes.CVAE_SETTINGS[setting.cvae], **fedmho_causes.CLASSIFIER_SETTINGS[setting.clients]}
            merge_overrides(sets)  # unknown keys raise


def test_the_code_filter_keeps_a_random_r_th_of_each_class():
    cls = fedmho_causes.random_filter_class("fedmho")
    labels = torch.tensor([0] * 10 + [1] * 5)
    images = torch.arange(15, dtype=torch.float32).view(15, 1, 1, 1)
    synthesizer = cls.synthesizer_class.__new__(cls.synthesizer_class)
    synthesizer.keep_ratio, synthesizer.seed = 0.8, 4
    kept, dropped = synthesizer.filter(SyntheticSet(images, labels, torch.zeros(15, dtype=torch.long)))
    assert (kept.labels == 0).sum() == 8 and (kept.labels == 1).sum() == 4 and len(dropped) == 3
    assert set(kept.images.flatten().tolist()) | set(dropped.images.flatten().tolist()) == set(range(15))


def test_rows_rerun_on_other_tuning_seeds_are_shown_beside_seed_100_with_their_mean():
    def record(seed, accuracy, at, method="fedcvae", factor="server", setting="Adam 1e-4"):
        return {"factor": factor, "setting": setting, "method": method, "seed": seed, "accuracy_final": accuracy,
                "recorded_at": at}

    runs = [record(100, 0.8372, "1"), record(101, 0.70, "2"), record(101, 0.80, "3"),  # the later 101 wins
            record(100, 0.7233, "1", factor="baseline", setting="fedmho_table (cpu)")]
    lines = fedmho_causes.other_seeds(runs)
    assert lines[3] == "| factor | setting | method | seed 100 | seed 101 | mean |"
    # (83.72 + 80.00) / 2 = 81.86; the baseline row has no other seed, so it is not listed
    assert lines[5:] == ["| server | Adam 1e-4 | fedcvae | 83.72 | 80.00 | 81.86 (2) |"]
    assert fedmho_causes.other_seeds([record(100, 0.5, "1")]) == []  # seed 100 alone: no section


def test_fedcvae_server_cpu_budget_is_mnist_and_cpu_only():
    assert fedcvae_server("mnist", "cpu") == {"fedcvae.lr": 1e-3}
    assert fedcvae_server("fmnist", "cpu") == {} and fedcvae_server("mnist", "paper") == {}
    merge_overrides(fedcvae_server("mnist", "cpu"))  # valid run-config keys


def test_a_cached_fleet_run_with_other_client_settings_is_not_reused(tmp_path):
    """A cell's folder is named by dataset, alpha and seed only: its archive must match the requested settings."""
    import json

    from benchmarks.fedmho_table import stale_settings

    (tmp_path / "uploads").mkdir()
    run_config = {"seed": 0, "local.epochs": 10, "alpha": 0.5}
    (tmp_path / "uploads" / "manifest.json").write_text(json.dumps({"context": {"run_config": run_config},
                                                                     "uploads": []}))
    assert stale_settings(tmp_path, {"seed": 0, "alpha": 0.5, "local.epochs": 10}) == ""
    assert stale_settings(tmp_path, {"seed": 0, "local.epochs": 30}) == "local.epochs=30 (cached: 10)"
    assert stale_settings(tmp_path, {"local.lr": 0.01}) == "local.lr=0.01 (cached: None)"


def test_the_cause_tables_baseline_clients_keep_the_10_epochs_they_were_recorded_with():
    cfg = fedmho_causes.run_config("fedmho", fedmho_causes.CLASSIFIER_SETTINGS["table"])
    assert cfg.flat["local.epochs"] == 10
    assert fedmho_causes.run_config("fedmho", {}).flat["local.epochs"] == CLIENT_DEFAULTS["local.epochs"] == 30
