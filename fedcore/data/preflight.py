"""Check a job's data and model once, locally, before any daemon or Ray starts.

`check_job_data` loads the dataset (labels must be class ids 0..C-1); a user model is
built for (input shape, C) and run once on two samples in a child Python
(`python -m worker.preflight`, which imports torch and the worker: this module, like
`plan` and `submit`, imports neither). So a stray label, a missing user module or a model
with the wrong number of outputs is one line naming the key and the fix, in seconds,
instead of tracebacks from every cluster; built-in models take num_classes and cannot get
the output size wrong.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from proto.job import JobSpec, JobSpecError

from .datasets import Dataset, load_dataset
from .errors import DatasetError


def check_job_data(spec: JobSpec, source: str) -> Dataset:
    """The job's dataset; JobSpecError naming ``data.dataset`` if it cannot be used."""
    try:
        return load_dataset(spec.data.dataset)
    except DatasetError as exc:
        raise JobSpecError(source, "data.dataset", f"data.dataset: {exc}") from None


@dataclass(frozen=True)
class ModelCheck:
    """What the child found: the model's bytes (one transfer, uncompressed) and the
    learning-rate trial (`worker.training.learning_rate_trial`): the rate to train at and
    each tried rate's loss after the trial, against a uniform guess's. Empty where no
    model was built here."""

    model_bytes: int | None = None
    learning_rate: float | None = None
    trial: tuple[tuple[float, float], ...] = ()
    uniform_loss: float | None = None


def check_before_start(spec: JobSpec, source: str, *, measure: bool = False) -> ModelCheck:
    """What `plan` and `submit` run first: the data here, a user model (any model with
    `measure`) in a child Python (the calling process never imports torch); JobSpecError
    naming the key otherwise. What the child found, where it built the model.

    A pinned job's data is on the clusters, not here: each cluster checks its own file and
    the model against it when the job starts (`job.start`)."""
    if spec.data.placement == "pinned":
        return ModelCheck()
    check_job_data(spec, source)
    if measure or ":" in spec.model.name:
        return check_model_in_child(spec, source)
    return ModelCheck()


def with_checked_learning_rate(spec: JobSpec, checked: ModelCheck) -> tuple[JobSpec, str]:
    """`spec` at the learning rate the trial chose, and the line that says why; `spec`
    and "" where it kept the job's."""
    lr = checked.learning_rate
    if lr is None or lr == spec.training.learning_rate:
        return spec, ""
    tried = ", ".join(f"{rate:g}: {loss:.3f}" for rate, loss in checked.trial)
    line = (f"training.learning_rate {spec.training.learning_rate:g} did not train "
            f"model.name {spec.model.name!r} in a short trial on its training samples (the "
            f"loss after it, per rate: {tried}; a uniform guess's: "
            f"{checked.uniform_loss or 0:.3f}); the job trains at {lr:g}. "
            f"training.learning_rate_check = \"off\" trains at "
            f"{spec.training.learning_rate:g} anyway")
    return replace(spec, training=replace(spec.training, learning_rate=lr)), line


#: the learning-rate trial's halvings at most (`worker.training.learning_rate_trial`): a
#: rate a pinned site reports is the job's over 2**k for k in 0..TRIAL_HALVINGS
TRIAL_HALVINGS = 8


