"""The KD loop (engine/distill.py) on a linear student: every update checked against a gradient
worked out with the closed form of the KD loss (dL/dz = T (softmax(z/T) - softmax(t/T)) / B, plus
beta (softmax(z) - onehot(argmax t)) / B for the hard-label CE), never with kd_loss itself; and the
loop's knobs (schedule, momentum, weight decay, clipping, Adam, kd_transform, evaluation,
checkpoints) each checked by the effect it names."""

import logging
import math

import pytest
import torch
from torch import nn

from oneshot_fl.engine.distill import Checkpoint, DistillSettings, distill, make_optimizer
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.synthesizer import SynthBatch

# images exactly representable in float16 (the pool stores images as float16)
X = torch.tensor([[0.5, -1.0, 0.25], [1.0, 0.75, -0.5], [0.0, 0.25, 1.0], [-0.75, 0.5, 0.5]])
TEACHER = torch.tensor([[2.0, -1.0], [0.0, 1.5], [1.0, 1.0], [-0.5, 2.5]])


class FixedSource:
    """A synthesizer stand-in: the same labelled batch every epoch, with the losses it reports."""

    def __init__(self, images=X, logits=TEACHER, losses=None):
        self.images, self.logits, self.calls = images, logits, 0
        self.losses = losses or {"ce": 0.25, "bn": 0.5, "adv": -0.75}

    def synthesize(self):
        self.calls += 1
        return SynthBatch(self.images.clone(), self.logits.argmax(1), self.logits.clone(), dict(self.losses))

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def student(weight=((0.5, -0.25, 1.0), (-0.5, 0.75, 0.25)), bias=(0.1, -0.2)):
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
        model.bias.copy_(torch.tensor(bias))
    return model


def softmax(z):
    e = torch.exp(z - z.max(dim=1, keepdim=True).values)
    return e / e.sum(dim=1, keepdim=True)


def manual(weight, bias, x=X, t=TEACHER, temperature=1.0, beta=0.0):
    """(dL/dW, dL/db, L) of KD (x T^2, batch mean) + beta * CE(argmax t) for z = x W^T + b."""
    b = len(x)
    z = x @ weight.T + bias
    q, p = softmax(z / temperature), softmax(t / temperature)
    g = temperature * (q - p) / b
    loss = temperature ** 2 * (p * (p.log() - q.log())).sum(1).mean()
    if beta:
        s = softmax(z)
        onehot = torch.zeros_like(s)
        onehot[torch.arange(b), t.argmax(1)] = 1.0
        g = g + beta * (s - onehot) / b
        loss = loss + beta * -(s.log() * onehot).sum(1).mean()
    return g.T @ x, g.sum(0), float(loss)


def run(model, settings, source=None, pool=None, **kwargs):
    pool = pool if pool is not None else SyntheticPool("paper", 1, 1, len(X))
    return distill(model, source or FixedSource(), pool, settings, kwargs.pop("evaluate", lambda m: 0.5),
                   seed=kwargs.pop("seed", 0), **kwargs)


def params(model):
    return model.weight.detach().clone(), model.bias.detach().clone()


# --- settings and optimizer -------------------------------------------------------------------

def test_cosine_learning_rate_by_epoch_and_constant_by_default():
    cosine = DistillSettings(epochs=4, lr=0.2, lr_schedule="cosine")
    expected = [0.2 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]  # 0.2, 0.1707, 0.1, 0.0293
    assert [cosine.lr_at(e) for e in (1, 2, 3, 4)] == pytest.approx(expected, abs=1e-12)
    assert expected[2] == pytest.approx(0.1)
    assert [DistillSettings(epochs=4, lr=0.2).lr_at(e) for e in (1, 4)] == [0.2, 0.2]


def test_settings_defaults_are_the_plain_loop():
    s = DistillSettings(epochs=3, lr=0.1)
    assert (s.temperature, s.beta, s.momentum, s.weight_decay, s.lr_schedule, s.grad_clip, s.optimizer) == (
        1.0, 0.0, 0.9, 0.0, "constant", 0.0, "sgd")
    assert (s.eval_every, s.checkpoint_every) == (5, 5)


