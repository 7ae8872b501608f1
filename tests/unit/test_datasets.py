import gzip

import numpy as np
import pytest

from oneshot_fl.data.datasets import DatasetNotFoundError, load_split, read_idx, read_svhn_mat


def write_svhn_mat(path, n, seed=0):
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)  # SVHN: 10 means digit 0
    savemat(path, {"X": x, "y": y})
    return x, y


def test_svhn_loader_reads_the_real_mat_format(tmp_path):
    (tmp_path / "svhn").mkdir()
    x, y = write_svhn_mat(tmp_path / "svhn" / "train_32x32.mat", 37)
    write_svhn_mat(tmp_path / "svhn" / "test_32x32.mat", 11, seed=1)
    split = load_split("svhn", "train", str(tmp_path), False)
    assert split.images.shape == (37, 32, 32, 3) and split.images.dtype == np.uint8
    assert np.array_equal(split.images[5], x[:, :, :, 5])
    expected = y.reshape(-1).astype(np.int64)
    expected[expected == 10] = 0
    assert np.array_equal(split.labels, expected)
    assert split.labels.min() >= 0 and split.labels.max() <= 9
    assert len(load_split("svhn", "test", str(tmp_path), False)) == 11


def test_svhn_torchvision_layout_is_found_too(tmp_path):
    write_svhn_mat(tmp_path / "test_32x32.mat", 4)
    assert len(load_split("svhn", "test", str(tmp_path), False)) == 4


def test_bad_svhn_file_is_a_clear_error(tmp_path):
    from scipy.io import savemat

    savemat(tmp_path / "bad.mat", {"Z": np.zeros(3)})
    with pytest.raises(ValueError, match="not an SVHN"):
        read_svhn_mat(tmp_path / "bad.mat")


@pytest.mark.parametrize("dataset, expected", [
    ("mnist", "mnist/train-images-idx3-ubyte.gz"),
    ("fmnist", "fashion-mnist/train-images-idx3-ubyte.gz"),
    ("cifar10", "cifar10/cifar10-jpeg.tar.gz"),
    ("svhn", "svhn/train_32x32.mat"),
])
def test_missing_files_name_the_exact_files_and_folder(tmp_path, dataset, expected):
    with pytest.raises(DatasetNotFoundError) as err:
        load_split(dataset, "train", str(tmp_path / "empty"), False)
    assert str(tmp_path / "empty" / expected) in str(err.value)
    assert "data-dir" in str(err.value)


def test_idx_reader_handles_plain_and_gzip(tmp_path):
    header = (0x803).to_bytes(4, "big") + (2).to_bytes(4, "big") + (2).to_bytes(4, "big") + (3).to_bytes(4, "big")
    body = bytes(range(12))
    (tmp_path / "a").write_bytes(header + body)
    with gzip.open(tmp_path / "a.gz", "wb") as fh:
        fh.write(header + body)
    for name in ("a", "a.gz"):
        arr = read_idx(tmp_path / name)
        assert arr.shape == (2, 2, 3) and arr.reshape(-1).tolist() == list(range(12))
    (tmp_path / "t").write_bytes(header + body[:5])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "t")


def test_shipped_mnist_matches_its_published_facts(mnist_dir):
    train = load_split("mnist", "train", str(mnist_dir), False)
    test = load_split("mnist", "test", str(mnist_dir), False)
    assert train.images.shape == (60000, 28, 28, 1) and test.images.shape == (10000, 28, 28, 1)
    assert np.bincount(train.labels).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_svhn_reader_matches_torchvision_conversion(tmp_path, monkeypatch):
    """read_svhn_mat = torchvision's SVHN (loadmat, 10 -> 0), in (N, H, W, C); torchvision's MD5
    check is bypassed only because the file here is synthetic."""
    import torchvision.datasets as tvd

    write_svhn_mat(tmp_path / "train_32x32.mat", 23, seed=4)
    monkeypatch.setattr(tvd.SVHN, "_check_integrity", lambda self: True)
    reference = tvd.SVHN(root=str(tmp_path), split="train", download=False)
    ours = read_svhn_mat(tmp_path / "train_32x32.mat")
    assert np.array_equal(ours.images, np.transpose(reference.data, (0, 2, 3, 1)))
    assert np.array_equal(ours.labels, np.asarray(reference.labels, dtype=np.int64))


def _idx(path, magic, dims, body):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    with gzip.open(path, "wb") as fh:
        fh.write(header + bytes(body))


