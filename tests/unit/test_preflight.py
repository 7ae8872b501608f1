"""`oneshot-fl run` checks its data before Flower starts; every subcommand's expected error is one
`oneshot-fl: error: ...` line; `partition` does not overwrite a folder silently; the simulation size
reaches Flower the way Flower reads it."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import cli
from oneshot_fl.data import datasets

ROOT = Path(__file__).resolve().parents[2]
# The run used to fail ~50 s in, after Flower and the clients had started. What shows the pre-flight stopped it
# first is structural (one error line, nothing submitted, no folder written); CPU seconds measured on a busy machine
# are no evidence either way (13-19 s beside three benchmark jobs), so only a wall backstop stays.
PREFLIGHT_WALL_S = 60.0
IDX_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def tree(root: Path) -> set[str]:
    """Every path under `root` (relative), folders included: what a command may not add to or take away."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def oneshot_fl_exe() -> list[str]:
    exe = shutil.which("oneshot-fl", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "launcher.cli"]


def offline_env() -> dict[str, str]:
    """The environment with every HTTP(S) request sent to a closed local port: a download attempt fails at
    once (connection refused), as on a machine without network, whether or not this one has a network."""
    closed = "http://127.0.0.1:9"
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "all_proxy")}
    env.update({"http_proxy": closed, "https_proxy": closed, "HTTP_PROXY": closed, "HTTPS_PROXY": closed,
                "OMP_NUM_THREADS": "1"})
    return env


def write_idx(path: Path, magic: int, dims: tuple[int, ...], values: list[int]) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as fh:
        fh.write(header + bytes(values))


def write_mnist_raw(folder: Path, n: int = 4) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for stem in ("train", "t10k"):
        write_idx(folder / f"{stem}-images-idx3-ubyte.gz", 0x803, (n, 28, 28), [0] * (n * 28 * 28))
        write_idx(folder / f"{stem}-labels-idx1-ubyte.gz", 0x801, (n,), [i % 10 for i in range(n)])


# --- 1. data pre-flight ------------------------------------------------------------------------------

@pytest.mark.parametrize("state", ["missing", "empty"])
@pytest.mark.parametrize("download", ["", " download=false"])  # "": the default, download=true, offline
def test_run_with_no_data_fails_in_seconds_in_one_line_and_touches_nothing(tmp_path, state, download):
    data = tmp_path / "data"
    if state == "empty":
        data.mkdir()
    out = tmp_path / "out"
    before = tree(tmp_path)
    start = time.monotonic()
    proc = subprocess.run([*oneshot_fl_exe(), "run", "-c", f"data-dir='{data}' output-dir='{out}'{download}"],
                          capture_output=True, text=True, env=offline_env(), cwd=tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"oneshot-fl: error: mnist: dataset files not found in {data} (data-dir")
    assert all(str(data / "mnist" / f"{stem}.gz") in lines[0] for stem in IDX_STEMS)
    assert "data-dir='/path/to/data'" in lines[0] and "$ONESHOT_FL_DATA_DIR" in lines[0]
    assert ("it does not exist" in lines[0]) == (state == "missing")
    assert ("download through torchvision failed" in lines[0]) == (download == "")
    assert "submitted" not in proc.stdout and "Traceback" not in proc.stderr  # Flower never started
    assert tree(tmp_path) == before  # no MNIST/raw, no data folder, no output folder
    assert elapsed < PREFLIGHT_WALL_S, f"{elapsed:.1f} s wall"


def _no_submit(monkeypatch):
    import launcher.launch as launch

    monkeypatch.setattr(launch, "follow_run", lambda *a, **k: pytest.fail("a run was submitted"))


class _TorchvisionMNIST:
    """Stands in for torchvision.datasets.MNIST: creates <root>/MNIST/raw as torchvision does, then
    `download` decides what it finds there."""

    download = staticmethod(lambda raw: None)

    def __init__(self, root, train=True, download=False):
        raw = Path(root) / "MNIST" / "raw"
        os.makedirs(raw, exist_ok=True)
        type(self).download(raw)


