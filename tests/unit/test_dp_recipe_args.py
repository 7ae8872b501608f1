"""benchmarks.dp_recipe refuses a bad setting before any client trains, with the config's own message."""

import pytest

from benchmarks import dp_recipe


@pytest.mark.parametrize("args, message", [
    (["--methods", "fedhydra", "--set", "fedhydra.bogus=1"], "unknown run-config key(s): fedhydra.bogus"),
    (["--methods", "fedhydra", "--set", "fedhydra.beta=-1"], "fedhydra.beta=-1.0 is out of range"),
    (["--methods", "nosuch"], "method='nosuch' is not a known method"),
    (["--seeds", "2"], "--seeds must be >= 100"),
])
def test_a_bad_setting_fails_before_any_work(args, message, capsys, monkeypatch):
    monkeypatch.setattr(dp_recipe, "fleet", lambda *a, **k: pytest.fail("a client trained"))
    with pytest.raises(SystemExit) as exit_info:
        dp_recipe.main(["--recipes", "e20", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _served(seed, settings, accuracy, teacher, at, version="abc1234"):
    record = {"accuracy_final": accuracy, "teacher_accuracy": teacher, "recorded_at": at}
    return ("e20", 8.0, seed, "fedhydra", tuple(settings.items()), version), record


def test_a_setting_is_compared_with_the_default_on_its_own_fleet():
    # seed 100's fleet was trained again (teacher 0.95 -> 0.96) and the default served on it later: the setting
    # that ran on the first fleet is compared with the first default (0.80 - 0.90), not the latest (0.80 - 0.92)
    served = dict([_served(100, {}, 0.90, 0.95, "1"), _served(100, {"fedhydra.beta": 0}, 0.80, 0.95, "2"),
                   _served(100, {}, 0.92, 0.96, "3", "def5678"),
                   _served(101, {}, 0.50, 0.90, "1"), _served(101, {"fedhydra.beta": 0}, 0.56, 0.90, "2")])
    lines = dp_recipe.settings_summary(served)
    assert lines[-2] == "| e20 | fedhydra | – (default) | 92.00 | 50.00 | – |"
    # mean of -10 and +6 points over the two seeds
    assert lines[-1] == "| e20 | fedhydra | fedhydra.beta=0 | 80.00 | 56.00 | -2.00 (2) |"
