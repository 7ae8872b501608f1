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
        dp_recipe.main(["--recipes", "preset", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
