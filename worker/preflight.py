"""The model half of the pre-start check, run as a child Python by
`fedcore.data.preflight.check_model_in_child` (`python -m worker.preflight SOURCE`, the job
as JSON on stdin): build the job's model for the dataset's input shape and classes and run
it once on two samples; prints {"key", "message"} and exits 2 if it fails. The scheduler
and `plan` never import this module (nor torch): they start it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fedcore.data import Dataset
from fedcore.data.preflight import PROGRESS, check_job_data
from proto.job import JobSpec, JobSpecError

if TYPE_CHECKING:
    from worker.training import LrTrial

log = logging.getLogger("fedpilot.preflight")


def check_job_inputs(spec: JobSpec, source: str) -> Dataset:
    """The job's dataset, after its model was built and run once on it; JobSpecError
    naming ``data.dataset`` or ``model.name`` otherwise."""
    dataset = check_job_data(spec, source)
    check_model(spec, source, dataset)
    return dataset


def _first_line(exc: BaseException) -> str:
    """The first line of a user error's message ("" without one), for a one-line verdict."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def check_model(spec: JobSpec, source: str, dataset: Dataset) -> int:
    """Build the model, run it once; returns the bytes of its state dict (one model
    transfer, uncompressed)."""
    import torch

    from worker.models import ModelError, build_model

    name = spec.model.name
    try:
        model = build_model(spec.model, dataset.input_shape, dataset.num_classes, seed=spec.seed)
    except ModelError as exc:
        raise JobSpecError(source, "model.name", f"model.name: {exc}") from None
    sample = torch.from_numpy(dataset.x_train[:2].copy())
    try:
        with torch.no_grad():
            out = model.eval()(sample)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        first = _first_line(exc)
        raise JobSpecError(
            source, "model.name",
            f"model.name {name!r} fails on input of shape {tuple(sample.shape)} from "
            f"{spec.data.dataset}: {type(exc).__name__}: {first}") from None
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != len(sample):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise JobSpecError(source, "model.name",
                           f"model.name {name!r} returns {shape} for {len(sample)} samples; it must "
                           "return logits of shape (batch, num_classes)")
    if out.shape[1] != dataset.num_classes:
        raise JobSpecError(
            source, "model.name",
            f"model.name {name!r} gives {out.shape[1]} outputs per sample but data.dataset "
            f"{spec.data.dataset} has {dataset.num_classes} classes; size the last layer with "
            "the num_classes argument of Class(input_shape, num_classes)")
    if returns_probabilities(out):
        print(f"{PROGRESS}warning: model.name {name!r} returns probabilities (on "
              f"{len(sample)} samples of {spec.data.dataset} every output is in [0, 1] and "
              "each row sums to 1): the clients train with cross-entropy, which takes "
              "logits, and a softmax before it flattens the gradients (digits, an MLP "
              "trained centrally for 30 epochs: 0.744 with a final Softmax, 0.958 "
              "without); drop the final Softmax (a LogSoftmax is fine)",
              file=sys.stderr, flush=True)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def returns_probabilities(out: Any) -> bool:
    """Whether a model's outputs (batch, classes >= 2) are a softmax's: every one in
    [0, 1] and each row summing to 1. Logits almost never are; log-probabilities are not
    (they are <= 0)."""
    import torch

    if out.ndim != 2 or out.shape[1] < 2 or not bool(torch.isfinite(out).all()):
        return False
    out = out.double()
    return bool((out >= 0).all() and (out <= 1).all()
                and torch.allclose(out.sum(dim=1), torch.ones(len(out), dtype=out.dtype),
                                   atol=1e-4))


def run_trial(spec: JobSpec, dataset: Dataset, source: str = "<job>",
              progress: Callable[[float, float, int], None] | None = None) -> LrTrial | None:
    """`worker.training.learning_rate_trial` of the job's model (built as the job builds
    it, from the job's seed) on its training samples as the job prepares them, for a
    model of the user's own (`module:Class`: what `submit` checks here; `plan` and a DP
    job measure a built-in model too, and a trial there would show a rate `submit` does
    not use): its `LrTrial`, None under training.learning_rate_check = "off" or without
    samples. `progress(rate, loss, samples)` after each run. JobSpecError naming
    ``model.name`` where the model fails to train (every client would fail the same)."""
    if (spec.training.learning_rate_check == "off" or not len(dataset.y_train)
            or ":" not in spec.model.name):
        return None  # the built-in models train at the defaults (bench_learning's grid)
    from fedcore.data.datasets import prepare
    from worker.models import build_model
    from worker.training import TRIAL_SAMPLES, learning_rate_trial

    data = prepare(dataset, spec.data)
    samples = min(TRIAL_SAMPLES, len(data.y_train))
    try:
        return learning_rate_trial(
            lambda: build_model(spec.model, data.input_shape, data.num_classes, seed=spec.seed),
            data.x_train, data.y_train, spec.training, data.num_classes, spec.seed,
            None if progress is None else lambda lr, loss: progress(lr, loss, samples))
    except Exception as exc:  # noqa: BLE001 - user code may raise anything
        first = _first_line(exc)
        raise JobSpecError(
            source, "model.name",
            f"model.name {spec.model.name!r} fails to train on {spec.data.dataset}: "
            f"{type(exc).__name__}: {first} (in the learning-rate trial; "
            "training.learning_rate_check = \"off\" skips it)") from None