def test_make_optimizer_passes_lr_momentum_and_weight_decay():
    model = nn.Linear(2, 2)
    sgd = make_optimizer(model, DistillSettings(epochs=1, lr=0.3, momentum=0.7, weight_decay=0.01))
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["lr"], sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.3, 0.7, 0.01)
    adam = make_optimizer(model, DistillSettings(epochs=1, lr=0.02, weight_decay=0.05, optimizer="adam"))
    assert isinstance(adam, torch.optim.Adam)
    assert (adam.defaults["lr"], adam.defaults["weight_decay"]) == (0.02, 0.05)
    assert sum(p.numel() for g in adam.param_groups for p in g["params"]) == 6
    with pytest.raises(ValueError, match="student optimizer 'rmsprop': use sgd or adam"):
        make_optimizer(model, DistillSettings(epochs=1, lr=0.1, optimizer="rmsprop"))


# --- one step against the closed-form gradient ------------------------------------------------

@pytest.mark.parametrize("temperature, beta", [(1.0, 0.0), (3.0, 0.0), (2.0, 0.5)])
def test_one_epoch_is_one_sgd_step_on_kd_at_t_plus_beta_ce(temperature, beta):
    model = student()
    w0, b0 = params(model)
    gw, gb, loss = manual(w0, b0, temperature=temperature, beta=beta)
    history, resumed = run(model, DistillSettings(epochs=1, lr=0.5, temperature=temperature, beta=beta,
                                                  momentum=0.0))
    assert resumed == 0
    assert torch.allclose(model.weight, w0 - 0.5 * gw, atol=1e-6)
    assert torch.allclose(model.bias, b0 - 0.5 * gb, atol=1e-6)
    assert history[0]["kd_loss"] == pytest.approx(loss, abs=1e-6)  # the loss before the step
    assert history[0]["kd_steps"] == 1


def test_two_epochs_follow_the_cosine_schedule_with_momentum():
    model = student()
    w0, b0 = params(model)
    settings = DistillSettings(epochs=2, lr=0.4, momentum=0.5, lr_schedule="cosine", eval_every=10)
    gw1, gb1, _ = manual(w0, b0)
    w1, b1 = w0 - 0.4 * gw1, b0 - 0.4 * gb1  # epoch 1: lr 0.4, momentum buffer = gradient
    gw2, gb2, _ = manual(w1, b1)
    lr2 = 0.4 * 0.5 * (1 + math.cos(math.pi / 2))  # 0.2
    w2, b2 = w1 - lr2 * (0.5 * gw1 + gw2), b1 - lr2 * (0.5 * gb1 + gb2)
    run(model, settings)
    assert torch.allclose(model.weight, w2, atol=1e-6) and torch.allclose(model.bias, b2, atol=1e-6)


def test_grad_clip_bounds_the_update_norm_to_lr_times_clip():
    w0, b0 = params(student())
    gw, gb, _ = manual(w0, b0, temperature=1.0)
    full = math.sqrt(float((gw ** 2).sum() + (gb ** 2).sum()))
    clip = full / 4  # the clip is active
    clipped = student()
    run(clipped, DistillSettings(epochs=1, lr=0.5, momentum=0.0, grad_clip=clip))
    dw, db = clipped.weight.detach() - w0, clipped.bias.detach() - b0
    assert math.sqrt(float((dw ** 2).sum() + (db ** 2).sum())) == pytest.approx(0.5 * clip, rel=1e-4)
    assert torch.allclose(dw, -0.5 * gw / 4, atol=1e-5)  # same direction, a quarter of the length
    loose = student()
    run(loose, DistillSettings(epochs=1, lr=0.5, momentum=0.0, grad_clip=full * 2))  # inactive
    assert torch.allclose(loose.weight, w0 - 0.5 * gw, atol=1e-6)


def test_adam_first_step_moves_every_parameter_by_lr():
    model = student()
    w0, b0 = params(model)
    gw, gb, _ = manual(w0, b0)
    run(model, DistillSettings(epochs=1, lr=0.01, optimizer="adam"))
    assert torch.allclose(model.weight - w0, -0.01 * gw.sign(), atol=1e-6)
    assert torch.allclose(model.bias - b0, -0.01 * gb.sign(), atol=1e-6)


