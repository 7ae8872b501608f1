"""The papers' per-dataset settings: what a PER_DATASET placeholder of a preset (-1 epochs) or of the run
config (0 learning rate) stands for. Data only, so that presets, config, the clients and the methods read the
same table without importing each other."""

# FedMHO Table III / section 5.1.4 (CVAE-small): a constrained client's local epochs and Adam learning rate.
# CIFAR-10 is not in the paper; it gets SVHN's values.
PAPER_CVAE = {
    "mnist": {"epochs": 30, "lr": 5e-2},
    "fmnist": {"epochs": 40, "lr": 5e-2},
    "svhn": {"epochs": 40, "lr": 1e-3},
    "cifar10": {"epochs": 40, "lr": 1e-3},
}
LARGE_CVAE_LR = 1e-3  # CVAE-large (FEDCVAE baseline), FedMHO code worker_lmf.py
PAPER_BATCH = 64  # the FedMHO code's CVAE batch

# The server's training on decoder samples, by method section: dataset -> (fusion epochs, Adam learning rate).
PAPER_FUSION: dict[str, dict[str, tuple[int, float]]] = {
    # FedMHO Table III (E_g, global Adam lr); CIFAR-10 is not in the paper and gets SVHN's values.
    "fedmho": {"mnist": (10, 1e-5), "fmnist": (20, 5e-4), "svhn": (20, 5e-5), "cifar10": (20, 5e-5)},
    # FedMHO's FEDCVAE runs: global Adam lr per dataset (code); epochs as FedMHO's E_g (not stated).
    "fedcvae": {"mnist": (10, 1e-5), "fmnist": (20, 5e-4), "svhn": (20, 2e-4), "cifar10": (20, 2e-4)},
}
