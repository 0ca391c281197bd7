"""FedProx (Li et al., 2020): the server averages like FedAvg.

The proximal term mu/2 ||w - w_global||^2 lives on the client side
(`training.fedprox_mu`, applied by `worker.training.train_local`).
"""

from __future__ import annotations

from .fedavg import FedAvg


class FedProx(FedAvg):
    """Server side of FedProx: sample-weighted averaging."""

    name = "fedprox"
