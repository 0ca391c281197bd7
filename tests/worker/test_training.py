"""Local training and evaluation: learning, determinism, optimizers, FedProx and weight decay
checked against one hand-computed SGD step."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from proto.job import ModelSpec, TrainingSpec
from worker.models import build_model
from worker.serialization import load_weights, model_weights
from worker.training import (
    LABEL_PRIOR,
    MIN_BATCH,
    MIN_BATCH_NORM,
    TrainingError,
    batch_starts,
    batchnorm_statistics,
    evaluate,
    held_out_choice,
    label_offsets,
    make_optimizer,
    sample_scores,
    train_local,
)


def _blobs(n: int = 120, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
    x = (centers[y] + rng.normal(0, 0.5, (n, 2))).astype(np.float32)
    return x, y


def _mlp(seed: int = 0) -> torch.nn.Module:
    return build_model(ModelSpec(name="mlp", hidden=16), (2,), 3, seed=seed)


def test_training_learns_and_reports_samples() -> None:
    x, y = _blobs()
    model = _mlp()
    before = evaluate(model, x, y)
    spec = TrainingSpec(number_of_epochs=5, batch_size=16, learning_rate=0.1)
    result = train_local(model, x, y, spec, seed=0)
    after = evaluate(model, x, y)
    assert result.num_samples == 120
    assert after.loss < before.loss and after.accuracy > 0.9
    assert result.loss < before.loss


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_same_seed_same_weights_other_seed_other_weights(optimizer: str) -> None:
    x, y = _blobs()
    spec = TrainingSpec(number_of_epochs=2, batch_size=8, optimizer=optimizer,
                        learning_rate=0.01, momentum=0.9)
    runs = []
    for seed in (3, 3, 4):
        model = _mlp()
        torch.manual_seed(seed * 100)  # global RNG must not matter
        train_local(model, x, y, spec, seed=seed)
        runs.append(model_weights(model))
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not np.array_equal(runs[0][k], runs[2][k]) for k in runs[0])


class _DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.5), torch.nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_dropout_masks_follow_the_seed_not_the_threads() -> None:
    """Dropout draws its masks from torch's global generator: a model with dropout trained
    while other threads train theirs (the in-process backend's clients) ends with the same
    weights as trained alone, and another seed gives other weights."""
    import threading

    x, y = _blobs()
    spec = TrainingSpec(number_of_epochs=3, batch_size=8, learning_rate=0.05)

    torch.manual_seed(0)
    start = model_weights(_DropoutNet())

    # (built here: a model built in a thread draws its init from the global generator,
    # unlocked, the way no production code does: build_model holds GLOBAL_RNG)
    models = [_DropoutNet() for _ in range(7)]

    def trained(seed: int, out: dict[str, dict] | None = None, key: str = "") -> dict:
        model = models[int(key or 6)]
        load_weights(model, start)
        train_local(model, x, y, spec, seed=seed)
        weights = model_weights(model)
        if out is not None:
            out[key] = weights
        return weights

    alone = trained(1)
    together: dict[str, dict] = {}
    threads = [threading.Thread(target=trained, args=(1 + i % 2, together, str(i)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(0, 6, 2):
        assert all(np.array_equal(alone[k], together[str(i)][k]) for k in alone), i
    assert any(not np.array_equal(alone[k], together["1"][k]) for k in alone)


def test_dropout_masks_seed_the_generator_of_the_models_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU generator always (the shuffle's device-independent draws are not it: its
    own Generator), a CUDA model's device generator too, with the same value, inside a
    fork of exactly those devices' states; never torch.manual_seed's every backend."""
    from worker import training

    forked: list[list[int]] = []
    seeded: dict[int, int] = {}

    class Gen:
        def __init__(self, index: int) -> None:
            self.index = index

        def manual_seed(self, value: int) -> None:
            seeded[self.index] = value

    real_fork = torch.random.fork_rng

    def fork(devices: list[int]) -> object:
        forked.append(list(devices))
        return real_fork(devices=[])

    monkeypatch.setattr(torch.random, "fork_rng", fork)
    monkeypatch.setattr(torch.cuda, "default_generators", (Gen(0), Gen(1)), raising=False)
    monkeypatch.setattr(torch, "manual_seed", lambda _v: pytest.fail("torch.manual_seed"))
    with training._masks_seeded(3, 7, torch.device("cuda", 1)):
        cpu_value = torch.default_generator.initial_seed()
    assert forked == [[1]] and seeded == {1: cpu_value} and cpu_value == 3 * 1_000_003 + 7
    with training._masks_seeded(3, 8, torch.device("cpu")):
        assert torch.default_generator.initial_seed() == 3 * 1_000_003 + 8
    assert forked[-1] == [] and seeded == {1: cpu_value}


def _one_full_batch_step(spec: TrainingSpec, global_weights: dict | None = None) -> dict:
    x, y = _blobs(30)
    model = _mlp()
    train_local(model, x, y, replace(spec, number_of_epochs=1, batch_size=30, min_batches_per_epoch=0),
                seed=0, global_weights=global_weights)
    return model_weights(model)


def test_an_epochs_batches_are_near_equal_and_a_small_client_gets_more_of_them() -> None:
    def sizes(n: int, batch_size: int, min_batches: int = 0) -> list[int]:
        starts = batch_starts(n, batch_size, min_batches)
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    assert sizes(82, 16) == [14, 13, 14, 14, 13, 14]   # was 16 x 5 and a batch of 2
    assert sizes(64, 16, 4) == [16] * 4                  # enough data: the job's batches
    assert sizes(30, 16, 4) == [8, 7, 7, 8]              # 2 -> 4 steps, each >= MIN_BATCH
    assert sizes(30, 16, 8) == [4, 5, 4, 4, 4, 5, 4]     # 7: as many as keep MIN_BATCH
    assert sizes(100, 64, 4) == [25] * 4
    assert min(sizes(20, 16, 4)) >= MIN_BATCH
    assert sizes(30, 16) == [15, 15]                     # 0: ceil(n / batch_size) batches
    assert sizes(5, 2) == [2, 3] and sizes(3, 1) == [1, 1, 1] and sizes(1, 16) == [1]
    assert sizes(17, 16) == [8, 9]                       # was 16 and a batch of one
    steps = []
    model = _mlp()
    model.register_forward_hook(lambda module, args, out: steps.append(len(args[0])))
    x, y = _blobs(30)
    train_local(model, x, y, TrainingSpec(number_of_epochs=1, batch_size=16), seed=0)
    # the default 8: 7 batches keep MIN_BATCH, so the epoch passes twice (reshuffled)
    assert steps == [4, 5, 4, 4, 4, 5, 4] * 2
    # a model with BatchNorm: half as many, of MIN_BATCH_NORM or more (batch statistics)
    steps.clear()
    norm = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 3))
    norm.register_forward_hook(lambda module, args, out: steps.append(len(args[0])))
    train_local(norm, x, y, TrainingSpec(number_of_epochs=1, batch_size=16), seed=0)
    assert steps == [10, 10, 10] * 2 and MIN_BATCH_NORM == 8
    steps.clear()                                      # enough samples: one pass
    train_local(model, *_blobs(64), TrainingSpec(number_of_epochs=1, batch_size=8), seed=0)
    assert steps == [8] * 8


