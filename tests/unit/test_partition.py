import numpy as np
import pytest

from oneshot_fl.data.partition import (NiidBenchDirichletPartitioner, TwoClassesPerClientPartitioner,
                                       label_counts, partition_indices)
from oneshot_fl.results import classes_without_data


def fake_labels(n=6000, classes=10, seed=0):
    return np.random.default_rng(seed).integers(0, classes, size=n).astype(np.int64)


@pytest.mark.parametrize("name", ["dirichlet", "niid-bench", "2c/c", "iid"])
@pytest.mark.parametrize("k", [2, 5, 20])
def test_partitions_cover_every_sample_once(name, k):
    labels = fake_labels()
    parts = partition_indices(labels, name, k, 0.5, 10, seed=3)
    assert len(parts) == k
    joined = np.concatenate(parts)
    if name == "2c/c" and k < 5:  # only the classes of the first k pairs are handed out
        owned = np.isin(labels, [c for p in range(k) for c in TwoClassesPerClientPartitioner.classes_of(p, 10)])
        assert sorted(joined) == sorted(np.flatnonzero(owned))
    else:
        assert sorted(joined) == list(range(len(labels)))
    assert all(len(p) >= 10 for p in parts)


@pytest.mark.parametrize("name", ["dirichlet", "niid-bench", "2c/c", "iid"])
def test_same_seed_same_split_other_seed_other_split(name):
    labels = fake_labels()
    a = partition_indices(labels, name, 5, 0.3, 10, seed=1)
    b = partition_indices(labels, name, 5, 0.3, 10, seed=1)
    c = partition_indices(labels, name, 5, 0.3, 10, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_two_classes_per_client_are_disjoint_and_complete():
    labels = fake_labels()
    parts = partition_indices(labels, "2c/c", 5, 0.5, 10, seed=0)
    seen = set()
    for k, part in enumerate(parts):
        classes = set(np.unique(labels[part]).tolist())
        assert classes == {2 * k, 2 * k + 1}
        assert not classes & seen
        seen |= classes
        assert len(part) == np.isin(labels, [2 * k, 2 * k + 1]).sum()


@pytest.mark.parametrize("name", ["dirichlet", "niid-bench"])
@pytest.mark.parametrize("alpha, k", [(0.01, 5), (0.01, 20), (0.01, 100), (0.1, 100)])
def test_small_alpha_never_fails(name, alpha, k):
    labels = fake_labels(n=20000)
    parts = partition_indices(labels, name, k, alpha, 10, seed=0)
    assert sum(len(p) for p in parts) == len(labels)
    assert min(len(p) for p in parts) >= 10


def test_small_alpha_is_really_skewed():
    labels = fake_labels(n=20000)
    parts = partition_indices(labels, "niid-bench", 5, 0.01, 10, seed=0)
    dominant = [label_counts(labels[p], 10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5


def test_niid_bench_balance_cap_keeps_clients_near_n_over_k():
    labels = fake_labels(n=20000)
    part = NiidBenchDirichletPartitioner(5, alpha=0.5, min_partition_size=10, seed=0)
    parts = part._compute(labels)
    # a client stops receiving once it holds N/K, so none can exceed N/K by more than one class
    assert max(len(p) for p in parts) <= 20000 / 5 + np.bincount(labels).max()


def test_impossible_minimum_is_a_clear_error():
    labels = fake_labels(n=50)
    with pytest.raises(ValueError, match="cannot give"):
        partition_indices(labels, "niid-bench", 10, 0.01, 10, seed=0)


@pytest.mark.parametrize("alpha, k, seed", [(0.5, 5, 0), (0.3, 10, 1), (1.0, 20, 7)])
def test_dirichlet_is_flwr_datasets_output_whenever_flwr_datasets_succeeds(alpha, k, seed):
    """RobustDirichletPartitioner only differs where flwr-datasets would raise (see its docstring)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    from oneshot_fl.data.partition import label_table

    labels = fake_labels()
    ours = partition_indices(labels, "dirichlet", k, alpha, 10, seed=seed)
    upstream = DirichletPartitioner(num_partitions=k, partition_by="label", alpha=alpha, min_partition_size=10,
                                    self_balancing=True, shuffle=True, seed=seed)
    upstream.dataset = label_table(labels)
    for pid in range(k):
        assert np.array_equal(ours[pid], np.asarray(upstream.load_partition(pid)["idx"])), pid


def test_classes_without_data_are_the_all_zero_columns():
    counts = np.array([[3, 0, 0, 1], [0, 0, 2, 0]])
    assert classes_without_data(counts) == [1]
    assert classes_without_data(np.array([[1, 1]])) == []


def test_two_classes_per_client_with_fewer_than_c_over_2_clients_leaves_classes_empty():
    labels = fake_labels()
    shards = partition_indices(labels, "2c/c", 3, 0.5, 1, seed=0)
    counts = np.stack([label_counts(labels[s], 10) for s in shards])
    assert classes_without_data(counts) == [6, 7, 8, 9]


def test_the_partition_preview_names_the_classes_no_client_holds(tmp_path, mnist_dir):
    from launcher.preview import preview_partition

    text = preview_partition(["dataset='mnist' partition='2c/c' num-clients=4"], tmp_path)
    assert "classes [8, 9] are held by no client" in text
    assert "held by no client" not in preview_partition(["dataset='mnist' partition='2c/c' num-clients=5"], tmp_path)


def test_the_partition_preview_refuses_a_file_as_its_folder(tmp_path):
    from oneshot_fl.config import ConfigError
    from launcher.preview import preview_partition

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        preview_partition(["dataset='mnist'"], tmp_path / "f")
    assert (tmp_path / "f").read_text() == "x"
