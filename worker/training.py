"""Local training and evaluation of a torch model on numpy arrays.

Deterministic for a given seed: batches are shuffled with a private `torch.Generator`.
Dropout layers draw their masks from torch's global generator, shared by every thread of
the process: a model with them runs its forward passes one thread at a time, the global
generator seeded per batch from (seed, step) (`_masks_seeded`), so its masks do not depend
on what else ran in the process, nor on the thread schedule. Thread count is the caller's
business.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedcore.data import preflight as preflight_bounds
from worker.errors import WorkerError
from worker.models.registry import GLOBAL_RNG, batchnorm_layers

if TYPE_CHECKING:
    from proto.job import TrainingSpec

log = logging.getLogger(__name__)

OPTIMIZERS = ("sgd", "adam")
EVAL_BATCH_SIZE = 1024
#: label_offsets: samples of the learned label mix per class added to a client's own counts
LABEL_PRIOR = 2.0
#: the cosine schedule ends at this share of training.learning_rate, not at 0: the last
#: rounds still fine-tune each client (personalized accuracy is its model after them).
#: Measured (bench_learning): floor 0 / 0.1 / 0.3 give the digits demo 0.916 / 0.922 /
#: 0.936 global and 0.913 / 0.965 / 0.965 personalized, MNIST's CNN 0.904 / 0.907 / 0.913
COSINE_FLOOR = 0.3


class TrainingError(WorkerError, ValueError):
    """Training settings or inputs are unusable; the message names the setting."""


@dataclass(frozen=True)
class TrainResult:
    """`num_samples` trained on (the aggregation weight); `loss` = mean cross-entropy over
    the last epoch, without the FedProx term (0.0 when there was nothing to train on)."""

    num_samples: int
    loss: float


@dataclass(frozen=True)
class EvalResult:
    """Accuracy and mean cross-entropy on `num_samples` samples (both 0.0 when empty)."""

    accuracy: float
    loss: float
    num_samples: int


def _tensors(x: np.ndarray, y: np.ndarray, device: torch.device | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    x_arr, y_arr = np.asarray(x), np.asarray(y)
    if len(x_arr) != len(y_arr):
        raise TrainingError(f"x has {len(x_arr)} samples but y has {len(y_arr)}")
    xt = torch.tensor(np.ascontiguousarray(x_arr, dtype=np.float32), device=device)
    yt = torch.tensor(np.ascontiguousarray(y_arr, dtype=np.int64), device=device)
    return xt, yt


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters live (the data goes there too); cpu if it has none."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def choose_device(device: str) -> torch.device:
    """`training.device` on this process: `cpu`; `cuda` (the first visible GPU; an error
    naming the key when none is visible); `auto` (cuda when one is visible, else cpu)."""
    if device == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if device == "auto":
        return torch.device("cpu")
    import os

    raise TrainingError(
        "training.device = 'cuda' but this actor sees no CUDA device (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}); a Ray actor sees the GPUs "
        "of its training.num_gpus reservation only: check the cluster has GPUs with a CUDA "
        "build of torch, or use device = 'auto'")


def round_training(training: TrainingSpec, round_index: int) -> TrainingSpec:
    """`training` with the learning rate of round `round_index` (1-based) under
    `training.lr_schedule`: constant, or a cosine over the job's rounds (round 1 trains at
    `learning_rate`, the last near COSINE_FLOOR of it)."""
    schedule = getattr(training, "lr_schedule", "constant")
    if schedule == "constant":
        return training
    if schedule != "cosine":
        raise TrainingError(f"training.lr_schedule {schedule!r} is unknown; use constant or cosine")
    rounds = max(1, int(training.federated_learning_rounds))
    progress = min(max(round_index - 1, 0), rounds) / rounds
    factor = COSINE_FLOOR + (1.0 - COSINE_FLOOR) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return replace(training, learning_rate=float(training.learning_rate) * factor)


class LocalOptimizer:
    """SGD (momentum, weight decay) or Adam, op for op torch.optim's single-tensor update
    (its choice on the CPU; test: the same weights over many steps). torch.optim imports
    torch._dynamo at an optimizer's first use, only to mark its methods as not to be
    compiled: 1 s of CPU and 70 MB in every executor and Ray actor that trains, here where
    nothing is compiled."""

    def __init__(self, params: Iterator[nn.Parameter], kind: str, lr: float,
                 momentum: float, weight_decay: float) -> None:
        self.params, self.kind, self.lr = list(params), kind, lr
        self.momentum, self.weight_decay = momentum, weight_decay
        self.state: list[list[torch.Tensor]] = [[] for _ in self.params]
        self.steps = [0] * len(self.params)  # Adam's, each parameter's own (as torch's)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, (p, state) in enumerate(zip(self.params, self.state, strict=True)):
            if p.grad is None:
                continue
            self.steps[i] += 1
            grad = p.grad if self.weight_decay == 0 else p.grad.add(p, alpha=self.weight_decay)
            if self.kind == "adam":
                self._adam(p, grad, state, self.steps[i])
            elif self.momentum == 0:
                p.add_(grad, alpha=-self.lr)
            else:
                if state:
                    state[0].mul_(self.momentum).add_(grad, alpha=1)
                else:
                    state.append(grad.detach().clone())
                p.add_(state[0], alpha=-self.lr)

    def _adam(self, p: torch.Tensor, grad: torch.Tensor, state: list[torch.Tensor], t: int,
              beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        if not state:
            state += [torch.zeros_like(p, memory_format=torch.preserve_format) for _ in "mv"]
        mean, square = state
        mean.lerp_(grad, 1 - beta1)
        square.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (square.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
        p.addcdiv_(mean, denom, value=-(self.lr / (1 - beta1**t)))


def make_optimizer(model: nn.Module, training: TrainingSpec) -> LocalOptimizer:
    """The optimizer `training.optimizer` over the model's parameters."""
    lr, wd = float(training.learning_rate), float(training.weight_decay)
    if not lr > 0:
        raise TrainingError(f"training.learning_rate must be positive, got {lr}")
    if training.optimizer not in OPTIMIZERS:
        raise TrainingError(f"training.optimizer {training.optimizer!r} is unknown; "
                            f"use one of {', '.join(OPTIMIZERS)}")
    return LocalOptimizer(model.parameters(), training.optimizer, lr,
                          float(training.momentum), wd)


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    training: TrainingSpec,
    *,
    seed: int,
    global_weights: Mapping[str, np.ndarray] | None = None,
) -> TrainResult:
    """Train `model` in place for `training.number_of_epochs` epochs on (x, y).

    Mini-batches of at most `training.batch_size`, of near-equal sizes (`batch_starts`;
    more and smaller ones on a small client), shuffled each epoch from `seed`. With
    `training.fedprox_mu > 0` the loss gains mu/2 * ||w - w_global||^2, where w_global is
    `global_weights` (by parameter name) or, if None, the model's weights on entry.
    """
    xt, yt = _tensors(x, y, model_device(model))
    n = len(yt)
    epochs, batch_size = int(training.number_of_epochs), int(training.batch_size)
    if epochs < 0:
        raise TrainingError(f"training.number_of_epochs must be >= 0, got {epochs}")
    if batch_size < 1:
        raise TrainingError(f"training.batch_size must be >= 1, got {batch_size}")
    mu = float(training.fedprox_mu)
    if mu < 0:
        raise TrainingError(f"training.fedprox_mu must be >= 0, got {mu}")
    optimizer = make_optimizer(model, training)
    if n == 0 or epochs == 0:
        return TrainResult(num_samples=n, loss=0.0)

    anchors = _proximal_anchors(model, global_weights) if mu > 0 else []
    gen = torch.Generator().manual_seed(int(seed))
    model.train()
    # the shuffle is drawn on the cpu (the same order on every device), then indexes there
    last_loss = 0.0
    least = int(getattr(training, "min_batches_per_epoch", 0))
    norm = bool(batchnorm_layers(model))
    least = (least + 1) // 2 if norm else least
    starts = batch_starts(n, batch_size, least, MIN_BATCH_NORM if norm else MIN_BATCH)
    # a client too small for `least` batches of MIN_BATCH goes over its samples again
    # (reshuffled) until it took `least` steps an epoch (measured: below MIN_BATCH)
    passes = max(1, -(-least // (len(starts) - 1)))
    dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())
    step = 0
    with _thin_batches_normalized_by_running_statistics(model):
        for _ in range(epochs * passes):
            order = torch.randperm(n, generator=gen).to(xt.device)
            total = 0.0
            for start, end in zip(starts, starts[1:], strict=False):
                batch = order[start:end]
                optimizer.zero_grad()
                step += 1
                with _masks_seeded(seed, step, xt.device) if dropout else nullcontext():
                    data_loss = F.cross_entropy(model(xt[batch]), yt[batch])
                loss = data_loss
                if anchors:
                    prox = sum(((p - a) ** 2).sum() for p, a in anchors)
                    loss = data_loss + 0.5 * mu * prox
                loss.backward()
                optimizer.step()
                total += float(data_loss.detach()) * len(batch)
            last_loss = total / n
    if not math.isfinite(last_loss):
        log.warning("event=train_diverged samples=%d loss=%s lr=%s", n, last_loss,
                    training.learning_rate)
    return TrainResult(num_samples=n, loss=last_loss)


#: the smallest mini-batch `batch_starts` makes to reach `min_batches`. A model with
#: BatchNorm takes half of `min_batches_per_epoch`, each of at least MIN_BATCH_NORM
#: samples: its batch statistics over fewer are noise (MNIST BNCNN, beta 0.1, 100
#: clients, reference FedAvg: 0.932 at 4 batches down to 8, 0.900 at 8 down to 8; 0.858
#: with batches down to 2). A model without gains the steps (digits SmallCNN, beta 0.3,
#: 50 clients: 0.368 at 4 batches down to 8, 0.359 at 8 down to 8, 0.755 at 8 down to 4)
MIN_BATCH = 4
MIN_BATCH_NORM = 8
# train_local's passes: an epoch on a client too small for `min_batches_per_epoch`
# batches of MIN_BATCH (MIN_BATCH_NORM) samples passes over them again, reshuffled,
# until it took that many steps (14 samples: 3 passes of 3 batches). Reference FedAvg
# loop, 15 rounds x 2 epochs, one pass -> these: digits SmallCNN beta 0.3 / 100 clients
# 0.273 -> 0.841, / 50 0.755 -> 0.880, BNMLP / 50 0.944 -> 0.961, MNIST BNCNN beta 0.1 /
# 100 0.932 -> 0.938, digits BNCNN beta 0.3 / 100 0.877 -> 0.975, table mlp / 20 0.974 ->
# 0.965 (one test sample), BNMLP 0.858 -> 0.867


def batch_starts(n: int, batch_size: int, min_batches: int = 0, min_batch: int = MIN_BATCH
                 ) -> list[int]:
    """Boundaries of an epoch's mini-batches over n samples: ceil(n / batch_size) batches,
    or more on a small client so that there are at least `min_batches` (while each keeps
    `min_batch` samples), all of near-equal sizes, never one of a single sample unless
    `batch_size` is 1 or n is.

    Near-equal: a tail batch of a few samples is BatchNorm's trap. 82 samples at 16 ended
    each epoch on a batch of 2 whose statistics are noise; in the last round of a digits
    BNCNN job (beta 0.1, 20 clients, star fedavg) one client's running variance went to 38
    on it, and the federation's model from 0.84 to chance. `min_batches`: a client of 30
    samples at batch 16 took 2 steps an epoch, with momentum restarting every round, and a
    CNN without normalization sat at chance in plain FedAvg (digits SmallCNN, 50 clients,
    beta 1.0: reference loop 0.18, centralized 0.98; 0.50 at 4 batches)."""
    if n <= 0:
        return [0]
    count = math.ceil(n / batch_size)
    if min_batches > 0:
        count = max(count, min(min_batches, n // max(1, min_batch)))
    if batch_size >= 2:
        count = min(count, n // 2)
    count = max(count, 1)
    return [round(i * n / count) for i in range(count + 1)]


@contextmanager
def _masks_seeded(seed: int, step: int, device: torch.device) -> Iterator[None]:
    """Hold torch's global generator, seeded from (seed, step), for one forward pass.
    Only the generator that draws the masks, of the model's `device` (the CPU's; a CUDA
    device's own too), saved and restored around it: `torch.manual_seed` seeds every
    accelerator backend it can import, about 280 us a call against 1 us (on a CPU-only
    build each lazy seeder formats a stack trace), under GLOBAL_RNG, once per mini-batch,
    with the clients' threads queued on the lock: 1.65 x the training time of 96 small
    clients (bench_training_step)."""
    value = (int(seed) * 1_000_003 + step) % 2**63
    cuda = [device.index or 0] if device.type == "cuda" else []
    with GLOBAL_RNG, torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(value)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(value)
        yield


@contextmanager
def _thin_batches_normalized_by_running_statistics(model: nn.Module) -> Iterator[None]:
    """While training: a BatchNorm layer whose batch gives it fewer than MIN_BATCH_NORM
    values per channel (a dense layer's batch of 7 samples; a convolution's 2 samples of
    8x8 give 128) normalizes with its running statistics, as in eval mode, and leaves them
    as they are; every layer on a batch of one sample. Its batch statistics would be noise, and
    over a label-skewed client's few samples they take out the very differences between
    classes the layer should pass on: breast-cancer table, BatchNorm MLP, 100 clients of
    4-5 samples, reference FedAvg loop (seeds 0 / 1 / 2), the model flipped between the two
    classes round after round and ended at 0.628 / 0.735 / 0.628 (centralized 0.956);
    with this rule 0.956 / 0.956 / 0.938. Normalizing with the running statistics from
    16 values down cost digits and MNIST models with a dense BatchNorm up to 0.12."""
    norms = [m for _, m in batchnorm_layers(model) if m.training]
    switched: list[nn.Module] = []

    def before(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0]
        if x.shape[0] == 1 or x.numel() // max(1, x.shape[1]) < MIN_BATCH_NORM:
            module.training = False
            switched.append(module)

    def after(module: nn.Module, inputs: object, output: object) -> None:
        if switched and switched[-1] is module:
            switched.pop()
            module.training = True

    handles = [h for m in norms
               for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in norms:
            m.train()


def _proximal_anchors(
    model: nn.Module, global_weights: Mapping[str, np.ndarray] | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    anchors: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if global_weights is None:
            anchor = param.detach().clone()
        elif name in global_weights:
            anchor = torch.tensor(np.asarray(global_weights[name]), dtype=param.dtype,
                                  device=param.device)
            if anchor.shape != param.shape:
                raise TrainingError(
                    f"global_weights[{name!r}] has shape {tuple(anchor.shape)}, the model "
                    f"parameter has {tuple(param.shape)}"
                )
        else:
            raise TrainingError(f"global_weights has no tensor {name!r} for the FedProx term")
        anchors.append((param, anchor))
    return anchors


def batchnorm_statistics(model: nn.Module, x: np.ndarray, batch_size: int = 256
                         ) -> dict[str, np.ndarray]:
    """The running means and variances `model`'s BatchNorm layers have on `x`: each layer's
    cumulative average over the batches, dropout off, no gradient; the model is left in
    eval mode with its own statistics as they were. {} for a model without such layers
    or fewer than 2 samples."""
    norms = [(name, m) for name, m in batchnorm_layers(model) if m.track_running_stats]
    if not norms or len(x) < 2:
        return {}
    saved = [(m, m.momentum, {k: v.clone() for k, v in m.state_dict().items()})
             for _, m in norms]
    xt = torch.tensor(np.ascontiguousarray(x, dtype=np.float32), device=model_device(model))
    out: dict[str, np.ndarray] = {}
    model.eval()
    try:
        for _, m in norms:
            m.reset_running_stats()
            m.momentum = None   # a cumulative average over the batches
            m.train()
        with torch.no_grad():
            starts = batch_starts(len(xt), batch_size)
            for start, end in zip(starts, starts[1:], strict=False):
                model(xt[start:end])
        for name, m in norms:
            prefix = f"{name}." if name else ""
            state = m.state_dict()
            for key in ("running_mean", "running_var"):
                out[prefix + key] = state[key].detach().cpu().numpy().copy()
    finally:
        for m, momentum, state in saved:
            m.momentum = momentum
            m.load_state_dict(state)
        model.eval()
    return out


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray) -> EvalResult:
    """Accuracy and mean cross-entropy of `model` on (x, y), in eval mode, without gradients."""
    losses, hits = sample_scores(model, x, y)
    if not len(hits):
        return EvalResult(accuracy=0.0, loss=0.0, num_samples=0)
    return EvalResult(accuracy=float(hits.mean()), loss=float(losses.mean()),
                      num_samples=len(hits))


def sample_scores(model: nn.Module, x: np.ndarray, y: np.ndarray,
                  offsets: torch.Tensor | None = None, context: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per sample of (x, y): `model`'s cross-entropy and whether its top class is right (its
    outputs plus per-class `offsets`, if given: `label_offsets`); in eval mode, without
    gradients. A model with a BatchNorm layer that keeps no running statistics normalizes
    by the batch's own, also in eval mode: over a client's few held-out samples that is
    noise, so they go through it after `context` samples (the client's training ones) in
    one batch (digits, 20 clients, beta 0.3, 8 rounds, such an MLP: personalized 0.748
    under star FedAvg and 0.810 under FedAdam, against the global model's 0.950 / 0.955 on
    the test set; with the client's training samples as context 0.962 / 0.955)."""
    xt, yt = _tensors(x, y, model_device(model))
    shift = None if offsets is None else offsets.to(xt.device)
    by_batch = context is not None and len(context) > 0 and any(
        not m.track_running_stats for _, m in batchnorm_layers(model))
    lead = (torch.tensor(np.ascontiguousarray(context[: EVAL_BATCH_SIZE // 2],
                                              dtype=np.float32), device=xt.device)
            if by_batch and context is not None else None)
    step = EVAL_BATCH_SIZE if lead is None else EVAL_BATCH_SIZE - len(lead)
    was_training = model.training
    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for start in range(0, len(yt), step):
            chunk = xt[start : start + step]
            logits = (model(chunk) if lead is None
                      else model(torch.cat([lead, chunk]))[len(lead):])
            if shift is not None:
                logits = logits + shift
            target = yt[start : start + step]
            losses.append(F.cross_entropy(logits, target, reduction="none").cpu().numpy())
            hits.append((logits.argmax(dim=1) == target).cpu().numpy())
    model.train(was_training)
    if not losses:
        return np.zeros(0), np.zeros(0, dtype=bool)
    return np.concatenate(losses).astype(np.float64), np.concatenate(hits)


def label_offsets(y: np.ndarray, classes: int, pooled: Sequence[int] = ()) -> torch.Tensor:
    """Per-class offsets to a model's outputs for a client whose labels are `y`: log of the
    client's label prior against the one the model learned, the label-shift correction
    (Saerens et al. 2002). The client's prior is its label counts plus LABEL_PRIOR x classes
    samples of the learned mix (a Dirichlet prior around it): a client of a few samples is
    shifted less than its counts say. Against Laplace's counts + 1 (the reference FedAvg
    loop's final model, chosen against each client's trained model; the final model alone
    in brackets): digits BNCNN beta 0.3, 100 clients 0.958 -> 0.965 (0.976), 50 clients
    0.983 -> 0.986 (0.962), BNMLP beta 0.1 / 50 0.972 -> 0.983 (0.951), SmallCNN beta 0.3 /
    50 0.937 -> 0.937 (0.885), MNIST SmallCNN beta 0.3 / 50 0.957 -> 0.957 (0.927), the
    breast-cancer table BNMLP beta 0.3 at 100 clients 0.974 -> 0.987 (0.987) and 20 clients
    0.967 -> 0.978 (0.891), mlp beta 0.1 / 100 0.973 both (0.987); 4 x classes samples:
    0.976 / 0.986 / 0.997 / 0.927 / 0.956 / 0.987 / 0.967 / 0.973, half: 0.944 / 0.979 /
    0.962 / 0.941 / 0.964 / 0.974 / 0.967 / 0.973. A federation's model learned the `pooled`
    mix (label counts of every client's training samples; none given: a uniform one), a
    client's own differs (a Dirichlet split). Against the pooled mix rather than a uniform
    one (reference FedAvg loop, then chosen against the trained model): breast-cancer
    table BNMLP beta 0.1 / 0.3 / 1.0, 20 clients 0.956 / 0.935 / 0.944 -> 0.967 / 0.935 /
    0.956, mlp beta 0.5 1.0 -> 0.989, digits BNCNN / SmallCNN beta 0.3 / 50 0.951 / 0.829
    -> 0.955 / 0.836. Against a uniform one, on the reference FedAvg loop's final model
    against it uncorrected (chosen against the trained model either way): MNIST SmallCNN
    beta 0.3 / 50 clients 0.904 -> 0.944, digits BNMLP beta 0.1 / 50 0.934 -> 0.937,
    BNCNN beta 1.0 / 20 0.979 -> 0.983, beta 0.3 / 50 0.962 -> 0.951; where the pooled
    mix is far from uniform it overshot (breast-cancer table, 37% / 63%: 0.967 -> 0.944,
    the global model's own figure). Offsets fitted by cross-entropy on the client's
    training samples, which the model has learned, went to their bounds: 0.899 on the
    BNCNN cell."""
    learned = np.ones(classes) if len(pooled) != classes else np.asarray(pooled) + 1.0
    learned = learned / learned.sum()
    counts = (np.bincount(np.asarray(y, dtype=np.int64), minlength=classes)[:classes]
              + LABEL_PRIOR * classes * learned)
    return torch.as_tensor(np.log(counts / counts.sum()) - np.log(learned), dtype=torch.float32)


def held_out_choice(trained: np.ndarray, received: np.ndarray) -> np.ndarray:
    """Per sample, whether it is right when scored with the model a client `trained` only
    where that got more of the *other* samples right than the model it `received` (each
    model's hits on the same samples, `sample_scores`), else with the received one: a
    choice never made on the sample it is scored on (leave-one-out), and the federation's
    model unless the client's own is shown better on its held-out data."""
    own_rest = trained.sum() - trained.astype(np.int64)
    keep = own_rest > received.sum() - received.astype(np.int64)
    return np.where(keep, trained, received).astype(bool)


#: `learning_rate_trial`: training samples it trains on (drawn evenly from the data set),
#: passes over them, and the learning rates it tries: the job's, then each half of the one
#: before, down to 1/256 of the job's. At 4 halvings (1/16) a newcomer's CNN at rate 10
#: ended the trial at 0.625 still gaining (loss 6.88 at 10, NaN at 5 and 2.5, 1.1e7 at
#: 1.25, 2.42 at 0.625) and its job ran at 10, at chance
TRIAL_SAMPLES = 512
TRIAL_EPOCHS = 2
TRIAL_HALVINGS = preflight_bounds.TRIAL_HALVINGS  # (the scheduler checks sites' rates by it)
#: a trial run "learned" when its loss on its samples ends below this share of a uniform
#: guess's (ln classes): a model whose units died on too large a step ends at a uniform
#: guess exactly (its outputs no longer depend on the input)
TRIAL_LEARNED = 0.8
#: ... and learned "well" below this share: the job's rate is kept after one run. Between
#: the two its half is tried, and taken where it ends below TRIAL_LEARNED x its loss: a
#: rate at the edge of what the model takes learns a little in the trial's 64 steps and
#: then dies (MNIST Conv1dBN, seed 1, sgd 0.05: 1.676 in the trial, its half 1.145;
#: centralized at 0.05 the model sat at 0.100 after its first epoch, at 0.025 0.68-0.73)
TRIAL_GOOD = 0.5
#: ... and "diverged" when it is not finite or above this many x a uniform guess's (the
#: aggregators' DIVERGED_LOSS): the step overshoots, and its half is tried like a dead
#: model's. Measured (digits, a linear model, sgd momentum 0.9): lr 32 ends at 18.5, its
#: half at 19.9; before, the trial stopped there (the half "gained nothing") and kept 32
TRIAL_DIVERGED = 3.0
#: ... and before any rate learned, a half "gains" only where its loss ends this share of
#: a uniform guess's below the best before it (0.023 for 10 classes): a model on a
#: plateau (weights a user initialized 100 x smaller than torch's) ends every rate's run a
#: hair below a uniform guess's, 0.05 at 2.299 and its half at 2.298 (digits), and any
#: gain took the half, at which every job and the reference loop sat at 0.100 for 15
#: rounds; at 0.05 the reference loop reached 0.577 and fedadam 0.813 (stop 75). A dead
#: model's half gains far more where it learns (MNIST TutorialCNN, seed 1: 2.301 -> 2.126)
TRIAL_MIN_GAIN = 0.01


def uniform_loss(classes: int) -> float:
    """The cross-entropy of a uniform guess over `classes` (at least 2): ln classes."""
    return math.log(max(2, classes))


def trial_diverged(loss: float, uniform: float) -> bool:
    """Whether a trial run's `loss` diverged (`TRIAL_DIVERGED`)."""
    return not loss <= TRIAL_DIVERGED * uniform


@dataclass(frozen=True)
class LrTrial:
    """What `learning_rate_trial` found: the learning rate to train at (the job's unless a
    smaller one learned, or none did and a smaller one's run ended lower), and each rate's
    loss."""

    learning_rate: float
    losses: tuple[tuple[float, float], ...]
    uniform_loss: float
    #: no rate learned, and the smallest tried still gained on (or diverged like) the ones
    #: before: the rate the job needs lies below every one tried (the caller says so)
    exhausted: bool = False

    @property
    def lowered(self) -> bool:
        return bool(self.losses) and self.learning_rate != self.losses[0][0]

    @property
    def diverged(self) -> bool:
        """Every rate tried diverged (`trial_diverged`): the job's rate is far too large."""
        return bool(self.losses) and all(trial_diverged(loss, self.uniform_loss)
                                         for _, loss in self.losses)


def learning_rate_trial(build: Callable[[], nn.Module], x: np.ndarray, y: np.ndarray,
                        training: TrainingSpec, classes: int, seed: int,
                        progress: Callable[[float, float], None] | None = None) -> LrTrial:
    """Train fresh models from `build()` (the job's seeded initial model) for TRIAL_EPOCHS
    passes over up to TRIAL_SAMPLES of (x, y), at `training.learning_rate`; where that
    does not learn well (its loss ends above TRIAL_GOOD x a uniform guess's), at each half
    of it (TRIAL_HALVINGS at most) while each ends below the best loss before it (by
    TRIAL_MIN_GAIN x a uniform guess's; below TRIAL_LEARNED x it, once one learned: ended
    below TRIAL_LEARNED x a uniform guess's);
    a run that diverged (`trial_diverged`) counts as no loss at all, and its half is
    tried. The one to train at is the last of those that learned. Where none does, the
    one whose run ended lowest (the job's for a slow model or hard data, whose halves gain
    nothing either: the trial stops at the first); where none does and the smallest still
    gained (`LrTrial.exhausted`) or every run diverged (`LrTrial.diverged`), the job's, and
    the caller says so. Measured (MNIST 4,000 images, centralized, one epoch at sgd 0.05,
    momentum 0.9, batches of 16): a tutorial CNN (3x3 convolutions without bias, BatchNorm, 128 dense
    units, dropout 0.5) ends at 0.100, its loss at ln 10; at 0.01, 0.917.
    `progress(rate, loss)` after each run."""
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.permutation(len(y))[:TRIAL_SAMPLES])
    xs, ys = np.asarray(x)[pick], np.asarray(y)[pick]
    uniform = uniform_loss(classes)
    trial = replace(training, number_of_epochs=TRIAL_EPOCHS, fedprox_mu=0.0)
    lr = float(training.learning_rate)
    losses: list[tuple[float, float]] = []
    best = math.inf           # the lowest loss of the runs before that did not diverge
    chosen, lowest = lr, lr   # the last rate that learned; the one whose run ended lowest
    learned_any = False
    stopped = False           # a half gained nothing: the trial ended before its last
    for _ in range(TRIAL_HALVINGS + 1):
        model = build()
        train_local(model, xs, ys, replace(trial, learning_rate=lr), seed=seed)
        loss = evaluate(model, xs, ys).loss
        losses.append((lr, loss))
        if progress is not None:
            progress(lr, loss)
        if not trial_diverged(loss, uniform):
            # once a rate learned, a half must do markedly better; before, a gain beyond
            # noise will do (a dead model's half may be dead too, a little less: MNIST
            # TutorialCNN seed 1 2.301, its half 2.126); a half that gains nothing (or
            # less than TRIAL_MIN_GAIN) is a slow model's
            learned = best < TRIAL_LEARNED * uniform
            if not loss < (TRIAL_LEARNED * best if learned
                           else best - TRIAL_MIN_GAIN * uniform):
                stopped = True
                break
            best, lowest = loss, lr
            if loss < TRIAL_LEARNED * uniform:
                chosen, learned_any = lr, True
                if len(losses) == 1 and loss < TRIAL_GOOD * uniform:
                    break     # the job's own rate learns well: kept
        lr /= 2
    exhausted = not learned_any and not stopped
    return LrTrial(chosen if learned_any or exhausted else lowest, tuple(losses), uniform,
                   exhausted)
