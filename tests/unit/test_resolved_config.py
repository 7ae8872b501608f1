"""The config a run records (result.json `config`, the log) holds the values it used, never a placeholder."""

import json
import logging
import re

import numpy as np
import pytest

from oneshot_fl.config import (PLACEHOLDER_KEYS, PROJECT_ROOT, from_run_config, merge_overrides, placeholder_changes,
                               resolved_config)
from oneshot_fl.presets import PRESETS

PLACEHOLDERS = (0, -1, "", "auto")  # 0 = preset / default, -1 = per dataset / no cap, "" = default


def resolved(threads=1, **overrides):
    """As the launcher runs it: threads pinned (launcher.launch.pin_run_config)."""
    cfg = from_run_config(merge_overrides({"threads": threads, **overrides}))
    return cfg, *resolved_config(cfg, run_dir=PROJECT_ROOT / "runs" / "r1", test_samples=10000, server_threads=2)


@pytest.mark.parametrize("preset", ["smoke", "cpu"])
def test_the_recorded_config_of_smoke_and_cpu_holds_no_placeholder(preset):
    cfg, config, unresolved = resolved(preset=preset)
    assert not unresolved
    left = {key: config[key] for key in PLACEHOLDER_KEYS if config[key] in PLACEHOLDERS}
    assert not left, f"placeholders left in the recorded config: {left}"
    assert not [k for k, v in config.items() if v in (-1, "auto") and not isinstance(v, bool)]
    # every key the preset sets is in the recorded config with the preset's value, or what it stands for
    assert config["distill.epochs"] == PRESETS[preset]["distill.epochs"]
    assert config["model"] == config["server-model"] == "cnn2" and config["min-clients"] == 5
    assert config["run-name"] == "r1" and config["output-dir"] == str(PROJECT_ROOT / "runs")
    assert config["cvae.arch"] == "cvae-mlp" and config["cvae.latent-dim"] == 2
    assert config["cvae.lr"] == 5e-2 and config["fedmho.lr"] == 1e-5 and config["fedcvae.lr"] == 1e-5  # MNIST
    assert config["fedmho.constrained-clients"] == 2  # K // 2
    assert config["server-threads"] == 2
    assert cfg.flat["local.epochs"] == PRESETS[preset]["local.epochs"]  # the run's own flat config is untouched


def test_cpu_preset_values_are_the_presets_and_the_papers_per_dataset_values():
    _, config, _ = resolved(preset="cpu")
    assert config["distill.epochs"] == 30 and config["local.epochs"] == 10 and config["local.lr"] == 0.01
    assert config["cvae.epochs"] == 30 and config["fedmho.epochs"] == 10 and config["fedcvae.epochs"] == 10  # MNIST
    assert config["local.max-samples"] == 60000  # no cap: a cap no MNIST shard can reach
    assert config["eval.test-samples"] == 10000  # the whole test set, as evaluated
    _, fashion, _ = resolved(preset="cpu", dataset="fmnist")
    assert fashion["cvae.epochs"] == 40 and fashion["fedmho.epochs"] == 20 and fashion["fedmho.lr"] == 5e-4
    _, large, _ = resolved(preset="cpu", **{"cvae.arch": "cvae-large"})
    assert large["cvae.lr"] == 1e-3  # CVAE-large's own learning rate, whatever the dataset
    assert config["cvae.batch-size"] == 64  # the FedMHO code's
    _, private, _ = resolved(preset="cpu", model="cnn2-gn", **{"local.dp.epsilon": 8.0})
    from oneshot_fl.config import PRIVATE_CVAE  # a DP decoder client's recipe, as its client resolves it

    assert (private["cvae.lr"], private["cvae.batch-size"]) == (PRIVATE_CVAE["lr"], PRIVATE_CVAE["batch_size"])


def test_smoke_preset_values():
    _, config, _ = resolved(preset="smoke")
    assert config["local.epochs"] == 1 and config["distill.epochs"] == 4 and config["cvae.epochs"] == 1
    assert config["local.max-samples"] == 512 and config["eval.test-samples"] == 1000


def test_explicit_values_are_recorded_as_given_and_config_requested_names_only_placeholders():
    cfg, config, _ = resolved(preset="cpu", **{"local.epochs": 3, "fedmho.epochs": 7, "fedmho.lr": 0.1})
    assert (config["local.epochs"], config["fedmho.epochs"], config["fedmho.lr"]) == (3, 7, 0.1)
    requested = placeholder_changes(cfg, config)
    assert requested["distill.epochs"] == 0 and requested["cvae.lr"] == 0.0 and requested["run-name"] == ""
    assert requested["fedmho.constrained-clients"] == -1
    assert not {"local.epochs", "fedmho.epochs", "fedmho.lr", "threads", "seed"} & set(requested)