def test_fedprox_term_matches_a_hand_computed_sgd_step() -> None:
    lr, mu = 0.1, 0.5
    start = model_weights(_mlp())
    anchor = {k: v + 1.0 for k, v in start.items()}  # w - w_global = -1 everywhere
    plain = _one_full_batch_step(TrainingSpec(learning_rate=lr))
    prox = _one_full_batch_step(TrainingSpec(learning_rate=lr, fedprox_mu=mu), anchor)
    # grad of mu/2 ||w - wg||^2 is mu (w - wg) = -mu, so the step adds lr * mu
    for k in start:
        np.testing.assert_allclose(prox[k] - plain[k], lr * mu, rtol=1e-4, atol=1e-6)


def test_fedprox_without_global_weights_anchors_at_entry_weights() -> None:
    x, y = _blobs()
    spec = TrainingSpec(number_of_epochs=5, batch_size=8, learning_rate=0.1)
    start = model_weights(_mlp())

    def drift(mu: float) -> float:
        model = _mlp()
        train_local(model, x, y, replace(spec, fedprox_mu=mu), seed=0)
        w = model_weights(model)
        return float(sum(((w[k] - start[k]) ** 2).sum() for k in w))

    assert drift(5.0) < 0.5 * drift(0.0)


def test_weight_decay_matches_a_hand_computed_sgd_step() -> None:
    lr, wd = 0.1, 0.2
    start = model_weights(_mlp())
    plain = _one_full_batch_step(TrainingSpec(learning_rate=lr))
    decayed = _one_full_batch_step(TrainingSpec(learning_rate=lr, weight_decay=wd))
    for k in start:
        np.testing.assert_allclose(decayed[k] - plain[k], -lr * wd * start[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("optimizer", "momentum", "weight_decay"),
                         [("sgd", 0.0, 0.0), ("sgd", 0.9, 1e-3), ("adam", 0.0, 0.0),
                          ("adam", 0.0, 1e-3)])
def test_the_local_optimizer_is_torch_optims_update_bit_for_bit(
        optimizer: str, momentum: float, weight_decay: float) -> None:
    """The same weights as torch.optim's SGD / Adam after 30 steps, every other one with a
    layer left without a gradient (it keeps its own step count and momentum)."""
    x, y = _blobs()
    ours, theirs = _mlp(), _mlp()
    spec = TrainingSpec(optimizer=optimizer, learning_rate=0.05, momentum=momentum,
                        weight_decay=weight_decay)
    local = make_optimizer(ours, spec)
    if optimizer == "sgd":
        torch_opt: torch.optim.Optimizer = torch.optim.SGD(
            theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    else:
        torch_opt = torch.optim.Adam(theirs.parameters(), lr=0.05, weight_decay=weight_decay)
    first = next(ours.parameters())
    for step in range(30):
        batch = slice(4 * step, 4 * step + 8)
        for model, opt in ((ours, local), (theirs, torch_opt)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.from_numpy(x[batch])),
                                              torch.from_numpy(y[batch])).backward()
            if step % 2:
                next(model.parameters()).grad = None
            opt.step()
    assert not torch.equal(first, next(_mlp().parameters()))
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_training_leaves_torch_dynamo_unimported() -> None:
    """What LocalOptimizer is for: an executor or Ray actor that trains never imports
    torch._dynamo (torch.optim does at its first use: 1 s of CPU and 70 MB a process)."""
    code = ("import sys, numpy as np\n"
            "from proto.job import ModelSpec, TrainingSpec\n"
            "from worker.models import build_model\n"
            "from worker.training import train_local\n"
            "model = build_model(ModelSpec(name='mlp', hidden=8), (2,), 3, seed=0)\n"
            "for kind in ('sgd', 'adam'):\n"
            "    train_local(model, np.zeros((16, 2), np.float32), np.arange(16) % 3,\n"
            "                TrainingSpec(optimizer=kind, momentum=0.9), seed=0)\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_evaluate_by_hand() -> None:
    model = torch.nn.Linear(2, 2, bias=False)
    load_weights(model, {"weight": np.eye(2, dtype=np.float32)})
    x = np.array([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0], [0.0, 0.0]], dtype=np.float32)
    y = np.array([0, 1, 1, 0])
    result = evaluate(model, x, y)
    logits = x.astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    expected_loss = -logp[np.arange(4), y].mean()
    # argmax: 0, 1, 0, 0 (tie -> first) -> 3 of 4 correct
    assert result.accuracy == 0.75 and result.num_samples == 4
    assert result.loss == pytest.approx(expected_loss, rel=1e-5)


def test_held_out_choice_keeps_the_received_model_unless_the_trained_one_is_shown_better(
        ) -> None:
    """Leave-one-out: each sample is scored by the trained model only where it got more of
    the other samples right than the received one; a tie keeps the received model, and a
    sample's own outcome never decides which model scores it."""
    better = np.array([True, True, True, False])
    worse = np.array([False, True, False, False])
    assert held_out_choice(better, worse).tolist() == [True, True, True, False]  # trained
    assert held_out_choice(worse, better).tolist() == better.tolist()  # received everywhere
    even = np.array([True, False, True, False])
    assert held_out_choice(even, better).tolist() == better.tolist()  # ties and less
    # the trained model is right on sample 3 only; on the others it is worse, but
    # sample 3's choice sees samples 0-2, where it trails: received's miss is scored
    lucky = np.array([False, False, False, True])
    steady = np.array([True, True, False, False])
    assert held_out_choice(lucky, steady).tolist() == steady.tolist()
    assert held_out_choice(np.zeros(0, bool), np.zeros(0, bool)).shape == (0,)


def test_label_offsets_shift_a_balanced_model_to_a_clients_label_mix() -> None:
    """A model of two equally likely classes (threshold at 0), a client whose samples are
    90% class 0: the offsets are the log of its (Laplace) label prior against a uniform
    one, they move the threshold its way, and its held-out samples (the same mix, other
    draws) are scored better; a class the client never saw keeps a finite offset."""
    model = torch.nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[-1.0], [1.0]]))
        model.bias.zero_()
    rng = np.random.default_rng(0)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = (rng.random(n) < 0.1).astype(np.int64)
        return (rng.normal(0.0, 1.0, n) + np.where(y == 1, 0.5, -0.5))[:, None], y

    _, y_train = draw(200)
    x_test, y_test = draw(2000)
    offsets = label_offsets(y_train, 2)
    counts = np.bincount(y_train, minlength=2) + LABEL_PRIOR  # 2 x LABEL_PRIOR samples, 1:1
    assert offsets.numpy() == pytest.approx(np.log(counts / counts.sum() * 2), rel=1e-6)
    plain = sample_scores(model, x_test, y_test)[1].mean()
    fitted = sample_scores(model, x_test, y_test, offsets)[1].mean()
    assert fitted > plain + 0.1                   # ~0.9 against ~0.6
    unseen = label_offsets(np.zeros(20, dtype=np.int64), 3)
    assert torch.isfinite(unseen).all() and unseen[1] == unseen[2] < 0 < unseen[0]
    assert label_offsets(np.zeros(0, dtype=np.int64), 4).abs().sum() == 0
    # against the mix the model learned: a client with that mix needs (next to) no shift,
    # one with a uniform mix is shifted away from it, a client of few samples less than
    # its counts say (its prior starts from the learned mix); a pooled mix of other
    # classes is ignored
    mix = np.bincount(y_train, minlength=2)
    # (the learned mix is the pool's counts + 1: 22 / 202 for 21 samples of 200 here)
    assert label_offsets(y_train, 2, tuple(mix)).abs().max() < 0.05
    learned = (mix + 1.0) / (mix.sum() + 2.0)
    away = label_offsets(np.array([0, 1]), 2, tuple(mix)).numpy()
    prior = np.array([1.0, 1.0]) + 2 * LABEL_PRIOR * learned
    assert away == pytest.approx(np.log(prior / prior.sum()) - np.log(learned), rel=1e-6)
    assert (np.abs(away) < np.abs(np.log(0.5 / learned))).all()
    assert torch.equal(label_offsets(y_train, 2, (5, 5, 5)), offsets)


