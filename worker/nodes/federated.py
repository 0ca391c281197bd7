"""FederatedNode: the actor that holds one client at a time (data indices, model weights,
aggregator state), trains and evaluates it; and the node state that moves between actors.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedcore.data import Dataset
from worker.nodes.messages import LocalUpdate, Message, as_message

from .virtual import NodeConfig

log = logging.getLogger("fedpilot.node")


@dataclass(frozen=True)
class NodeState:
    """Everything a dematerialized client needs to resume: weights and aggregator state
    (both plain named arrays, so they can also travel as safetensors when a node migrates)."""

    weights: Mapping[str, np.ndarray]
    aggregator: Mapping[str, np.ndarray] | None = None
    rounds: int = 0


def client_seed(seed: int, client: int, round_index: int) -> int:
    """The training seed of `client` in `round_index` (the same on every backend)."""
    return int(np.random.SeedSequence([seed, client, round_index]).generate_state(1)[0])


class FederatedNode:
    """The actor: one client at a time (bound by `load`), trained and evaluated on demand.

    Constructed once per actor process with the job's shared dataset (zero-copy from the
    object store on Ray); `load` binds it to a client's indices and saved state.
    """

    def __init__(self, config: NodeConfig, dataset: Dataset) -> None:
        import torch

        from worker.models import build_model
        from worker.serialization import model_weights
        from worker.training import choose_device

        torch.set_num_threads(1)  # determinism and no oversubscription of the box
        self._config = config
        self._dataset = dataset
        self._device = choose_device(config.training.device)
        self._model = build_model(config.model, config.input_shape, config.num_classes,
                                  seed=config.seed).to(self._device)
        log.info("event=actor_device job=%s device=%s asked=%s cuda_visible_devices=%s",
                 config.job_id, self._device, config.training.device,
                 os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        self._initial = model_weights(self._model)
        self._client: int | None = None
        self._train_idx = np.zeros(0, dtype=np.int64)
        self._test_idx = np.zeros(0, dtype=np.int64)
        self._aggregator: Any = None
        self._rounds = 0

    def load(self, client_id: int, train_indices: np.ndarray, test_indices: np.ndarray,
             state: NodeState | None) -> int:
        """Become client `client_id` (fresh when `state` is None); returns the process id."""
        from worker.serialization import load_weights

        self.bind(client_id, train_indices, test_indices)
        if state is None:
            load_weights(self._model, self._initial)
            return os.getpid()
        load_weights(self._model, state.weights)
        self._rounds = state.rounds
        if state.aggregator is not None:
            from worker.aggregators import get_aggregator

            self._aggregator = get_aggregator(self._config.aggregation,
                                              (n for n, _ in self._model.named_buffers()))
            self._aggregator.load_state_dict(state.aggregator, self._initial)
        return os.getpid()

    def bind(self, client_id: int, train_indices: np.ndarray, test_indices: np.ndarray) -> int:
        """Become client `client_id` for calls that bring the model to start from (the
        resident weights are not touched); returns the process id."""
        self._client = int(client_id)
        self._train_idx = np.asarray(train_indices, dtype=np.int64)
        self._test_idx = np.asarray(test_indices, dtype=np.int64)
        self._aggregator, self._rounds = None, 0
        return os.getpid()

    def save(self) -> NodeState:
        """The bound client's state (copied; the actor may load another client next)."""
        from worker.serialization import model_weights

        aggregator = None if self._aggregator is None else self._aggregator.state_dict()
        return NodeState(model_weights(self._model), aggregator, self._rounds)

    def client(self) -> int | None:
        return self._client

    def train(self, round_index: int, *incoming: Message | Mapping[str, np.ndarray]
              ) -> LocalUpdate:
        """Start from the model in `incoming` (if any; a second entry: the client's own
        tensors, e.g. its BatchNorm layers under aggregation.local_batchnorm, which replace
        the model's), train locally, evaluate on the client's own test split; returns the
        trained weights and what was measured."""
        from worker.serialization import load_weights, model_weights, nonfinite
        from worker.training import held_out_choice, round_training, train_local

        client = self._require_client()
        started = time.perf_counter()
        anchor = None
        if incoming:
            if len(incoming) > 2:
                raise ValueError(f"client {client}: train() takes a model and the client's "
                                 f"own tensors at most, got {len(incoming)} arguments")
            anchor = dict(as_message(incoming[0]).weights)
            if len(incoming) == 2:
                own = dict(as_message(incoming[1]).weights)
                unknown = sorted(set(own) - set(anchor))
                if unknown:
                    raise ValueError(f"client {client}: own tensors {unknown[:3]} are not "
                                     "in the model")
                anchor.update(own)
            load_weights(self._model, anchor)
        d = self._dataset
        training = round_training(self._config.training, round_index)
        result = train_local(self._model, d.x_train[self._train_idx], d.y_train[self._train_idx],
                             training, seed=client_seed(self._config.seed, client, round_index),
                             global_weights=anchor)
        self._rounds += 1
        trained = model_weights(self._model)
        diverged = nonfinite(trained)
        if diverged is not None and anchor is not None:
            # training diverged (NaN or infinite weights): the client sends the model it
            # started from, as a client that did not move, so the round goes on - before,
            # the update was refused where it arrived and the round, then the job, failed
            # (table BNMLP beta 0.1, 50 clients, k_connected fedavg, round 3)
            log.warning("event=client_diverged client=%d round=%d tensor=%s action=sends the "
                        "model it started from", client, round_index, diverged)
            trained = {k: np.array(v, copy=True) for k, v in anchor.items()}
            load_weights(self._model, trained)
        personal = int(getattr(self._config.training, "personal_epochs", 0))
        if personal > 0 and len(self._train_idx) and diverged is None:
            # personalization: fine-tune a copy at the base rate on the client's own data;
            # it is scored, the update sent is the trained model above
            train_local(self._model, d.x_train[self._train_idx], d.y_train[self._train_idx],
                        replace(self._config.training, number_of_epochs=personal,
                                fedprox_mu=0.0),
                        seed=client_seed(self._config.seed, client, round_index) + 1)
        # personalized accuracy: per held-out sample, the model trained here where it got
        # more of the client's other held-out samples right than the model received, else
        # the received one (held_out_choice), as it came (its BatchNorm statistics the
        # federation's) but shifted to the client's label mix (`label_offsets`). A near-IID
        # client's fine-tuned copy scores below the federation's model: digits BNCNN beta
        # 0.3, 50 clients, star fedavg, personalized 0.913 against the final model's 0.955
        # on the same splits, 0.965 with this choice; the choice by loss, or with ties to
        # the trained model, 0.937 / 0.920
        hits = self._held_out_hits(measure=True)
        chosen = float(hits.mean()) if len(hits) else 0.0
        if anchor is not None and len(hits):
            load_weights(self._model, anchor)
            chosen = float(held_out_choice(hits, self._held_out_hits(measure=False)).mean())
        load_weights(self._model, trained)
        return LocalUpdate(weights=trained, num_samples=result.num_samples,
                           client_id=client, round=round_index, loss=result.loss,
                           local_accuracy=chosen, local_samples=len(hits),
                           extra={"seconds": time.perf_counter() - started,
                                  **({"diverged": 1.0} if diverged is not None else {})},
                           held_out_hits=hits.astype(bool))

    def held_out_hits(self, *incoming: Message | Mapping[str, np.ndarray]) -> np.ndarray:
        """Whether the model in `incoming` (a second entry: the client's own tensors, as in
        `train`) is right on each sample of the bound client's test split: row 0 as it
        came, row 1 its outputs shifted to the client's label mix, what `train` scores a
        received model by (for the job's final model: NodeRuntime.final_personal). The
        resident weights stay."""
        from worker.serialization import load_weights, model_weights

        self._require_client()
        resident = model_weights(self._model)
        weights = dict(as_message(incoming[0]).weights)
        for extra in incoming[1:]:
            weights.update(as_message(extra).weights)
        load_weights(self._model, weights)
        try:
            return np.stack([self._held_out_hits(measure=False, shift=False),
                             self._held_out_hits(measure=False)]).astype(bool)
        finally:
            load_weights(self._model, resident)

    def _held_out_hits(self, measure: bool, shift: bool = True) -> np.ndarray:
        """Whether the model is right on each sample of the client's own test split
        (`sample_scores`); with `measure`, its BatchNorm statistics first measured on the
        client's own training samples (dropout off, every sample, as the engine's global
        model): the running averages training left describe its last few batches (digits,
        20 clients, beta 1.0, star fedavg: personalized BNCNN 0.931 -> 0.951, BNMLP 0.962
        -> 0.969); without (the model received), its outputs shifted to the label mix of
        the client's training samples against the job's pooled one (`label_offsets`),
        unless not to `shift`."""
        from worker.serialization import load_weights, model_weights
        from worker.training import batchnorm_statistics, label_offsets, sample_scores

        d = self._dataset
        x, y = d.x_train[self._train_idx], d.y_train[self._train_idx]
        measured = measure and batchnorm_statistics(self._model, x)
        if measured:
            load_weights(self._model, {**model_weights(self._model), **measured})
        offsets = None if measure or not shift else label_offsets(y, self._config.num_classes,
                                                     self._config.pooled_labels)
        return sample_scores(self._model, d.x_train[self._test_idx],
                             d.y_train[self._test_idx], offsets, context=x)[1]

    def train_batch(self, round_index: int, model: Message | Mapping[str, np.ndarray],
                    clients: Sequence[tuple[int, np.ndarray, np.ndarray]]
                    ) -> tuple[LocalUpdate, ...]:
        """Train several light clients in one call, each from `model`: (client, train
        indices, test indices) each; one update per client, in order. The same training as
        `train` (same seeds), so a batched round equals an unbatched one bit for bit."""
        updates = []
        for client, train_indices, test_indices in clients:
            self.bind(client, train_indices, test_indices)
            updates.append(self.train(round_index, model))
        return tuple(updates)

    def weights(self) -> Message:
        """The bound client's current model as a message."""
        from worker.serialization import model_weights

        return Message(model_weights(self._model), len(self._train_idx))

    def ping(self) -> int:
        return os.getpid()

    def warm(self) -> int:
        """One training step on two samples, the weights restored after: the process's
        first backward pass and first touch of the shared dataset happen before round 1,
        not inside it. Returns the process id."""
        from worker.serialization import load_weights, model_weights
        from worker.training import train_local

        d = self._dataset
        if len(d.y_train):
            saved = model_weights(self._model)
            train_local(self._model, d.x_train[:2], d.y_train[:2],
                        replace(self._config.training, number_of_epochs=1, fedprox_mu=0.0),
                        seed=0)
            load_weights(self._model, saved)
        return os.getpid()

    def device_info(self) -> dict[str, Any]:
        """Where this actor trains and which GPUs its reservation gave it (Ray's ids when
        it runs on Ray; CUDA_VISIBLE_DEVICES is what torch sees)."""
        gpu_ids: list[str] = []
        if "ray" in sys.modules:
            import ray

            if ray.is_initialized():
                gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return {"device": str(self._device), "gpu_ids": gpu_ids,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def _require_client(self) -> int:
        if self._client is None:
            raise RuntimeError("FederatedNode has no client bound; the manager calls load() first")
        return self._client
