"""GeneratorSynthesizer, GeneratorLoss and balanced_labels against hand-computed values, with a stub
teacher whose logits and BN loss the tests control and a student that records how it was called.
(Fast: the mutation tests of oneshot_fl/engine/synthesizer.py run these.)"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer, balanced_labels
from oneshot_fl.models.generator import GeneratorSpec, reset_generator

C, NZ, B, LR = 3, 4, 6, 0.05
SPEC = GeneratorSpec(nz=NZ, ngf=2, image_size=4, channels=1)  # images (b, 1, 4, 4)
D = 16  # pixels per image
CPU = torch.device("cpu")


class StubTeacher:
    """teacher(x, y) -> ((x - 0.5) W + (k + 1), BN loss, (1, b, c)) on its k-th call (k from 0): the constant shift
    changes neither CE nor KL but tells which step's logits came back. BN loss: mean(x^2), or the scripted
    value of that call (with the gradient of sum(x), so the generator still moves). predict(x, y) = (x - 0.5) W."""

    def __init__(self, scripted=None, synth=None):
        self.weight = 100.0 * torch.randn(D, C, generator=torch.Generator().manual_seed(1))
        self.scripted, self.synth = scripted, synth
        self.calls, self.predicted = [], []

    def logits(self, x):
        return (x.flatten(1) - 0.5) @ self.weight  # the fresh generator's images are 0.5 +- 0.01

    def state_dict(self):  # nothing of this teacher moves during distillation
        return {}

    def load_state_dict(self, state):
        assert state == {}

    def __call__(self, x, labels):
        assert labels is not None
        k = len(self.calls)
        logits = self.logits(x) + (k + 1)
        if self.scripted is None:
            bn = x.pow(2).mean()
        else:
            s = x.sum()
            bn = (s - s.detach()) + self.scripted[k]
        params = [p.detach().clone() for p in self.synth.generator.parameters()] if self.synth else None
        self.calls.append({"images": x.detach().clone(), "labels": labels.clone(), "logits": logits.detach().clone(),
                           "params": params})
        return logits, bn, logits[None]

    def predict(self, x, labels):
        assert labels is not None
        self.predicted.append(labels.clone())
        return self.logits(x)


class Student(nn.Module):
    """A linear student that records, on every call, its training flag and its parameters' requires_grad."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, C)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            self.fc.weight.copy_(100.0 * torch.randn(C, D, generator=g))
            self.fc.bias.copy_(torch.randn(C, generator=g) - 0.5 * self.fc.weight.sum(1))
        self.seen = []

    def plain(self, x):
        return x.flatten(1) @ self.fc.weight.detach().T + self.fc.bias.detach()

    def forward(self, x):
        self.seen.append((self.training, [p.requires_grad for p in self.parameters()]))
        return self.fc(x.flatten(1))


class RaisingStudent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, C)

    def forward(self, x):
        raise AssertionError("the student must not be called when adv = 0")


def make(teacher=None, student=None, loss=None, steps=2, seed=0, **kw):
    return GeneratorSynthesizer(teacher if teacher is not None else StubTeacher(),
                                student if student is not None else Student(), SPEC,
                                loss if loss is not None else GeneratorLoss(), C, B, steps, LR, seed, CPU, **kw)


def fresh_generator(seed):
    return reset_generator(SPEC.build(), seed)