def test_weight_decay_shrinks_weights_whose_loss_gradient_is_zero_and_kd_transform_feeds_the_loss():
    model = student()
    w0, b0 = params(model)
    seen = []

    def match_student(images, teacher_logits, rng):
        # the teacher's logits replaced by the student's own output: the KD gradient is exactly 0
        seen.append((images.clone(), teacher_logits.clone()))
        return images, (images @ model.weight.T + model.bias).detach()

    run(model, DistillSettings(epochs=1, lr=0.5, momentum=0.0, weight_decay=0.1), kd_transform=match_student)
    assert torch.allclose(model.weight, w0 * (1 - 0.5 * 0.1), atol=1e-6)  # only the decay moved them
    assert torch.allclose(model.bias, b0 * (1 - 0.5 * 0.1), atol=1e-6)
    assert len(seen) == 1 and torch.equal(seen[0][0], X) and torch.equal(seen[0][1], TEACHER)
    still = student()
    run(still, DistillSettings(epochs=1, lr=0.5, momentum=0.0), kd_transform=lambda i, t, r: (
        i, (i @ still.weight.T + still.bias).detach()))
    assert torch.allclose(still.weight, w0, atol=1e-7)  # no decay, no gradient: no move


def test_kd_transform_images_and_logits_are_what_the_student_trains_on():
    model = student()
    w0, b0 = params(model)
    shifted, target = X + 1.0, TEACHER.flip(1)
    gw, gb, loss = manual(w0, b0, x=shifted, t=target)
    rngs = []

    def transform(images, teacher_logits, rng):
        rngs.append(rng)
        return images + 1.0, teacher_logits.flip(1)

    history, _ = run(model, DistillSettings(epochs=1, lr=0.5, momentum=0.0), kd_transform=transform)
    assert torch.allclose(model.weight, w0 - 0.5 * gw, atol=1e-6)
    assert history[0]["kd_loss"] == pytest.approx(loss, abs=1e-6)
    assert isinstance(rngs[0], torch.Generator)


# --- the loop's bookkeeping -------------------------------------------------------------------

def test_history_records_and_evaluation_epochs(caplog):
    calls, evaluated = [], []

    def before(epoch):
        calls.append(epoch)

    def evaluate(model):
        evaluated.append(len(calls))
        return 0.25 * len(calls)

    source = FixedSource(losses={"ce": 1.5, "bn": 2.5, "adv": -0.5, "total": 3.5})
    pool = SyntheticPool("growing", 0, 0, 4)
    model = student()
    model.eval()
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, _ = run(model, DistillSettings(epochs=5, lr=0.01, eval_every=2), source=source, pool=pool,
                         evaluate=evaluate, before_epoch=before, label="unit-kd")
    assert model.training  # the student trains in train mode
    assert calls == [1, 2, 3, 4, 5] and source.calls == 5
    assert evaluated == [2, 4, 5]  # every eval_every epochs and the last one
    assert [h["accuracy"] for h in history] == [None, 0.5, None, 1.0, 1.25]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4, 5]
    assert [h["pool_size"] for h in history] == [4, 8, 12, 16, 20]  # growing: every batch kept
    assert [h["kd_steps"] for h in history] == [1, 2, 3, 4, 5]  # one pass over the pool in batches of 4
    first = history[0]
    assert (first["gen_ce"], first["gen_bn"], first["gen_adv"], first["gen_total"]) == (1.5, 2.5, -0.5, 3.5)
    assert first["synthesis_s"] >= 0 and first["kd_s"] >= 0
    lines = [r.getMessage() for r in caplog.records]
    assert any(ln.startswith("unit-kd: epoch 2/5  gen ce 1.500 bn 2.500 adv -0.500  kd ") and "(2 steps)" in ln
               and "test acc 0.5000" in ln for ln in lines), lines
    assert any(ln.startswith("unit-kd: epoch 1/5") and "test acc" not in ln for ln in lines)