def test_a_failed_download_leaves_the_data_folder_as_it_was(tmp_path, monkeypatch, capsys):
    import torchvision.datasets as tvd

    def offline(raw):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://x/, got:\n"
                           "<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(tvd, "MNIST", type("Offline", (_TorchvisionMNIST,), {"download": staticmethod(offline)}))
    _no_submit(monkeypatch)
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_text("kept")
    before = tree(tmp_path)
    assert cli.main(["run", "-c", f"data-dir='{data}' output-dir='{tmp_path / 'out'}'"]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Temporary failure in name resolution" in err[0] and "wrote nothing there" in err[0]
    assert "downloading them through torchvision" in captured.out
    assert tree(tmp_path) == before  # torchvision's MNIST/raw went to a temporary folder, not data/


def test_a_download_lands_in_the_plain_layout_before_flower_starts(tmp_path, monkeypatch, capsys):
    import launcher.launch as launch
    import torchvision.datasets as tvd

    monkeypatch.setattr(tvd, "MNIST", type("Online", (_TorchvisionMNIST,),
                                           {"download": staticmethod(write_mnist_raw)}))
    seen = []

    def submitted(*args, **kwargs):
        seen.append(sorted(p.name for p in (tmp_path / "data" / "mnist").iterdir()))
        raise launch.RunFailed("stopped here")

    monkeypatch.setattr(launch, "follow_run", submitted)
    assert cli.main(["run", "-c", f"data-dir='{tmp_path / 'data'}' output-dir='{tmp_path / 'out'}'"]) == 1
    assert "stopped here" in capsys.readouterr().err
    assert seen == [sorted(f"{stem}.gz" for stem in IDX_STEMS)]  # there before the run was submitted
    assert {p.name for p in (tmp_path / "data").iterdir()} == {"mnist"}  # no MNIST/raw, no .part files
    assert len(datasets.load_split("mnist", "test", str(tmp_path / "data"), False)) == 4


def test_only_the_missing_split_is_named(tmp_path):
    write_mnist_raw(tmp_path / "mnist")
    for stem in IDX_STEMS[2:]:
        (tmp_path / "mnist" / f"{stem}.gz").unlink()
    assert datasets.missing_files("mnist", tmp_path, ("train",)) == []
    with pytest.raises(datasets.DatasetNotFoundError) as err:
        datasets.require_files("mnist", tmp_path, download=False, origin="data-dir")
    message = str(err.value)
    assert "\n" not in message and "t10k-images-idx3-ubyte.gz" in message and "train-images" not in message


@pytest.mark.parametrize("dataset, layout", [
    ("mnist", ["MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte.gz",
               "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte"]),
    ("fmnist", [f"fashion-mnist/{stem}.gz" for stem in IDX_STEMS]),
    ("cifar10", ["cifar10/cifar10-jpeg.tar.gz"]),
    ("cifar10", [f"cifar10/cifar-10-batches-py/{name}" for name in datasets.CIFAR10_BATCH_FILES]),
    ("svhn", ["svhn/train_32x32.mat", "test_32x32.mat"]),
])
def test_every_layout_the_loaders_read_passes_the_check(tmp_path, dataset, layout):
    for rel in layout:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    assert datasets.missing_files(dataset, tmp_path) == []
    (tmp_path / layout[-1]).unlink()
    assert datasets.missing_files(dataset, tmp_path)


def test_the_public_dataset_of_feddf_is_checked_too(tmp_path):
    from launcher.launch import check_run_config, datasets_read

    cfg = check_run_config({"method": "feddf", "feddf.source": "dataset", "feddf.public-dataset": "fmnist"})
    assert datasets_read(cfg) == {"mnist": ("train", "test"), "fmnist": ("train",)}
    assert datasets_read(check_run_config({"method": "feddf"})) == {"mnist": ("train", "test")}


def test_the_error_says_where_the_data_folder_came_from(tmp_path, monkeypatch, capsys):
    _no_submit(monkeypatch)
    monkeypatch.setenv("ONESHOT_FL_DATA_DIR", str(tmp_path / "env-data"))
    assert cli.main(["run", "-c", f"download=false output-dir='{tmp_path / 'out'}'"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"not found in {tmp_path / 'env-data'} ($ONESHOT_FL_DATA_DIR, as data-dir is unset" in err


# --- 2. one error prefix for every subcommand ---------------------------------------------------------

def test_replay_of_a_missing_archive_is_one_oneshot_fl_error_line(tmp_path, capsys):
    assert cli.main(["replay", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oneshot-fl: error: ") and "no uploads archive here" in err[0]
    assert str(tmp_path / "nowhere") in err[0] and not (tmp_path / "out").exists()


def test_run_with_a_bad_value_is_one_oneshot_fl_error_line(capsys):
    assert cli.main(["run", "-c", "num-clients=0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("oneshot-fl: error: ") and "num-clients" in err[0]


def test_list_partition_and_replay_share_the_prefix(tmp_path, capsys):
    assert cli.main(["partition", "-c", "dataset='nope'", "--out", str(tmp_path / "p")]) == 1
    assert capsys.readouterr().err.startswith("oneshot-fl: error: ")
    assert cli.main(["replay", str(tmp_path), "-c", "method=dense"]) == 1  # unquoted string
    assert capsys.readouterr().err.startswith("oneshot-fl: error: string values need quotes")


# --- 3. partition does not overwrite a folder silently ------------------------------------------------

PARTITION = ["partition", "-c", "dataset='mnist' num-clients=2 min-partition-size=1"]


def test_partition_refuses_a_non_empty_out_folder_unless_forced(tmp_path, mnist_dir, capsys):
    out = tmp_path / "preview"
    out.mkdir()
    (out / "label_counts.md").write_text("mine")
    assert cli.main([*PARTITION, "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"oneshot-fl: error: --out {out} already exists and is not empty")
    assert "--force" in err[0] and (out / "label_counts.md").read_text() == "mine"
    assert cli.main([*PARTITION, "--out", str(out), "--force"]) == 0
    assert (out / "label_counts.md").read_text() != "mine" and (out / "label_counts.png").is_file()


def test_partition_writes_into_a_new_or_empty_folder(tmp_path, mnist_dir):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new"):
        assert cli.main([*PARTITION, "--out", str(out)]) == 0
        assert (out / "label_counts.md").is_file()


# --- 4. the simulation size, as Flower reads it -------------------------------------------------------

def test_num_supernodes_reaches_flower_as_its_federation_config(monkeypatch):
    """Flower 1.41's simulation process logs "Since flwr 1.32, default simulated SuperNodes changed from
    10 to 2." on every run whatever the size (flwr/simulation/app.py); the size itself is the
    --federation-config num-supernodes that `flwr run` turns into SimulationConfig.num_supernodes."""
    import launcher.launch as launch
    from flwr.common.config import parse_config_args
    from flwr.simulation.app import _run_simulation_settings
    from flwr.supercore.utils import simulation_config_from_json

    seen = []

    def submitted(app_dir, run_config, extra_args, **kwargs):
        seen.append(extra_args)
        raise launch.RunFailed("stopped here")

    monkeypatch.setattr(launch, "follow_run", submitted)
    with pytest.raises(launch.RunFailed):
        launch.run_simulation({"num-clients": 3}, num_supernodes=4)
    (args,) = seen
    assert args[0] == "--federation-config"
    # what flwr run does with it (flwr/cli/run/run.py _parse_federation_config_overrides)
    parsed = {k.replace("-", "_"): v for k, v in parse_config_args([args[1]]).items()}
    settings = _run_simulation_settings(simulation_config_from_json(parsed))
    assert settings[0] == 4 and settings[2]["client_resources"] == {"num_cpus": 1, "num_gpus": 0.0}