def test_empty_data_and_bad_settings() -> None:
    model = _mlp()
    empty_x, empty_y = np.zeros((0, 2), np.float32), np.zeros(0, np.int64)
    assert train_local(model, empty_x, empty_y, TrainingSpec(), seed=0).num_samples == 0
    assert evaluate(model, empty_x, empty_y).num_samples == 0
    x, y = _blobs(10)
    with pytest.raises(TrainingError, match="optimizer 'rmsprop' is unknown; use one of sgd, adam"):
        train_local(model, x, y, TrainingSpec(optimizer="rmsprop"), seed=0)
    with pytest.raises(TrainingError, match="batch_size"):
        train_local(model, x, y, TrainingSpec(batch_size=0), seed=0)
    with pytest.raises(TrainingError, match="x has 10 samples but y has 9"):
        evaluate(model, x, y[:-1])
    with pytest.raises(TrainingError, match="no tensor 'net.1.weight'"):
        train_local(model, x, y, TrainingSpec(fedprox_mu=0.1), seed=0, global_weights={})


def test_batchnorm_statistics_are_the_layers_own_on_the_data_and_change_nothing() -> None:
    """One batch: the running mean and (unbiased) variance of the BatchNorm layer's input
    over x, whatever the layer held before; dropout off; the model's own statistics, its
    momentum and mode are as they were."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                              torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    net[1].running_mean.fill_(7.0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = np.random.default_rng(0).normal(2.0, 3.0, (100, 3)).astype(np.float32)
    stats = batchnorm_statistics(net, x)
    with torch.no_grad():
        h = net[0](torch.from_numpy(x))
    assert set(stats) == {"1.running_mean", "1.running_var"}
    np.testing.assert_allclose(stats["1.running_mean"], h.mean(0).numpy(), rtol=1e-5)
    np.testing.assert_allclose(stats["1.running_var"], h.var(0, unbiased=True).numpy(),
                               rtol=1e-4)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net[1].momentum == 0.1 and not net.training
    assert batchnorm_statistics(_mlp(), x[:, :2]) == {}


def test_a_batchnorm_layer_normalizes_a_thin_batch_with_its_running_statistics() -> None:
    """A batch that gives a BatchNorm layer fewer than MIN_BATCH_NORM values per channel:
    that layer normalizes with its running statistics and keeps them; a convolution's
    layer over the same 4 samples (4 x 16 values a channel) uses the batch's, as usual."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.BatchNorm2d(2), torch.nn.Flatten(),
        torch.nn.Linear(32, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    conv_norm, dense_norm = model[1], model[4]
    modes: dict[str, list[bool]] = {"conv": [], "dense": []}
    # forward hooks: they run after training's own pre-hook, before it restores the mode
    conv_norm.register_forward_hook(lambda m, args, out: modes["conv"].append(m.training))
    dense_norm.register_forward_hook(lambda m, args, out: modes["dense"].append(m.training))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = np.random.default_rng(0).normal(size=(4, 1, 4, 4)).astype(np.float32)
    train_local(model, x, np.array([0, 1, 0, 1]), TrainingSpec(number_of_epochs=1, batch_size=16),
                seed=0)
    assert modes["dense"] and not any(modes["dense"]) and all(modes["conv"]), modes
    assert torch.equal(model.state_dict()["4.running_mean"], before["4.running_mean"])
    assert torch.equal(model.state_dict()["4.running_var"], before["4.running_var"])
    assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
    assert conv_norm.training and dense_norm.training  # left in training mode, as it came
    assert not torch.equal(model.state_dict()["4.weight"], before["4.weight"])  # still trains


def test_clients_of_a_few_samples_of_one_class_train_a_batchnorm_model_together() -> None:
    """Plain FedAvg over 40 clients of 3-5 samples, each of a single class, a dense model
    with BatchNorm. Normalized by its batch's own statistics, a client's batch lost what
    told its samples from the other class's, and the model ended at 0.5 (seeds 0-2: 0.55,
    0.51, 0.53); with the running statistics it reaches 0.95-1.0."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    x = (rng.normal(0, 1, (2, 10))[y] + rng.normal(0, 1, (400, 10))).astype(np.float32)
    clients = [np.flatnonzero(y[:300] == c % 2)[(c // 2) * 5:(c // 2) * 5 + 3 + c % 3]
               for c in range(40)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 2))
    weights = model_weights(model)
    for r in range(6):
        total = {k: np.zeros(v.shape) for k, v in weights.items()}
        samples = 0
        for i, idx in enumerate(clients):
            load_weights(model, weights)
            result = train_local(model, x[idx], y[idx],
                                 TrainingSpec(number_of_epochs=2, batch_size=16), seed=100 * r + i)
            for k, v in model_weights(model).items():
                total[k] += v * result.num_samples
            samples += result.num_samples
        weights = {k: (v / samples).astype(weights[k].dtype) for k, v in total.items()}
    load_weights(model, weights)
    assert evaluate(model, x[300:], y[300:]).accuracy >= 0.9


def test_a_model_normalizing_by_its_batch_scores_few_samples_after_context() -> None:
    """BatchNorm without running statistics normalizes by the batch in eval mode too: a
    client's four held-out samples are scored after its training samples in one batch
    (`context`), as they would be among them; without context, by their own statistics.
    A model with running statistics ignores the context."""
    torch.manual_seed(0)
    untracked = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8, track_running_stats=False),
                              torch.nn.ReLU(), torch.nn.Linear(8, 2))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    y = np.array([0, 1, 0, 1])
    context = rng.normal(size=(40, 3)).astype(np.float32)
    losses, _ = sample_scores(untracked, x, y, context=context)
    untracked.eval()
    with torch.no_grad():
        logits = untracked(torch.tensor(np.concatenate([context, x])))[40:]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="none").numpy()
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    alone, _ = sample_scores(untracked, x, y)
    assert not np.allclose(alone, losses)
    tracked = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    np.testing.assert_array_equal(sample_scores(tracked, x, y, context=context)[0],
                                  sample_scores(tracked, x, y)[0])