def draws(seed, epochs):
    """The (z, labels) of each epoch: z first, then the labels, from one stream seeded with `seed`."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        z = torch.randn(B, NZ, generator=rng)
        out.append((z, balanced_labels(B, C, rng)))
    return out


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- balanced_labels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, classes", [(8, 3), (6, 3), (2, 5)])
def test_balanced_labels_are_each_class_batch_div_c_times_the_rest_drawn_then_shuffled(batch, classes):
    rng = torch.Generator().manual_seed(7)
    torch.manual_seed(123)  # the global stream differs from the seeded one
    got = balanced_labels(batch, classes, rng)
    # by hand: the base block, the remainder from rng, then a permutation from the same rng
    ref = torch.Generator().manual_seed(7)
    base = [c for _ in range(batch // classes) for c in range(classes)]
    extra = torch.randint(classes, (batch % classes,), generator=ref)
    expected = torch.tensor(base + extra.tolist())[torch.randperm(batch, generator=ref)]
    assert torch.equal(got, expected)
    assert torch.equal(rng.get_state(), ref.get_state())  # both draws came from rng
    counts = torch.bincount(got, minlength=classes)
    assert got.shape == (batch,) and counts.sum() == batch
    assert (counts >= batch // classes).all() and (counts - batch // classes).sum() == batch % classes
    assert torch.equal(balanced_labels(batch, classes, torch.Generator().manual_seed(7)), got)


def test_balanced_labels_without_remainder_are_exactly_balanced_and_shuffled():
    got = balanced_labels(12, 3, torch.Generator().manual_seed(0))
    assert torch.bincount(got).tolist() == [4, 4, 4]
    assert not torch.equal(got, torch.arange(3).repeat(4))  # shuffled
    assert not torch.equal(got, balanced_labels(12, 3, torch.Generator().manual_seed(1)))  # by the seeded rng


# --- construction and resets -------------------------------------------------------------------------


def test_generator_loss_defaults():
    loss = GeneratorLoss()
    assert (loss.ce, loss.bn, loss.adv, loss.adv_mask, loss.adv_temperature, loss.hardness) == (
        1.0, 1.0, 1.0, "none", 1.0, 0.0)


def test_init_seeds_the_generator_with_seed_and_builds_adam_with_lr_and_betas():
    synth = make(seed=4)
    assert synth.epoch == 0 and not synth.reset_each_epoch and synth.keep == "best"
    expected = fresh_generator(4)
    assert same(list(synth.generator.parameters()), list(expected.parameters()))
    assert same(list(synth.generator.buffers()), list(expected.buffers()))
    assert not same(list(synth.generator.parameters()), list(fresh_generator(5).parameters()))
    (group,) = synth.optimizer.param_groups
    assert isinstance(synth.optimizer, torch.optim.Adam)
    assert group["lr"] == LR and group["betas"] == (0.5, 0.999)
    assert [id(p) for p in group["params"]] == [id(p) for p in synth.generator.parameters()]


def test_reset_each_epoch_reinitialises_with_seed_plus_epoch_and_a_fresh_optimizer():
    teacher = StubTeacher()
    synth = make(teacher, steps=1, seed=3, reset_each_epoch=True)
    teacher.synth = synth
    for epoch in (1, 2, 3):
        synth.synthesize()
        assert synth.epoch == epoch
        start = teacher.calls[epoch - 1]["params"]  # the weights the epoch's first step ran with
        # epoch 1 keeps the constructor's seed + 0 init; epoch e > 1 re-initialises with seed + e
        assert same(start, list(fresh_generator(3 + (0 if epoch == 1 else epoch)).parameters())), epoch
        (group,) = synth.optimizer.param_groups
        assert group["lr"] == LR and group["betas"] == (0.5, 0.999)
        steps = {int(s["step"]) for s in synth.optimizer.state.values()}
        assert steps == {1}  # a new Adam each epoch
        assert [id(p) for p in group["params"]] == [id(p) for p in synth.generator.parameters()]


@pytest.mark.parametrize("explicit", [True, False])
def test_without_reset_the_same_generator_and_optimizer_keep_training(explicit):
    teacher = StubTeacher()
    synth = make(teacher, steps=1, seed=3, **({"reset_each_epoch": False} if explicit else {}))
    teacher.synth = synth
    synth.synthesize()
    after_first = [p.detach().clone() for p in synth.generator.parameters()]
    assert not same(after_first, teacher.calls[0]["params"])  # the step moved it
    synth.synthesize()
    assert synth.epoch == 2
    assert same(teacher.calls[0]["params"], list(fresh_generator(3).parameters()))
    assert same(teacher.calls[1]["params"], after_first)  # epoch 2 starts where epoch 1 ended
    assert {int(s["step"]) for s in synth.optimizer.state.values()} == {2}


# --- synthesize: noise, labels, student ----------------------------------------------------------------


def test_z_and_labels_come_from_the_seeded_stream_and_the_epoch_counts_up():
    teacher = StubTeacher()
    synth = make(teacher, steps=1, seed=6)
    outs = [synth.synthesize() for _ in range(2)]
    assert synth.epoch == 2
    for k, ((z, labels), out) in enumerate(zip(draws(6, 2), outs)):
        assert torch.equal(out.labels, labels) and torch.equal(teacher.calls[k]["labels"], labels)
        assert torch.bincount(out.labels, minlength=C).tolist() == [B // C] * C
        if k == 0:  # the first step's images are the seed-6 generator (train mode) on z
            with torch.no_grad():
                assert torch.allclose(teacher.calls[0]["images"], fresh_generator(6).train()(z))
    other = make(StubTeacher(), steps=1, seed=6).synthesize()
    assert torch.equal(other.labels, outs[0].labels) and torch.equal(other.images, outs[0].images)


@pytest.mark.parametrize("was_training", [True, False])
def test_the_student_is_frozen_in_eval_mode_during_the_steps_and_restored_after(was_training):
    student = Student()
    student.fc.bias.requires_grad_(False)  # frozen before: must stay frozen
    student.train(was_training)
    synth = make(student=student, steps=2)
    synth.synthesize()
    assert student.seen == [(False, [False, False])] * 2
    assert student.training is was_training
    assert student.fc.weight.requires_grad and not student.fc.bias.requires_grad
    assert student.fc.weight.grad is None and student.fc.bias.grad is None


def test_the_student_is_restored_when_a_step_raises():
    class Failing(StubTeacher):
        def __call__(self, x, labels):
            if self.calls:
                raise RuntimeError("boom")
            return super().__call__(x, labels)

    student = Student().train()
    synth = make(Failing(), student=student, steps=3)
    with pytest.raises(RuntimeError, match="boom"):
        synth.synthesize()
    assert student.training and all(p.requires_grad for p in student.parameters())


# --- synthesize: which batch comes back -----------------------------------------------------------------

ONLY_BN = GeneratorLoss(ce=0.0, bn=1.0, adv=0.0)  # total = the scripted BN value


def images_of(synth, epoch=1):
    """generator(z) with the synthesizer's current weights (train mode: batch statistics) on epoch's z."""
    z, _ = draws(synth.seed, epoch)[-1]
    with torch.no_grad():
        return synth.generator(z)


def distinct(teacher):
    images = [c["images"] for c in teacher.calls]
    return all(not torch.equal(a, b) for i, a in enumerate(images) for b in images[i + 1:])


@pytest.mark.parametrize("scripted, best", [([3.0, 1.0, 2.0], 1), ([1.0, 1.0, 1.0], 0), ([3.0, 2.0, 1.0], 2),
                                            ([1.0, 2.0, 3.0], 0)])
def test_keep_best_returns_the_lowest_loss_batch_seen_before_each_update_first_on_ties(scripted, best):
    teacher = StubTeacher(scripted)
    synth = make(teacher, loss=ONLY_BN, steps=3)
    out = synth.synthesize()
    assert distinct(teacher)  # every step moved the generator: the steps' batches differ
    assert torch.equal(out.images, teacher.calls[best]["images"])
    assert torch.equal(out.teacher_logits, teacher.calls[best]["logits"])  # that step's own logits (shift best+1)
    assert torch.equal(out.labels, teacher.calls[0]["labels"])
    assert teacher.predicted == []
    assert not torch.allclose(out.images, images_of(synth))  # not the generator after the last update


def test_keep_best_with_no_finite_loss_falls_back_to_the_last_generator_output():
    teacher = StubTeacher([math.nan, math.nan])
    synth = make(teacher, loss=GeneratorLoss(adv=0.0), steps=2)
    out = synth.synthesize()
    assert torch.equal(out.images, images_of(synth))
    assert torch.equal(out.teacher_logits, teacher.logits(out.images))  # teacher.predict, unshifted
    assert len(teacher.predicted) == 1 and torch.equal(teacher.predicted[0], out.labels)


def test_keep_last_returns_the_generator_after_the_last_update_with_teacher_predict():
    teacher = StubTeacher([1.0, 3.0])
    synth = make(teacher, loss=ONLY_BN, steps=2, keep="last")
    out = synth.synthesize()
    assert torch.equal(out.images, images_of(synth))
    assert not any(torch.allclose(out.images, c["images"]) for c in teacher.calls)
    assert torch.equal(out.teacher_logits, teacher.logits(out.images))
    assert len(teacher.predicted) == 1 and torch.equal(teacher.predicted[0], out.labels)
    assert out.losses["total"] == pytest.approx(2.0) and out.losses["bn"] == pytest.approx(2.0)


# --- synthesize: the loss -----------------------------------------------------------------------------


def hand_terms(call, student, mask, temperature, hardness):
    """CE (hardness-weighted), BN (the stub's mean x^2) and -T^2 KL(teacher || student) of one recorded step."""
    x, y, t = call["images"], call["labels"], call["logits"]
    rows = torch.arange(len(y))
    log_p = torch.log_softmax(t, dim=1)
    weight = (1.0 - log_p.exp()[rows, y]) ** hardness if hardness > 0 else torch.ones(len(y))
    ce = (-log_p[rows, y] * weight).mean()
    s = student.plain(x)
    lt, ls = torch.log_softmax(t / temperature, 1), torch.log_softmax(s / temperature, 1)
    kl = (lt.exp() * (lt - ls)).sum(1)
    agree = t.argmax(1) == s.argmax(1)
    if mask == "disagree":
        kl = kl * (~agree).float()
    adv = -(kl.mean() * temperature ** 2)
    return float(ce), float(x.pow(2).mean()), float(adv), agree


@pytest.mark.parametrize("mask, temperature, hardness", [("none", 2.0, 0.0), ("disagree", 1.0, 1.5),
                                                         ("none", 1.0, 1.0)])
def test_the_reported_losses_are_the_per_step_means_of_the_weighted_terms(mask, temperature, hardness):
    weights = {"ce": 0.5, "bn": 2.0, "adv": 1.5}
    loss = GeneratorLoss(**weights, adv_mask=mask, adv_temperature=temperature, hardness=hardness)
    teacher, student = StubTeacher(), Student()
    synth = make(teacher, student, loss=loss, steps=2)
    out = synth.synthesize()
    assert distinct(teacher)
    per_step = [hand_terms(c, student, mask, temperature, hardness) for c in teacher.calls]
    agree = per_step[0][3]
    assert agree.any() and not agree.all()  # both kinds of rows: a mask that is not passed on shows
    totals = [weights["ce"] * ce + weights["bn"] * bn + weights["adv"] * adv for ce, bn, adv, _ in per_step]
    expected = {"ce": sum(s[0] for s in per_step) / 2, "bn": sum(s[1] for s in per_step) / 2,
                "adv": sum(s[2] for s in per_step) / 2, "total": sum(totals) / 2}
    assert set(out.losses) == set(expected)
    for name, value in expected.items():
        assert out.losses[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert all(per_step[0][i] != per_step[1][i] for i in range(3))  # a sum that is not a sum shows


def test_with_adv_zero_the_student_is_never_called_and_the_adv_term_is_zero():
    teacher = StubTeacher()
    synth = make(teacher, RaisingStudent(), loss=GeneratorLoss(ce=1.0, bn=2.0, adv=0.0), steps=2)
    out = synth.synthesize()
    assert out.losses["adv"] == 0.0
    assert out.losses["total"] == pytest.approx(out.losses["ce"] + 2.0 * out.losses["bn"], rel=1e-6)


def test_the_bn_weight_multiplies_its_term():
    out = make(StubTeacher([0.25, 0.25]), loss=GeneratorLoss(ce=1.0, bn=2.0, adv=1.0), steps=2).synthesize()
    assert out.losses["bn"] == pytest.approx(0.25)
    assert out.losses["total"] == pytest.approx(out.losses["ce"] + 2 * 0.25 + out.losses["adv"], rel=1e-6)
    assert out.losses["adv"] < 0 < out.losses["ce"]


@pytest.mark.filterwarnings("error")  # e.g. softmax without dim (its implicit-dimension warning)
@pytest.mark.parametrize("hardness", [0.0, 1.0, 2.0])
def test_hardness_weights_the_ce_by_one_minus_p_y_to_the_hardness_without_a_gradient_through_the_weight(hardness):
    synth = make(loss=GeneratorLoss(hardness=hardness))
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.4, 0.3], [-1.0, 3.0, 0.0], [0.0, 0.0, 5.0]],
                          requires_grad=True)
    y = torch.tensor([0, 2, 1, 0])
    got = synth._ce(logits, y)
    got.backward()
    got = got.detach()
    # by hand: p = softmax, w_i = (1 - p_i,y_i)^h held constant, loss = mean_i w_i * -log p_i,y_i
    with torch.no_grad():
        e = logits.exp()
        p = e / e.sum(1, keepdim=True)
        p_y = p[torch.arange(4), y]
        w = (1.0 - p_y) ** hardness
        expected = (w * -p_y.log()).mean()
        grad = w[:, None] * (p - F.one_hot(y, C).float()) / 4
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    assert torch.allclose(logits.grad, grad, atol=1e-7, rtol=1e-5)


# --- state_dict round trip ------------------------------------------------------------------------------


def test_a_synthesizer_restored_from_another_continues_with_identical_batches():
    teacher = StubTeacher()
    a = make(teacher, Student(), steps=2, seed=3, keep="last")
    a.synthesize()
    state = copy.deepcopy(a.state_dict())  # as a checkpoint holds it (Adam's state_dict shares its tensors)
    assert state["epoch"] == 1
    b = make(teacher, Student(), steps=2, seed=11, keep="last")
    b.load_state_dict(state)
    assert b.epoch == 1 and torch.equal(b.rng.get_state(), a.rng.get_state())
    next_a, next_b = a.synthesize(), b.synthesize()
    assert a.epoch == b.epoch == 2
    assert torch.equal(next_a.labels, next_b.labels)
    assert torch.equal(next_a.images, next_b.images)
    assert torch.equal(next_a.teacher_logits, next_b.teacher_logits)
    assert next_a.losses == next_b.losses
    assert same(list(a.generator.parameters()), list(b.generator.parameters()))