def trial_learning_rate(spec: JobSpec, dataset: Dataset, source: str = "<job>"
                        ) -> dict[str, Any]:
    """`run_trial`'s rate and losses as `check_model_in_child` reads them; {} where no
    trial ran. JobSpecError naming ``training.learning_rate`` where every rate tried
    diverged, or none trained and the smallest still gained (`LrTrial.exhausted`)."""
    from worker.training import TRIAL_EPOCHS, uniform_loss

    def progress(lr: float, loss: float, samples: int) -> None:  # `fedcore.data.preflight` relays it
        print(f"{PROGRESS}learning-rate trial of model.name {spec.model.name!r}: "
              f"{lr:g} -> loss {loss:.3f} after {TRIAL_EPOCHS} passes over {samples} "
              f"samples (a uniform guess's: {uniform_loss(dataset.num_classes):.3f})",
              file=sys.stderr, flush=True)

    found = run_trial(spec, dataset, source, progress)
    if found is None:
        return {}
    if found.diverged or found.exhausted:
        raise JobSpecError(source, "training.learning_rate",
                           trial_refusal(spec, found.losses, found.uniform_loss,
                                         diverged=found.diverged))
    return trial_report(found)


def trial_report(found: LrTrial) -> dict[str, Any]:
    """A trial's rate, each rate's loss and a uniform guess's, as the child prints them
    and a pinned site's job.start reply carries them."""
    return {"learning_rate": found.learning_rate,
            "trial": [[lr, loss] for lr, loss in found.losses],
            "uniform_loss": found.uniform_loss}


def site_trial(spec: JobSpec, dataset: Dataset, site: str) -> dict[str, Any] | None:
    """A pinned job's trial at one site (its job.start reply's `learning_rate_trial`), on
    the site's own training samples, standardized as a job of that site alone would be
    (the statistics every site shares come with the plan, after this): the rate it
    found, each rate's loss, a uniform guess's loss, and `verdict` ("trained", or
    "diverged" / "exhausted" with `message`, the refusal a job of this site alone would
    get). The scheduler takes the sites' median (`fedcore.data.preflight.shared_learning_rate`).
    None where no trial runs (`run_trial`)."""
    from dataclasses import replace

    from worker.training import TRIAL_EPOCHS

    def progress(lr: float, loss: float, samples: int) -> None:
        log.info("event=learning_rate_trial cluster=%s model=%s rate=%g loss=%.4f passes=%d "
                 "samples=%d", site, spec.model.name, lr, loss, TRIAL_EPOCHS, samples)

    own = replace(spec, data=replace(spec.data, placement="simulated"))
    found = run_trial(own, dataset, f"cluster {site}", progress)
    if found is None:
        return None
    out = {**trial_report(found), "verdict": "trained"}
    if found.diverged or found.exhausted:
        out["verdict"] = "diverged" if found.diverged else "exhausted"
        out["message"] = trial_refusal(spec, found.losses, found.uniform_loss,
                                       diverged=found.diverged, where=f" at cluster {site}")
    return out


def trial_refusal(spec: JobSpec, losses: Sequence[Sequence[float]], uniform: float, *,
                  diverged: bool, where: str = "") -> str:
    """Why a job is refused when no rate of its trial trained the model: each rate's loss
    and the rate to go below. `where`: whose samples (a pinned job's sites)."""
    from worker.training import TRIAL_DIVERGED, TRIAL_EPOCHS, TRIAL_LEARNED, TRIAL_SAMPLES

    tried = ", ".join(f"{lr:g}: {loss:.3g}" for lr, loss in losses)
    verdict, bound = ((f"makes model {spec.model.name!r} diverge", TRIAL_DIVERGED)
                      if diverged else
                      (f"does not train model {spec.model.name!r}", TRIAL_LEARNED))
    return (f"training.learning_rate {spec.training.learning_rate:g} {verdict} on "
            f"{spec.data.dataset}{where}: after {TRIAL_EPOCHS} passes over up to "
            f"{TRIAL_SAMPLES} of its samples the loss is above {bound:g} x a uniform "
            f"guess's ({uniform:.3g}) at every rate tried ({tried})"
            f"{'' if diverged else ', and still falling at the smallest'}; set a "
            f"learning_rate below {losses[-1][0]:g}, or "
            "training.learning_rate_check = \"off\" to train at it anyway")


def main(argv: Sequence[str]) -> int:
    """Child side of `fedcore.data.preflight.check_model_in_child`: the spec as JSON on stdin, the source as argv[0];
    prints {"model_bytes", "learning_rate", "trial", "uniform_loss"} (the last three:
    `trial_learning_rate`), or {"key", "message"} and exits 2 if the check fails."""
    source = argv[0] if argv else "<job>"
    try:
        spec = JobSpec.from_dict(json.loads(sys.stdin.read()), source=source)
        dataset = check_job_data(spec, source)
        model_bytes = check_model(spec, source, dataset)
        print(json.dumps({"model_bytes": model_bytes,
                          **trial_learning_rate(spec, dataset, source)}))
    except JobSpecError as exc:
        message = str(exc)
        if message.startswith(source + ": "):
            message = message[len(source) + 2:]
        print(json.dumps({"key": exc.key, "message": message}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
