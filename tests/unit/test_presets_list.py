"""`oneshot-fl list presets`: per preset its description and every key it sets, placeholders spelled out; the
run config's default preset marked."""

from launcher import cli
from oneshot_fl.config import default_run_config
from oneshot_fl.presets import PRESET_DESCRIPTIONS, PRESETS

DEFAULT = default_run_config()["preset"]


def head(name: str) -> str:
    return f"{name}{' (default)' if name == DEFAULT else ''}  {PRESET_DESCRIPTIONS[name]}"


def listing(capsys) -> list[str]:
    assert cli.main(["list", "presets"]) == 0
    return capsys.readouterr().out.splitlines()


def test_every_preset_lists_its_description_and_every_key_it_sets(capsys):
    lines = listing(capsys)
    heads = [i for i, line in enumerate(lines) if not line.startswith("  ")]
    assert [lines[i].split()[0] for i in heads] == list(PRESETS)
    for i, name in zip(heads, PRESETS):
        assert lines[i] == head(name)
        block = lines[i + 1:i + 1 + len(PRESETS[name])]
        assert [line.split(":")[0].strip() for line in block] == list(PRESETS[name])


def test_values_and_per_dataset_tables_are_spelled_out(capsys):
    lines = listing(capsys)
    cpu = lines[lines.index(head("cpu")):]
    assert "  local.epochs: 10" in cpu and "  distill.epochs: 30" in cpu and "  local.lr: 0.01" in cpu
    assert "  cvae.epochs: per dataset (mnist 30, fmnist 40, svhn 40, cifar10 40)" in cpu
    assert "  fedmho.epochs: per dataset (mnist 10, fmnist 20, svhn 20, cifar10 20)" in cpu
    assert "  local.max-samples: no cap (-1)" in cpu and "  eval.test-samples: the whole test set (-1)" in cpu
    assert "  cvae.epochs: 1" in lines[:lines.index(head("cpu"))]  # smoke


def test_the_default_preset_is_marked_and_only_it(capsys):
    marked = [line.split()[0] for line in listing(capsys) if "(default)" in line]
    assert DEFAULT == "cpu" and marked == ["cpu"]
