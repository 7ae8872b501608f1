"""A replay keeps the archived clients and run settings but takes the server methods' knobs from today's
defaults (the archive holds the training run's defaults, which may be stale) unless overridden."""

import json

import pytest

from oneshot_fl.config import ConfigError, default_run_config
from launcher.replay import replay_config


def _archive(tmp_path, run_config):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "context": {"run_config": run_config},
                                                        "uploads": []}))
    return tmp_path


def test_method_knobs_come_from_todays_defaults_and_the_run_from_the_archive(tmp_path):
    defaults = default_run_config()
    archived = {**defaults, "method": "fedavg", "dataset": "fmnist", "seed": 7, "local.epochs": 3,
                "fedhydra.mode": "paper", "distill.epochs": 11, "run-name": "old"}
    flat = replay_config(_archive(tmp_path, archived), {"method": "fedhydra"})
    assert flat["fedhydra.mode"] == defaults["fedhydra.mode"] != "paper"
    assert flat["distill.epochs"] == defaults["distill.epochs"]
    assert (flat["dataset"], flat["seed"], flat["local.epochs"], flat["method"]) == ("fmnist", 7, 3, "fedhydra")
    assert flat["run-name"] == defaults["run-name"]
    flat = replay_config(_archive(tmp_path, archived), {"fedhydra.mode": "paper"})
    assert flat["fedhydra.mode"] == "paper" and flat["method"] == "fedavg"


def test_an_archive_written_before_a_key_retired_still_replays_but_the_key_cannot_be_set(tmp_path):
    """Archives hold the run config of their day, retired FedHydra keys included: those are dropped (today's
    recipe runs), while setting one on the replay is refused by name."""
    archived = {**default_run_config(), "dataset": "mnist", "fedhydra.sa-space": "logits",
                "fedhydra.peer-check": "off", "fedhydra.ms-batched": "yes"}
    flat = replay_config(_archive(tmp_path, archived), {"method": "fedhydra"})
    assert not any(key in flat for key in ("fedhydra.sa-space", "fedhydra.peer-check", "fedhydra.ms-batched"))
    assert flat["fedhydra.mode"] == default_run_config()["fedhydra.mode"]
    with pytest.raises(ConfigError, match=r"^fedhydra\.sa-space: retired.*docs/decisions\.md"):
        replay_config(_archive(tmp_path, archived), {"method": "fedhydra", "fedhydra.sa-space": "logits"})


def test_client_side_keys_cannot_be_changed_by_a_replay(tmp_path):
    archived = {**default_run_config(), "dataset": "mnist"}
    with pytest.raises(ConfigError, match=r"^dataset='fmnist' \(archive: 'mnist'\): it describes the clients"):
        replay_config(_archive(tmp_path, archived), {"dataset": "fmnist"})
    with pytest.raises(ConfigError, match=r"dataset=.*, local.epochs=3 \(archive: 0\): these describe"):
        replay_config(_archive(tmp_path, archived), {"dataset": "fmnist", "local.epochs": 3, "seed": archived["seed"]})
