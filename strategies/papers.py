"""The paper behind each method (what `oneshot-fl list methods` and docs/methods/ cite)."""

from __future__ import annotations

FEDHYDRA = ("Bai, Song, Wu, Sajjanhar, Xiang, Zhou, Tao: \"FedHydra: A Unified Solution to Diverse "
            "Heterogeneities in One-Shot Federated Learning\"")
DENSE = "Zhang, Chen, Li, Lyu, Wu, Ding, Shen, Wu: \"DENSE: Data-Free One-Shot Federated Learning\", NeurIPS 2022"
COBOOSTING = ("Dai, Zhang, Li, Liu, Yang, Han: \"Enhancing One-Shot Federated Learning Through Data and "
              "Ensemble Co-Boosting\", ICLR 2024")
FEDDF = "Lin, Kong, Stich, Jaggi: \"Ensemble Distillation for Robust Model Fusion in Federated Learning\", NeurIPS 2020"
FEDAVG = ("McMahan, Moore, Ramage, Hampson, Agüera y Arcas: \"Communication-Efficient Learning of Deep Networks "
          "from Decentralized Data\", AISTATS 2017")
OT = "Singh, Jaggi: \"Model Fusion via Optimal Transport\", NeurIPS 2020"
FEDMHO = ("Yao, Shi, Liu, Xu: \"FedMHO: Heterogeneous One-Shot Federated Learning Towards Resource-Constrained "
          "Edge Devices\"")
FEDCVAE = ("Heinbaugh, Luz-Ricca, Shao: \"Data-Free One-Shot Federated Learning Under Very High Statistical "
           "Heterogeneity\", ICLR 2023")
FEDLMD = "Lu, Li, Bao, Wang, Qian, Ge: \"Federated Learning with Label-Masking Distillation\", ACM MM 2023"

# method -> (what the server does, the paper)
METHOD_PAPERS: dict[str, tuple[str, str]] = {
    "fedhydra": ("model stratification + stratified aggregation, then data-free distillation", FEDHYDRA),
    "dense": ("data-free distillation from the mean-logit ensemble", DENSE),
    "coboosting": ("DENSE + hard samples, re-weighted ensemble, ODS-perturbed KD", COBOOSTING),
    "feddf": ("ensemble distillation into a FedAvg-initialised student", FEDDF),
    "fedavg": ("sample-weighted parameter average", FEDAVG),
    "ot": ("optimal-transport neuron alignment, then average", OT),
    "fedmho": ("classifier average trained on CVAE-decoder samples (CE)", FEDMHO),
    "fedmho-md": ("fedmho + KL to the classifier clients", FEDMHO),
    "fedmho-sd": ("fedmho + KL to the start model", FEDMHO),
    "fedcvae": ("fresh global model trained on every client's decoder samples", FEDCVAE),
}
# client-side option (local.loss = fedlmd | fedlmd-tf)
CLIENT_PAPERS = {"fedlmd": ("label-masking distillation from the global model", FEDLMD)}
