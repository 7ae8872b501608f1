import pytest

from oneshot_fl.config import ConfigError, default_run_config, from_run_config, merge_overrides
from oneshot_fl.presets import PRESET_KEYS, PRESETS


def cfg_with(**overrides):
    return from_run_config(merge_overrides({k.replace("_", "-"): v for k, v in overrides.items()}))


def test_defaults_parse_and_preset_fills_zero_knobs():
    cfg = cfg_with()
    assert cfg.preset == "cpu"
    assert cfg.local.epochs == PRESETS["cpu"]["local.epochs"]
    assert cfg.distill.synth_batch == PRESETS["cpu"]["distill.synth-batch"]
    assert cfg.model == "cnn2"  # MNIST default


def test_explicit_value_wins_over_preset():
    cfg = from_run_config(merge_overrides({"preset": "paper", "local.epochs": 3}))
    assert cfg.local.epochs == 3
    assert cfg.distill.epochs == PRESETS["paper"]["distill.epochs"]


def test_every_preset_governs_the_same_keys_and_pyproject_leaves_them_to_it():
    defaults = default_run_config()
    for name, values in PRESETS.items():
        assert set(values) == PRESET_KEYS, name
    for key in PRESET_KEYS:
        assert defaults[key] in (0, 0.0), f"{key} must default to 0 (= preset) in pyproject.toml"