def test_what_the_server_cannot_resolve_is_named_with_the_reason():
    cfg, config, unresolved = resolved(threads=0)
    assert config["threads"] == 0 and "own node's cores" in unresolved["threads"]
    config, unresolved = resolved_config(cfg, threads=3)  # a replay: `threads` is its own torch thread count
    assert config["threads"] == 3 and "threads" not in unresolved
    cfg = from_run_config(merge_overrides({"preset": "cpu"}))
    _, unresolved = resolved_config(cfg)
    assert set(unresolved) == {"threads", "server-threads", "eval.test-samples", "run-name"}


def pyproject_placeholder_keys() -> set[str]:
    """Keys of [tool.flwr.app.config] whose comment gives a placeholder meaning: '0 = ...', '-1 = ...', '"" = ...'."""
    keys, section, last = set(), None, None
    for line in (PROJECT_ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("["):
            head = line.strip("[]")
            section = head.removeprefix("tool.flwr.app.config").lstrip(".") if head.startswith(
                "tool.flwr.app.config") else None
            continue
        if section is None:
            continue
        match = re.match(r"([\w-]+)\s*=\s*[^#]*#(.*)", line)
        comment = line.split("#", 1)[1] if "#" in line else ""
        if match:
            last = f"{section}.{match[1]}" if section else match[1]
        if last and re.search(r'(^|[\s(;,])(0|-1|"") = ', comment):
            keys.add(last)
    return keys


# zeros that are settings, not placeholders: nothing to resolve
REAL_ZEROS = {"feddf.val-fraction", "feddf.patience", "coboosting.ods-eps", "coboosting.grad-clip"}


def test_every_placeholder_pyproject_documents_is_resolved():
    """A new knob documented as '0 = ...' / '-1 = ...' / '"" = ...' fails here until resolved_config handles it."""
    documented = pyproject_placeholder_keys() - REAL_ZEROS
    assert documented == PLACEHOLDER_KEYS, (sorted(documented - PLACEHOLDER_KEYS),
                                            sorted(PLACEHOLDER_KEYS - documented))


def test_result_json_and_the_log_carry_the_resolved_values(tmp_path, mnist_dir, caplog):
    from oneshot_fl.models.registry import build
    from oneshot_fl.uploads import encode
    from strategies import build_strategy
    from tests.conftest import reply_message

    cfg = from_run_config(merge_overrides({"method": "fedavg", "preset": "smoke", "num-clients": 2}))
    strategy = build_strategy(cfg, run_dir=tmp_path / "run")
    replies = [reply_message(encode("classifier", "cnn2", build("cnn2", (1, 28, 28), 10, seed=0).state_dict(),
                                    np.full(10, 5), node - 1, {"local-test-accuracy": 0.5}), src_node_id=node)
               for node in (1, 2)]
    strategy._sent = [1, 2]
    with caplog.at_level(logging.INFO, logger="oneshot_fl.strategy"):
        strategy.summary()
        strategy.aggregate_train(1, replies)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    config = result["config"]
    assert config["local.epochs"] == 1 and config["distill.epochs"] == 4 and config["cvae.epochs"] == 1
    assert config["fedmho.lr"] == 1e-5 and config["eval.test-samples"] == 1000 and config["run-name"] == "run"
    assert result["config_requested"]["local.epochs"] == 0 and result["config_requested"]["fedmho.lr"] == 0.0
    assert "threads" in result["config_unresolved"]  # the run config's threads=0: the clients' business
    assert not {k: config[k] for k in PLACEHOLDER_KEYS - {"threads"} if config[k] in PLACEHOLDERS}
    text = caplog.text
    assert "local.epochs 0 -> 1" in text and "cvae.lr 0.0 -> 0.05" in text and "fedmho.epochs 0 -> 1" in text
    assert "fedavg params: weighting='num-examples'" in text


@pytest.mark.parametrize("overrides, warned", [
    ({"local.dp.epsilon": 8.0, "local.epochs": 3}, True),  # ignored: DP clients train local.dp.epochs
    ({"local.dp.epsilon": 8.0, "local.epochs": 3, "local.dp.epochs": 4}, False),  # the DP passes are named
    ({"local.dp.epsilon": 8.0}, False),
    ({"local.epochs": 3}, False),  # no DP: local.epochs is what the clients train
])
def test_a_dp_run_says_when_local_epochs_moves_nothing(tmp_path, mnist_dir, caplog, overrides, warned):
    from strategies import build_strategy

    cfg = from_run_config(merge_overrides({"method": "fedavg", "preset": "smoke", "num-clients": 2,
                                           "model": "cnn2-gn", **overrides}))
    with caplog.at_level(logging.INFO, logger="oneshot_fl.strategy"):
        build_strategy(cfg, run_dir=tmp_path / "run").log_config()
        replay = build_strategy(cfg, run_dir=tmp_path / "replay")
        replay.cfg.flat["replayed-from"] = str(tmp_path / "run" / "uploads")  # as launcher.replay marks it
        replay.log_config()  # a replay trains no client: nothing to say
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = ["local.epochs=3 does not apply to DP clients: they train local.dp.epochs=1 passes (preset smoke); "
                "set local.dp.epochs to change that"]  # the smoke preset's one DP pass
    assert warnings == (expected if warned else [])
