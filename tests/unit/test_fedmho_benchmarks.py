"""The FedMHO table's fleets and server settings (no training)."""

from benchmarks.fedmho_table import fedcvae_server
from benchmarks.fleets import FEDMHO_CLIENT_DEFAULTS, fedmho_fleet
from oneshot_fl.config import merge_overrides


def test_the_fedcvae_fleet_trains_cvae_large_at_paper_scale_only():
    paper = fedmho_fleet("fedcvae", "mnist", 0.5, 0, "paper", "vgg9", {})
    assert paper["cvae.arch"] == "cvae-large"  # FedMHO Table I: FEDCVAE = CVAE-large on every client
    assert "cvae.arch" not in fedmho_fleet("fedmho-md", "mnist", 0.5, 0, "paper", "vgg9", {})
    cpu = fedmho_fleet("fedcvae", "mnist", 0.5, 0, "cpu", "vgg9-small", dict(FEDMHO_CLIENT_DEFAULTS))
    assert "cvae.arch" not in cpu  # CVAE-small (the cpu records keep their keys)


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