def shared_learning_rate(spec: JobSpec, sites: Mapping[str, Any]) -> tuple[float | None, str]:
    """A pinned job's learning rate from its sites' trials (each site's job.start reply's
    `learning_rate_trial`, `worker.preflight.site_trial`; None from a site that ran none):
    the median, in halvings of the job's rate, of the rates of the sites whose trial
    trained the model (with an even count the smaller rate of the middle two: a rate too
    large kills a model, one too small only slows it), so one lying site of three or more
    cannot move it beyond what honest sites found. (None, "") where no site ran a trial or
    the job keeps its rate; else the rate and the line that says why. ValueError naming
    the cluster and field for a malformed report (a rate the trial cannot have chosen);
    JobSpecError naming ``training.learning_rate`` where no site's trial trained it."""
    lr = float(spec.training.learning_rate)
    halvings: dict[str, int] = {}
    refused: dict[str, str] = {}
    for cid, found in sorted(sites.items()):
        if found is None:
            continue
        field = f"cluster {cid}: field 'learning_rate_trial"
        if not isinstance(found, Mapping):
            raise ValueError(f"{field}': must be a map, got {type(found).__name__}")
        verdict = found.get("verdict")
        if verdict not in ("trained", "diverged", "exhausted"):
            raise ValueError(f"{field}.verdict': must be trained, diverged or exhausted, "
                             f"got {str(verdict)[:40]!r}")
        if verdict != "trained":
            refused[cid] = str(found.get("message") or verdict)[:2000]
            continue
        got = found.get("learning_rate")
        rate = (float(got) if isinstance(got, int | float) and not isinstance(got, bool)
                else math.nan)
        k = round(math.log2(lr / rate)) if math.isfinite(rate) and rate > 0 else -1
        if not 0 <= k <= TRIAL_HALVINGS or not math.isclose(rate, lr / 2 ** k, rel_tol=1e-9):
            raise ValueError(f"{field}.learning_rate': must be the job's rate {lr:g} halved "
                             f"0 to {TRIAL_HALVINGS} times, got {str(got)[:40]}")
        halvings[cid] = k
    if not halvings:
        if refused:
            raise JobSpecError("<job>", "training.learning_rate",
                               "no site's trial trained the model: "
                               + "; ".join(refused.values()))
        return None, ""
    ks = sorted(halvings.values())
    chosen = lr / 2 ** ks[len(ks) // 2]
    if chosen == lr:
        return None, ""
    per_site = ", ".join(f"{cid} {lr / 2 ** k:g}" for cid, k in halvings.items())
    line = (f"training.learning_rate {lr:g} did not train model.name {spec.model.name!r} in "
            f"a short trial on the sites' own training samples (the rate each site's trial "
            f"chose: {per_site}"
            + (f"; no rate trained it at {', '.join(refused)}" if refused else "")
            + f"); the job trains at {chosen:g}, their median. training.learning_rate_check"
            f" = \"off\" trains at {lr:g} anyway")
    return chosen, line


#: the prefix of the child's stderr lines meant for the user (progress of the trial);
#: its other stderr (warnings, a traceback) is kept for the error message
PROGRESS = "preflight: "


def check_model_in_child(spec: JobSpec, source: str, timeout: float = 600) -> ModelCheck:
    """`worker.preflight.main` in a fresh Python (same environment), for callers without
    torch; what it found (empty where the child did not say). Its progress lines go to
    our stderr as they come (a large model's learning-rate trial takes a while); a child
    past `timeout` seconds is killed and the job refused naming ``model.name``."""
    proc = subprocess.Popen([sys.executable, "-m", "worker.preflight", source],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    out: list[str] = []

    def relay() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(PROGRESS):
                print(line.rstrip("\n"), file=sys.stderr, flush=True)
            else:
                errors.append(line)

    def collect() -> None:
        assert proc.stdout is not None
        out.append(proc.stdout.read())

    readers = [threading.Thread(target=f, name=f"preflight-{f.__name__}", daemon=True)
               for f in (relay, collect)]
    for reader in readers:
        reader.start()
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(spec.to_dict()))
            proc.stdin.close()
        except BrokenPipeError:  # the child died at once: its stderr says why
            pass
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise JobSpecError(
            source, "model.name",
            f"model.name {spec.model.name!r}: checking the data, the model and its "
            f"learning rate took longer than {timeout:g} s; training.learning_rate_check = "
            "\"off\" skips the trial, its longest part") from None
    finally:
        if proc.poll() is None:  # timed out, or we were interrupted: no child left behind
            proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=5)
    stdout = "".join(out)
    proc_stderr = "".join(errors)
    if proc.returncode == 0:
        try:
            said = json.loads(stdout.strip().splitlines()[-1])
            lr = said.get("learning_rate")
            return ModelCheck(
                model_bytes=int(said["model_bytes"]),
                learning_rate=float(lr) if lr is not None else None,
                trial=tuple((float(a), float(b)) for a, b in said.get("trial", [])),
                uniform_loss=(float(said["uniform_loss"]) if "uniform_loss" in said
                              else None))
        except (IndexError, ValueError, KeyError, TypeError, AttributeError):
            return ModelCheck()
    if proc.returncode < 0:  # killed from outside (the OOM killer's SIGKILL): not the spec
        raise JobSpecError(source, "model.name", killed_message(spec, -proc.returncode))
    try:
        verdict = json.loads(stdout.strip().splitlines()[-1])
        key, message = str(verdict["key"]), str(verdict["message"])
    except (IndexError, ValueError, KeyError, TypeError):
        tail = proc_stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        key, message = "model.name", f"model.name {spec.model.name!r}: the model check failed: {tail[0]}"
    raise JobSpecError(source, key, message)


def killed_message(spec: JobSpec, signum: int) -> str:
    """What to say of a check whose child a signal ended: which, the likeliest sender, and
    the way on (the job itself was not found wrong, so nothing of it is changed)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    cause = (" (the kernel's out-of-memory killer sends it: the model or its trial batch "
             "may not fit in memory)" if signum == signal.SIGKILL else "")
    return (f"model.name {spec.model.name!r}: the process checking the model and its "
            f"learning rate was killed by {name}{cause} before it finished; nothing was "
            "started. Submit again, or set training.learning_rate_check = \"off\" to skip "
            "the trial, the check's longest part")