@pytest.mark.parametrize("key, value, fragment", [
    ("dataset", "imagenet", "'mnist', 'fmnist'"),
    ("partition", "shards", "'niid-bench'"),
    ("preset", "huge", "smoke"),
    ("model", "vit", "resnet18"),
    ("client-models", "cnn2,nope", "googlenet"),
    ("alpha", 0.0, "must be > 0"),
    ("alpha", -1.0, "must be > 0"),
    ("num-clients", 0, ">= 1"),
    ("local.epochs", -3, ">= 1"),
    ("local.lr", 0.0 - 1.0, "> 0"),
    ("distill.pool", "bucket", "capped"),
    ("seed", "abc", "integer"),
    ("min-clients", 9, "more than num-clients"),
    ("client-models", "cnn2,lenet,cnn2,cnn2,cnn2,cnn2", "6 architectures for num-clients=5"),
    ("num-clients", 70000, "60000 training images cannot give num-clients=70000 clients"),
    # TOML reads nan and inf as floats; nan passes every range comparison
    ("alpha", float("nan"), "expected a finite number"),
    ("seed", float("nan"), "integer"),
    ("num-clients", float("inf"), "integer"),
    # TOML and Flower's ConfigRecord hold 64-bit integers: a larger seed would fail inside Flower
    ("seed", 2**63, "integer within 64 bits"),
    ("local.epochs", 2**64, "integer within 64 bits"),
    # partition p takes entry p mod len: 'cnn2,,lenet' read as two entries would reassign every client
    ("client-models", "cnn2,,lenet", "has an empty entry"),
    ("client-models", "cnn2,lenet,", "has an empty entry"),
    ("node-archs", "cnn2,,lenet", "has an empty entry"),
])
def test_bad_values_fail_with_a_message_that_lists_what_is_allowed(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        from_run_config(merge_overrides({key: value}))
    assert fragment in str(err.value)
    assert key in str(err.value) or key == "min-clients"


@pytest.mark.parametrize("name", ["../elsewhere", "/tmp/abs", "a/b", "a\\b", ".", "..", " padded", "two\nlines",
                                  "x" * 256])
def test_a_run_name_that_is_not_one_folder_name_is_refused(name):
    # output-dir / run-name: a separator, "..", or an absolute name would put the run outside output-dir
    with pytest.raises(ConfigError, match="run-name=.*expected a folder name"):
        cfg_with(run_name=name)


@pytest.mark.parametrize("name", ["", "a b", "it's-1.2", "é" * 127])
def test_an_ordinary_run_name_passes_unchanged(name):
    assert cfg_with(run_name=name).run_name == name


def test_unknown_key_is_rejected_with_the_known_keys():
    with pytest.raises(ConfigError, match="unknown run-config key.*did you mean local.epochs"):
        merge_overrides({"local.epoch": 3})
    with pytest.raises(ConfigError) as err:  # nothing close: the section's keys are listed
        merge_overrides({"ot.zzzzzz": 1})
    assert "ot.reference" in str(err.value) and "ot.solver" in str(err.value)


@pytest.mark.parametrize("key, value", [("fedhydra.lambda-adv", float("inf")),
                                        ("fedhydra.beta", float("nan"))])
def test_a_method_knob_must_be_finite(key, value):
    from strategies import check_method_params

    cfg = from_run_config(merge_overrides({"method": "fedhydra", key: value}))
    with pytest.raises(ConfigError, match=f"{key}=(nan|inf): expected a finite number"):
        check_method_params(cfg)


@pytest.mark.parametrize("key, value", [("fedhydra.peer-check", "off"), ("fedhydra.sa-space", "logits"),
                                        ("fedhydra.ms-batched", "yes"), ("fedhydra.bn-cap", 0.0),
                                        ("fedhydra.adv-mask", "none")])
def test_a_retired_fedhydra_key_is_refused_by_name_and_points_at_the_decisions(key, value):
    """A retired option is not an unknown key with a "did you mean": it is named, with where to read why it went,
    whatever its value (even the value the recipe itself uses)."""
    from oneshot_fl.config import RETIRED_KEYS

    assert key in RETIRED_KEYS and key not in default_run_config()
    with pytest.raises(ConfigError) as err:
        merge_overrides({"method": "fedhydra", key: value})
    message = str(err.value)
    assert message.startswith(f"{key}: retired") and "docs/decisions.md" in message and "\n" not in message
    assert "unknown run-config key" not in message
    with pytest.raises(ConfigError, match=r"^fedhydra\.peer-check, fedhydra\.sa-space: retired"):  # every one named
        merge_overrides({"fedhydra.sa-space": "logits", "fedhydra.peer-check": "off", "fedhydra.mode": "paper"})


def test_every_retired_key_is_refused_and_no_current_key_is_retired():
    from oneshot_fl.config import RETIRED_KEYS

    assert not set(RETIRED_KEYS) & set(default_run_config())
    assert sorted(k for k in default_run_config() if k.startswith("fedhydra.")) == [
        "fedhydra.beta", "fedhydra.lambda-adv", "fedhydra.lambda-bn", "fedhydra.mode", "fedhydra.ms-steps"]
    for key in RETIRED_KEYS:
        with pytest.raises(ConfigError, match=rf"^{key}: retired.*docs/decisions\.md"):
            merge_overrides({key: 1})


def test_a_bad_value_in_another_methods_section_fails_too():
    from strategies import check_method_params

    cfg = from_run_config(merge_overrides({"method": "fedhydra", "fedmho.keep-ratio": 2.0}))
    with pytest.raises(ConfigError, match="fedmho.keep-ratio"):
        check_method_params(cfg)


def test_heterogeneous_fleet_needs_a_server_model():
    with pytest.raises(ConfigError, match="server-model"):
        cfg_with(client_models="cnn2,lenet")
    cfg = cfg_with(client_models="cnn2,lenet", server_model="resnet18")
    assert cfg.arch_for(0) == "cnn2" and cfg.arch_for(3) == "lenet"
    assert cfg.arch_for(0, {"arch": "resnet18"}) == "resnet18"  # node config wins
    assert cfg.global_arch == "resnet18"


def test_unknown_method_is_rejected_before_any_work():
    from strategies import build_strategy

    cfg = cfg_with(method="fedmagic")
    with pytest.raises(ConfigError, match="fedmagic.*fedavg"):
        build_strategy(cfg)


def test_a_method_typo_gets_the_nearest_names():
    from strategies import strategy_class

    with pytest.raises(ConfigError, match=r"method='fedhydraa' is not a known method \(did you mean 'fedhydra'\?\)"):
        strategy_class("fedhydraa")
    with pytest.raises(ConfigError) as nothing_close:
        strategy_class("xyz")
    assert "did you mean" not in str(nothing_close.value)


def test_architecture_lists_take_spaces_and_the_largest_64_bit_seed():
    cfg = from_run_config(merge_overrides({"client-models": " cnn2 , lenet", "server-model": "cnn2",
                                           "seed": 2**63 - 1}))
    assert cfg.client_models == ("cnn2", "lenet") and cfg.seed == 2**63 - 1
