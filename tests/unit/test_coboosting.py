"""Co-Boosting's pieces by hand: the ensemble weight update, ODS, and the KD-loop options it uses."""

import torch
import torch.nn.functional as F

from oneshot_fl.engine.distill import DistillSettings, distill
from oneshot_fl.engine.ods import ods_perturb
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.reweight import reweight_pass, reweight_step
from oneshot_fl.engine.synthesizer import SynthBatch


def test_weight_update_by_hand():
    # client 1 votes class 0, client 2 class 1; the target is 0. With w = (0.5, 0.5):
    # ensemble = (1, 1), p = (.5, .5); dCE/dw_k = (p - y) . (f_k - ensemble) / sum(w) = -1 and +1
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]])  # (m=2, b=1, c=2)
    labels = torch.tensor([0])
    w = torch.tensor([0.5, 0.5])
    w_var = w.clone().requires_grad_(True)
    F.cross_entropy((w_var[:, None, None] * logits).sum(0) / w_var.sum(), labels).backward()
    assert torch.allclose(w_var.grad, torch.tensor([-1.0, 1.0]))
    assert torch.allclose(reweight_step(w, w, logits, labels, step=0.01), torch.tensor([0.51, 0.49]))


def test_weight_update_clamps_to_unit_interval_and_to_one_around_the_pass_start():
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]])
    labels = torch.tensor([0])
    # a huge step: +-1 around the start (0.5 -> [-0.5, 1.5]), then [0, 1]
    assert torch.allclose(reweight_step(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]), logits, labels, 5.0),
                          torch.tensor([1.0, 0.0]))
    # one pass = one signed step per batch; the clamp is relative to the pass's start
    batches = [(logits, labels)] * 3
    assert torch.allclose(reweight_pass(torch.tensor([0.5, 0.5]), batches, 0.1), torch.tensor([0.8, 0.2]))


def test_ods_takes_one_signed_step_along_a_random_output_direction():
    weight = torch.tensor([[1.0, -2.0], [0.5, 0.0]])  # a linear "teacher": logits = x @ W^T
    teacher = lambda x: x @ weight.T  # noqa: E731
    x = torch.tensor([[0.2, 0.4]])
    rng = torch.Generator().manual_seed(3)
    out = ods_perturb(teacher, x, eps=0.1, rng=rng, temperature=4.0)
    # redo by hand with the same random direction
    direction = torch.rand((1, 2), generator=torch.Generator().manual_seed(3)) * 2 - 1
    x_var = x.clone().requires_grad_(True)
    (direction * F.softmax(teacher(x_var) / 4.0, dim=1)).sum().backward()
    assert torch.allclose(out, x + 0.1 * x_var.grad.sign())
    assert torch.allclose((out - x).abs(), torch.full_like(x, 0.1))


class _FixedSource:
    """A synthesizer stand-in: the same labelled batch every epoch."""

    def __init__(self, images, logits):
        self.images, self.logits = images, logits

    def synthesize(self):
        return SynthBatch(self.images, self.logits.argmax(1), self.logits, {"ce": 0.0, "bn": 0.0, "adv": 0.0})

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_cosine_schedule_weight_decay_clip_and_kd_transform_reach_the_loop():
    assert DistillSettings(epochs=4, lr=1.0, lr_schedule="cosine").lr_at(1) == 1.0
    assert abs(DistillSettings(epochs=4, lr=1.0, lr_schedule="cosine").lr_at(3) - 0.5) < 1e-12
    assert DistillSettings(epochs=4, lr=1.0).lr_at(3) == 1.0
    student = torch.nn.Linear(3, 2)
    source = _FixedSource(torch.rand(4, 3), torch.randn(4, 2))
    seen = []

    def transform(images, teacher_logits, rng):
        seen.append(images.shape)
        return images + 1.0, teacher_logits * 0

    settings = DistillSettings(epochs=2, lr=0.1, lr_schedule="cosine", weight_decay=1e-4, grad_clip=1.0)
    history, _ = distill(student, source, SyntheticPool("paper", 1, 1, 4), settings, lambda m: 0.5, seed=0,
                         kd_transform=transform)
    assert seen == [torch.Size([4, 3])] * 2 and len(history) == 2