def _mnist_folder(root, n=6, label=3):
    (root / "mnist").mkdir(parents=True)
    for stem in ("train", "t10k"):
        _idx(root / "mnist" / f"{stem}-images-idx3-ubyte.gz", 0x803, (n, 28, 28), [0] * (n * 28 * 28))
        _idx(root / "mnist" / f"{stem}-labels-idx1-ubyte.gz", 0x801, (n,), [label] * n)
    return root / "mnist"


@pytest.mark.parametrize("damage, message", [
    (lambda f: f.write_bytes(f.read_bytes()[:40]), r"cannot be read \(EOFError"),  # truncated download
    (lambda f: f.write_bytes(b"<html>not found</html>"), r"cannot be read \(BadGzipFile"),  # an error page
    (lambda f: f.write_bytes(gzip.compress(b"garbage!")), "not an IDX uint8 file"),
    (lambda f: f.write_bytes(gzip.compress((0x803).to_bytes(4, "big") + b"\0\0")), "truncated IDX header"),
])
def test_a_damaged_idx_file_is_named_with_what_is_wrong(tmp_path, damage, message):
    from oneshot_fl.data.datasets import DatasetDamagedError

    folder = _mnist_folder(tmp_path)
    assert len(load_split("mnist", "train", str(tmp_path), False)) == 6  # intact first
    damage(folder / "train-images-idx3-ubyte.gz")
    with pytest.raises(DatasetDamagedError, match=message) as err:
        read_idx(folder / "train-images-idx3-ubyte.gz")
    assert str(folder / "train-images-idx3-ubyte.gz") in str(err.value) and "replace the file" in str(err.value)


def test_labels_outside_the_classes_or_a_count_mismatch_are_refused(tmp_path):
    from oneshot_fl.data.datasets import DatasetDamagedError

    folder = _mnist_folder(tmp_path / "a", label=10)
    with pytest.raises(DatasetDamagedError, match=r"labels outside 0..9 \(10..10\)"):
        load_split("mnist", "train", str(tmp_path / "a"), False)
    folder = _mnist_folder(tmp_path / "b")
    _idx(folder / "train-labels-idx1-ubyte.gz", 0x801, (5,), [1] * 5)
    with pytest.raises(DatasetDamagedError, match="6 images but 5 labels"):
        load_split("mnist", "train", str(tmp_path / "b"), False)


def test_a_damaged_cifar_tar_or_svhn_mat_is_named(tmp_path):
    from oneshot_fl.data.datasets import DatasetDamagedError

    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "cifar10-jpeg.tar.gz").write_bytes(b"\x1f\x8b" + b"\0" * 30)
    with pytest.raises(DatasetDamagedError, match="cifar10-jpeg.tar.gz: cannot be read"):
        load_split("cifar10", "train", str(tmp_path), False)
    (tmp_path / "svhn").mkdir()
    (tmp_path / "svhn" / "train_32x32.mat").write_bytes(b"MATLAB 5.0 but not really")
    with pytest.raises(DatasetDamagedError, match="train_32x32.mat: cannot be read"):
        load_split("svhn", "train", str(tmp_path), False)


def test_a_damaged_decoding_cache_is_rebuilt_from_its_source(tmp_path, monkeypatch):
    from oneshot_fl.data import datasets

    monkeypatch.setenv(datasets.CACHE_DIR_ENV, str(tmp_path / "cache"))
    source = tmp_path / "source.bin"
    source.write_bytes(b"x")
    built = []

    def build():
        built.append(1)
        return datasets.Split(np.zeros((2, 1), dtype=np.uint8), np.array([0, 1]))

    datasets._cached("k", source, build)
    (cache_file,) = (tmp_path / "cache").glob("k-*.npz")
    cache_file.write_bytes(b"PK\x03\x04 truncated")
    again = datasets._cached("k", source, build)
    assert len(built) == 2 and again.labels.tolist() == [0, 1]


def test_the_cli_reports_a_damaged_data_file_in_one_line(tmp_path, capsys):
    from launcher.cli import main

    folder = _mnist_folder(tmp_path)
    (folder / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b broken")
    assert main(["partition", "-c", f"dataset='mnist' data-dir='{tmp_path}' download=false num-clients=2 "
                                    "min-partition-size=1", "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train-labels-idx1-ubyte.gz: cannot be read" in err[0] and "unexpected" not in err[0]