def test_kd_loss_record_is_the_mean_over_the_epochs_steps():
    # growing pool, lr 0: epoch 2 trains on both copies of X in two shuffled batches of 4. Each
    # batch loss differs, their mean is the loss over all 8 images = the loss over X.
    _, _, loss = manual(*params(student()))
    history, _ = run(student(), DistillSettings(epochs=2, lr=0.0, momentum=0.0), pool=SyntheticPool("growing", 0, 0, 4))
    assert [h["kd_steps"] for h in history] == [1, 2]
    assert [h["kd_loss"] for h in history] == pytest.approx([loss, loss], abs=1e-6)
    history, _ = run(student(), DistillSettings(epochs=1, lr=0.0, momentum=0.0), pool=SyntheticPool("capped", 2, 3, 4))
    assert history[0]["kd_steps"] == 3


def test_checkpoints_resume_and_end_where_an_uninterrupted_run_ends(tmp_path, caplog):
    settings = DistillSettings(epochs=4, lr=0.3, eval_every=1, checkpoint_every=2, lr_schedule="cosine")
    pool = lambda: SyntheticPool("growing", 0, 0, 3)  # noqa: E731 - shuffled: the rng state matters
    straight = student()
    history_straight, _ = run(straight, settings, pool=pool(), seed=5)

    path = tmp_path / "ck" / "distill.pt"

    def stop_at_3(epoch):
        if epoch == 3:
            raise KeyboardInterrupt

    first = student()
    with pytest.raises(KeyboardInterrupt):
        run(first, settings, pool=pool(), seed=5, checkpoint=Checkpoint(path, "fp"), before_epoch=stop_at_3)
    assert path.is_file() and [p.name for p in path.parent.iterdir()] == ["distill.pt"]  # no temp file left
    saved = torch.load(path, weights_only=False)
    assert saved["epoch"] == 2 and saved["fingerprint"] == "fp" and len(saved["history"]) == 2

    resumed_model, source = student(), FixedSource()
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, resumed_from = run(resumed_model, settings, source=source, pool=pool(), seed=5,
                                    checkpoint=Checkpoint(path, "fp"))
    assert resumed_from == 2 and source.calls == 2 + 2  # the source state came back (2) + 2 new epochs
    assert any(f"resuming distillation from epoch 2 of {path}" in r.getMessage() for r in caplog.records)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert [h["kd_loss"] for h in history] == pytest.approx([h["kd_loss"] for h in history_straight], abs=1e-6)
    assert torch.allclose(resumed_model.weight, straight.weight, atol=1e-6)
    assert torch.allclose(resumed_model.bias, straight.bias, atol=1e-6)
    assert torch.load(path, weights_only=False)["epoch"] == 2  # the last epoch is never checkpointed

    fresh, _ = run(student(), settings, pool=pool(), seed=5, checkpoint=Checkpoint(path, "other-config"))
    assert len(fresh) == 4  # another fingerprint: started over


def test_checkpoint_load_save_and_fingerprint(tmp_path, caplog):
    path = tmp_path / "a" / "b" / "c.pt"  # parent folders are created, nested ones included
    ck = Checkpoint(path, "abc")
    assert ck.load() is None
    ck.save({"epoch": 3, "x": torch.arange(3)})
    state = ck.load()
    assert state["epoch"] == 3 and torch.equal(state["x"], torch.arange(3)) and state["fingerprint"] == "abc"
    with caplog.at_level(logging.WARNING, logger="oneshot_fl.engine.distill"):
        assert Checkpoint(path, "xyz").load() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"ignoring checkpoint {path}: it belongs to another configuration"]


def test_default_label_and_timings_of_the_epoch_record(caplog):
    import time

    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, _ = run(student(), DistillSettings(epochs=1, lr=0.1))
    wall = time.perf_counter() - start
    assert caplog.records[0].getMessage().startswith("distill: epoch 1/1  gen ce 0.250 bn 0.500 adv -0.750  kd ")
    # the phase timings are durations within the call, not clock readings
    assert 0 <= history[0]["synthesis_s"] <= wall and 0 <= history[0]["kd_s"] <= wall


