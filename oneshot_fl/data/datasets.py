"""Dataset loaders: MNIST, Fashion-MNIST, CIFAR-10, SVHN as uint8 arrays (N, H, W, C) + labels.

Each loader accepts the files in the layouts people actually have:
- the plain layout under the data directory (`mnist/train-images-idx3-ubyte.gz`, ...,
  `cifar10/cifar10-jpeg.tar.gz`, `svhn/train_32x32.mat`), as shipped in ../shared/data;
- torchvision's own layout (`MNIST/raw/`, `cifar-10-batches-py/`, `train_32x32.mat`);
and, when neither is there and `download` is on, fetches them the standard way through torchvision,
into a temporary folder first: only complete files are moved into the data directory (plain layout),
so a failed download leaves it as it was (torchvision alone would leave an empty `MNIST/raw/`).
When nothing works, the error (one line) lists the exact files expected and where.
`missing_files` / `require_files` answer "is everything a run reads there?" without reading any
file: the launcher asks before Flower starts.
Pixel values stay in [0, 1] after `to_tensor` (no mean/std normalisation: generators end in
a Sigmoid, as in the DENSE and FedHydra generators; FedHydra paper Sec. 4.1.3).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import logging
import os
import shutil
import socket
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from oneshot_fl.errors import DatasetDamagedError, DatasetNotFoundError  # noqa: F401 (raised here, named by callers)
from oneshot_fl.paths import DATA_DIR_ENV

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "ONESHOT_FL_CACHE_DIR"


# what a damaged gzip / tar / JPEG / .mat file raises while being read
_READ_ERRORS = (OSError, EOFError, ValueError, zlib.error, tarfile.TarError, zipfile.BadZipFile, LookupError)


def _damaged(path: Path, exc: BaseException) -> DatasetDamagedError:
    return DatasetDamagedError(path, f"cannot be read ({type(exc).__name__}: {exc})")


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8, (N, H, W, C)
    labels: np.ndarray  # int64, (N,)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> "Split":
        return Split(self.images[indices], self.labels[indices])


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    num_classes: int
    channels: int
    image_size: int
    default_model: str
    class_names: tuple[str, ...]
    loader: Callable[[Path, str, bool], Split]
    train_size: int  # images in the training split: no client can hold more (upload label-count bound)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, C) -> float32 (N, C, H, W) in [0, 1]."""
    return torch.from_numpy(np.array(images, copy=True)).permute(0, 3, 1, 2).float().div_(255.0)


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "oneshot-fl")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _missing(dataset: str, data_dir: Path, expected: list[Path], download_error: str | None,
             origin: str = "") -> DatasetNotFoundError:
    """One line: which files, where the data directory came from and what state it is in, how to fix it."""
    state = ("" if data_dir.is_dir() else "; it does not exist" if not data_dir.exists() else "; it is not a folder")
    also = {"mnist": " (or torchvision's MNIST/raw/)", "fmnist": " (or torchvision's FashionMNIST/raw/)",
            "cifar10": " (or torchvision's cifar-10-batches-py/ folder: data_batch_1..5, test_batch, batches.meta)",
            "svhn": " (or torchvision's <data-dir>/<split>_32x32.mat)"}.get(dataset, "")
    folder = f"{expected[0].parent.name}/" if expected else ""  # the plain layout's folder (expected_files)
    text = (f"{dataset}: dataset files not found in {data_dir} ({origin or 'data-dir'}{state}): expected "
            f"{', '.join(map(str, expected))}{also}; point data-dir (-c \"data-dir='/path/to/data'\") or "
            f"${DATA_DIR_ENV} at the folder that holds {folder or 'them'}")
    if download_error:
        text += (f"; the download through torchvision failed ({_one_line(download_error)}) and wrote nothing "
                 "there (download=false does not try)")
    else:
        text += ", or set download=true to fetch them (needs internet)"
    return DatasetNotFoundError(text)


def _one_line(text: str, limit: int = 400) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


# --- MNIST / Fashion-MNIST (IDX) ---------------------------------------------------------

_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed): uint8 images (magic 0x803) or labels (0x801)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except _READ_ERRORS as exc:
        raise _damaged(path, exc) from None
    magic = int.from_bytes(data[:4], "big")
    if magic not in (0x801, 0x803):
        raise DatasetDamagedError(path, f"not an IDX uint8 file (magic {magic:#x})")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if len(data) < 4 + 4 * ndim:
        raise DatasetDamagedError(path, f"truncated IDX header ({len(data)} bytes)")
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DatasetDamagedError(path, f"truncated IDX file ({body.size} values, header says {dims})")
    return body.reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