class _Stop:
    """A minimal early stopping whose state is a counter: shows what a resumed run restores."""

    def __init__(self):
        self.best_epoch, self.loaded = 0, None

    def update(self, epoch, model):
        self.best_epoch = epoch
        return {"val_best_epoch": epoch}

    should_stop = False

    def restore(self, model):
        pass

    def state_dict(self):
        return {"best_epoch": self.best_epoch}

    def load_state_dict(self, state):
        self.loaded = state
        self.best_epoch = state["best_epoch"]


def test_a_resumed_run_restores_the_early_stopping_state(tmp_path, caplog):
    settings = DistillSettings(epochs=3, lr=0.1, checkpoint_every=1, eval_every=1)
    path = tmp_path / "ck.pt"

    def stop_at_3(epoch):
        if epoch == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(student(), settings, checkpoint=Checkpoint(path, "fp"), before_epoch=stop_at_3, early_stop=_Stop())
    stop = _Stop()
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, resumed_from = run(student(), settings, checkpoint=Checkpoint(path, "fp"), early_stop=stop,
                                    label="unit")
    assert resumed_from == 2 and stop.loaded == {"best_epoch": 2}
    assert [h["val_best_epoch"] for h in history] == [1, 2, 3]
    assert f"unit: resuming distillation from epoch 2 of {path} (epochs 1-2 restored; epoch 3/3 next)" in [
        r.getMessage() for r in caplog.records]


def test_evaluation_sees_the_student_and_the_epoch_line_ends_with_the_elapsed_seconds(caplog):
    import re
    import time

    model = student()
    seen = []
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, _ = run(model, DistillSettings(epochs=2, lr=0.1, eval_every=2),
                         evaluate=lambda m: seen.append(m) or float(m.bias.sum()))
    wall = time.perf_counter() - start
    assert seen == [model] and history[1]["accuracy"] == pytest.approx(float(model.bias.sum()))
    first, second = (r.getMessage() for r in caplog.records)
    # no accuracy: nothing between the steps and the time
    assert re.search(r"\(1 steps\)  \[\d+s, ETA \d\d:\d\d\]$", first), first
    assert re.search(r"\(1 steps\)  test acc -?\d\.\d{4}  \[\d+s, ETA 00:00\]$", second), second
    assert int(re.search(r"\[(\d+)s, ETA", second).group(1)) <= wall + 1  # seconds since the start


class _StopAt2(_Stop):
    patience = 4

    def update(self, epoch, model):
        self.epoch = epoch
        self.best_epoch = 1
        return {"val_best_epoch": 1}

    @property
    def should_stop(self):
        return self.epoch == 2


def test_early_stop_is_logged_with_epoch_patience_and_best_epoch(caplog):
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.distill"):
        history, _ = run(student(), DistillSettings(epochs=5, lr=0.1, eval_every=10), early_stop=_StopAt2(),
                         label="unit")
    assert [h["epoch"] for h in history] == [1, 2] and history[1]["accuracy"] == 0.5
    assert caplog.records[-1].getMessage() == (
        "unit: early stop at epoch 2 (no better held-out score for 4 epochs; best epoch 1)")


def test_a_dropout_student_distils_the_same_whatever_the_process_global_rng_holds():
    """Dropout draws from torch's global RNG: each epoch's KD steps seed it from the run seed and the epoch
    (and put it back), so a student with dropout ends the same in every process, resumed or not."""
    ends = []
    for other_state in (1, 2):
        torch.manual_seed(other_state)  # whatever ran in this process before
        model = nn.Sequential(nn.Dropout(0.5), student())
        before = torch.random.get_rng_state()
        run(model, DistillSettings(epochs=3, lr=0.4, eval_every=10))
        assert torch.equal(torch.random.get_rng_state(), before)
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(ends[0], ends[1])
    other_seed = nn.Sequential(nn.Dropout(0.5), student())
    run(other_seed, DistillSettings(epochs=3, lr=0.4, eval_every=10), seed=1)
    assert not torch.equal(ends[0], torch.cat([p.detach().flatten() for p in other_seed.parameters()]))