# dataset -> (plain folder, torchvision class whose <root>/<class>/raw/ holds the same files)
_IDX_LAYOUTS = {"mnist": ("mnist", "MNIST"), "fmnist": ("fashion-mnist", "FashionMNIST")}


def _idx_loader(dataset: str) -> Callable[[Path, str, bool], Split]:
    def load(data_dir: Path, split: str, download: bool) -> Split:
        images, labels = _files(dataset, data_dir, split, download)
        return Split(read_idx(images)[..., None], read_idx(labels).astype(np.int64))

    return load


# --- CIFAR-10 -------------------------------------------------------------------------------

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def _decode_jpeg_tar(tar_path: Path, split: str) -> Split:
    """Decode `<split>/<class>/NNNN.jpg` members of a tar into arrays, labels from the fixed class list."""
    try:
        split_data = _read_jpeg_tar(tar_path, split)
    except _READ_ERRORS as exc:  # PIL's UnidentifiedImageError is an OSError
        raise _damaged(tar_path, exc) from None
    if not len(split_data.labels):
        raise DatasetDamagedError(tar_path, f"no {split}/<class>/*.jpg members")
    return split_data


def _read_jpeg_tar(tar_path: Path, split: str) -> Split:
    from PIL import Image  # only the CIFAR-10 JPEG archive needs it

    members = []
    with tarfile.open(tar_path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and len(parts) == 3 and parts[0] == split and parts[1] in CIFAR10_CLASSES:
                members.append((parts[1], parts[2], member))
        members.sort(key=lambda m: (CIFAR10_CLASSES.index(m[0]), m[1]))  # deterministic order
        images = np.empty((len(members), 32, 32, 3), dtype=np.uint8)
        labels = np.empty(len(members), dtype=np.int64)
        for i, (cls, _, member) in enumerate(members):
            with Image.open(io.BytesIO(tar.extractfile(member).read())) as img:
                images[i] = np.asarray(img.convert("RGB"))
            labels[i] = CIFAR10_CLASSES.index(cls)
    return Split(images, labels)


def _cached(key: str, source: Path, build: Callable[[], Split]) -> Split:
    """Decode once, then memory-load a .npz from the cache dir (atomic write: actors race)."""
    stamp = f"{source.stat().st_size}-{int(source.stat().st_mtime)}"
    path = cache_dir() / f"{key}-{stamp}.npz"
    if path.is_file():
        try:
            with np.load(path) as npz:
                return Split(npz["images"], npz["labels"])
        except _READ_ERRORS as exc:  # the cache is ours to rebuild: the source decides
            log.warning("cache file %s cannot be read (%s: %s); decoding %s again", path, type(exc).__name__, exc,
                        source)
    log.info("decoding %s once into the cache %s", source, path)
    split = build()
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(tmp, images=split.images, labels=split.labels)
    os.replace(tmp, path)
    return split


# torchvision's pickled batches (cifar-10-batches-py/): it checks the MD5 of all of them, whichever split is read
CIFAR10_BATCH_FILES = (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")


def _load_cifar10(data_dir: Path, split: str, download: bool) -> Split:
    (source,) = _files("cifar10", data_dir, split, download)
    if source.is_file():  # the JPEG archive of the plain layout
        return _cached(f"cifar10-jpeg-{split}", source, lambda: _decode_jpeg_tar(source, split))
    try:
        import torchvision.datasets as tvd  # torchvision pulls in torch._dynamo (seconds): only this layout

        ds = tvd.CIFAR10(root=str(source.parent), train=(split == "train"), download=False)
    except Exception as exc:  # torchvision: "Dataset not found or corrupted" (an MD5 mismatch), unpickling errors
        raise _damaged(source, exc) from None
    return Split(np.asarray(ds.data, dtype=np.uint8), np.asarray(ds.targets, dtype=np.int64))


# --- SVHN ------------------------------------------------------------------------------------

def read_svhn_mat(path: Path) -> Split:
    """SVHN's .mat format: X (32, 32, 3, N) uint8, y (N, 1) with label 10 meaning digit 0.

    The same conversion as torchvision's `SVHN` (loadmat, label 10 -> 0), which stores the images
    as (N, 3, 32, 32); this returns (N, 32, 32, 3), the layout of every other loader here
    (tests/unit/test_datasets.py checks the two agree). torchvision's class is not used for
    reading because it only accepts `<root>/<split>_32x32.mat` whose MD5 matches the published file
    (a re-saved or converted file is refused), and it does not check the shapes.
    """
    from scipy.io import loadmat  # only SVHN needs scipy

    try:
        mat = loadmat(path)
    except _READ_ERRORS as exc:  # scipy's MatReadError is a ValueError
        raise _damaged(path, exc) from None
    if "X" not in mat or "y" not in mat:
        raise DatasetDamagedError(path, "not an SVHN .mat file (needs X and y)")
    if mat["X"].ndim != 4:
        raise DatasetDamagedError(path, f"unexpected shapes X {mat['X'].shape}, y {mat['y'].shape}")
    images = np.ascontiguousarray(np.transpose(mat["X"], (3, 0, 1, 2))).astype(np.uint8)
    labels = mat["y"].astype(np.int64).reshape(-1)
    labels[labels == 10] = 0
    if images.shape[1:] != (32, 32, 3) or len(images) != len(labels):
        raise DatasetDamagedError(path, f"unexpected shapes X {mat['X'].shape}, y {mat['y'].shape}")
    return Split(images, labels)


def _load_svhn(data_dir: Path, split: str, download: bool) -> Split:
    (path,) = _files("svhn", data_dir, split, download)
    return read_svhn_mat(path)


DATASETS: dict[str, DatasetInfo] = {
    "mnist": DatasetInfo("mnist", 10, 1, 28, "cnn2", tuple(str(i) for i in range(10)),
                         _idx_loader("mnist"), 60_000),
    "fmnist": DatasetInfo("fmnist", 10, 1, 28, "cnn2",
                          ("T-shirt", "Trouser", "Pullover", "Dress", "Coat",
                           "Sandal", "Shirt", "Sneaker", "Bag", "Boot"),
                          _idx_loader("fmnist"), 60_000),
    "cifar10": DatasetInfo("cifar10", 10, 3, 32, "cnn3-bn", CIFAR10_CLASSES, _load_cifar10, 50_000),
    "svhn": DatasetInfo("svhn", 10, 3, 32, "cnn3-bn", tuple(str(i) for i in range(10)), _load_svhn, 73_257),
}


# --- where the files are, and fetching them ---------------------------------------------------

SPLITS = ("train", "test")
DOWNLOAD_TIMEOUT_S = 60.0  # per network operation of a download (urllib waits forever by default)


def locate(dataset: str, data_dir: Path, split: str) -> list[Path] | None:
    """The file(s) the loader reads `split` of `dataset` from (first complete layout found), else None.
    Only looks: nothing is read, decoded or created."""
    if dataset in _IDX_LAYOUTS:
        plain, tv_name = _IDX_LAYOUTS[dataset]
        for folder in (data_dir / plain, data_dir / tv_name / "raw"):
            found = [_find_idx(folder, stem) for stem in _IDX_FILES[split]]
            if all(found):
                return found
        return None
    if dataset == "cifar10":
        tar_path = data_dir / "cifar10" / "cifar10-jpeg.tar.gz"
        if tar_path.is_file():
            return [tar_path]
        for root in (data_dir, data_dir / "cifar10"):
            folder = root / "cifar-10-batches-py"
            if all((folder / name).is_file() for name in CIFAR10_BATCH_FILES):
                return [folder]
        return None
    if dataset == "svhn":
        for candidate in (data_dir / "svhn" / f"{split}_32x32.mat", data_dir / f"{split}_32x32.mat"):
            if candidate.is_file():
                return [candidate]
        return None
    raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")


def expected_files(dataset: str, data_dir: Path, split: str) -> list[Path]:
    """The plain layout's files for `split` (what an error names; torchvision's layouts are accepted too)."""
    if dataset in _IDX_LAYOUTS:
        return [data_dir / _IDX_LAYOUTS[dataset][0] / f"{stem}.gz" for stem in _IDX_FILES[split]]
    if dataset == "cifar10":
        return [data_dir / "cifar10" / "cifar10-jpeg.tar.gz"]
    return [data_dir / "svhn" / f"{split}_32x32.mat"]


def missing_files(dataset: str, data_dir: Path, splits: tuple[str, ...] = SPLITS) -> list[Path]:
    """The expected files of every split that cannot be found (empty: everything is there)."""
    missing: list[Path] = []
    for split in splits:
        if locate(dataset, data_dir, split) is None:
            missing += [path for path in expected_files(dataset, data_dir, split) if path not in missing]
    return missing


def require_files(dataset: str, data_dir: Path, splits: tuple[str, ...] = SPLITS, download: bool = False,
                  origin: str = "") -> None:
    """Return once every split's files are in `data_dir`; with `download`, fetch what is missing first
    (`download_dataset`: nothing is written there unless the download succeeds). Otherwise raise
    DatasetNotFoundError, one line naming the expected files (`origin`: where data_dir came from)."""
    data_dir = Path(data_dir)
    missing = missing_files(dataset, data_dir, splits)
    if not missing:
        return
    error = None
    if download:
        try:
            download_dataset(dataset, data_dir, tuple(s for s in splits if locate(dataset, data_dir, s) is None))
        except Exception as exc:  # network errors come in many types
            error = f"{type(exc).__name__}: {exc}"
        else:
            missing = missing_files(dataset, data_dir, splits)
            if not missing:
                return
            error = "it finished but the files are still missing"
    raise _missing(dataset, data_dir, missing, error, origin)


def _files(dataset: str, data_dir: Path, split: str, download: bool) -> list[Path]:
    found = locate(dataset, data_dir, split)
    if found is None:
        require_files(dataset, data_dir, (split,), download)
        found = locate(dataset, data_dir, split)
    return found


def download_dataset(dataset: str, data_dir: Path, splits: tuple[str, ...] = SPLITS) -> None:
    """Fetch `dataset` through torchvision into a temporary folder, then move the files into `data_dir`'s
    plain layout (mnist/, fashion-mnist/, svhn/; CIFAR-10 as cifar-10-batches-py/), each by an atomic rename.

    torchvision creates its folders (MNIST/raw, ...) before it downloads; in the temporary folder a failed
    download leaves nothing behind in `data_dir`. Its prints ("Downloading ...", "Failed to download")
    are kept off stdout; a failure raises with their gist."""
    import torchvision.datasets as tvd  # torch._dynamo (seconds): only a download pays for it

    with tempfile.TemporaryDirectory(prefix="oneshot-fl-download-") as tmp:
        root = Path(tmp)
        previous = socket.getdefaulttimeout()
        if previous is None:
            socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                if dataset in _IDX_LAYOUTS:  # one download holds both splits
                    getattr(tvd, _IDX_LAYOUTS[dataset][1])(root=str(root), train=True, download=True)
                elif dataset == "cifar10":
                    tvd.CIFAR10(root=str(root), train=True, download=True)
                elif dataset == "svhn":
                    for split in splits:
                        tvd.SVHN(root=str(root), split=split, download=True)
                else:
                    raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
        finally:
            socket.setdefaulttimeout(previous)
        if dataset in _IDX_LAYOUTS:
            plain, tv_name = _IDX_LAYOUTS[dataset]
            for stems in _IDX_FILES.values():
                for stem in stems:
                    if _find_idx(data_dir / plain, stem) is None:
                        _install(root / tv_name / "raw" / f"{stem}.gz", data_dir / plain / f"{stem}.gz")
        elif dataset == "cifar10":
            for name in CIFAR10_BATCH_FILES:
                _install(root / "cifar-10-batches-py" / name, data_dir / "cifar-10-batches-py" / name)
        else:
            for split in splits:
                _install(root / f"{split}_32x32.mat", data_dir / "svhn" / f"{split}_32x32.mat")


def _install(source: Path, dest: Path) -> None:
    """Move a downloaded file into place under a temporary name, then rename it: a reader (another client
    process downloading too) sees the whole file or none."""
    if not source.is_file():
        raise FileNotFoundError(f"torchvision's download did not produce {source.name}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        shutil.move(str(source), part)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


@lru_cache(maxsize=8)
def load_split(dataset: str, split: str, data_dir: str, download: bool = True) -> Split:
    """Load (and memoise per process) one split; `data_dir` is an absolute path string."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of: {', '.join(DATASETS)}")
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r}; choose train or test")
    result = DATASETS[dataset].loader(Path(data_dir), split, download)
    where = Path(data_dir) / f"({dataset} {split} split)"
    if len(result.images) != len(result.labels):
        raise DatasetDamagedError(where, f"{len(result.images)} images but {len(result.labels)} labels")
    classes = DATASETS[dataset].num_classes
    if len(result.labels) and (int(result.labels.min()) < 0 or int(result.labels.max()) >= classes):
        raise DatasetDamagedError(where, f"labels outside 0..{classes - 1} "
                                         f"({int(result.labels.min())}..{int(result.labels.max())})")
    result.images.setflags(write=False)
    return result


def test_subset(test: Split, max_samples: int, seed: int) -> Split:
    """A fixed random subset of the test set (max_samples = -1: all of it)."""
    if max_samples < 0 or max_samples >= len(test):
        return test
    rng = np.random.default_rng(seed)
    return test.subset(np.sort(rng.choice(len(test), size=max_samples, replace=False)))
