"""Model registry: built-ins on 8x8 digits, deterministic init, user classes, clear errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from proto.job import ModelSpec
from worker.models import MODEL_NAMES, ModelError, build_model, count_parameters
from worker.serialization import model_weights

DIGITS = (1, 8, 8)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builtin_models_run_on_digits_and_are_seed_deterministic(name: str) -> None:
    before = torch.get_rng_state()
    a = build_model(ModelSpec(name=name), DIGITS, 10, seed=1)
    b = build_model(ModelSpec(name=name), DIGITS, 10, seed=1)
    c = build_model(ModelSpec(name=name), DIGITS, 10, seed=2)
    assert torch.equal(torch.get_rng_state(), before), "global RNG was disturbed"
    wa, wb, wc = model_weights(a), model_weights(b), model_weights(c)
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert any(not np.array_equal(wa[k], wc[k]) for k in wa)
    out = a(torch.zeros(5, *DIGITS))
    assert out.shape == (5, 10)


def test_mlp_width_follows_spec_and_flat_inputs_work() -> None:
    small = build_model(ModelSpec(name="mlp", hidden=8), (4,), 3, seed=0)
    assert count_parameters(small) == 4 * 8 + 8 + 8 * 3 + 3
    assert small(torch.zeros(2, 4)).shape == (2, 3)


def test_lenet_is_padded_for_8x8_and_accepts_2d_images() -> None:
    lenet = build_model(ModelSpec(name="lenet"), DIGITS, 10, seed=0)
    assert lenet.classifier[0].in_features == 16 * 2 * 2  # type: ignore[index,union-attr]
    cnn = build_model(ModelSpec(name="cnn"), (8, 8), 10, seed=0)
    assert cnn(torch.zeros(3, 8, 8)).shape == (3, 10)


def test_conv_models_reject_flat_inputs_clearly() -> None:
    with pytest.raises(ModelError, match=r"model 'cnn' cannot be built.*\(channels, height, width\)"):
        build_model(ModelSpec(name="cnn"), (64,), 10, seed=0)


def test_unknown_model_lists_what_exists() -> None:
    with pytest.raises(ModelError, match="unknown model 'resnet'; use one of mlp, cnn, lenet"):
        build_model(ModelSpec(name="resnet"), DIGITS, 10, seed=0)


USER_MODULE = '''
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)
        self.scale = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.fc(self.flat(x)) * self.scale

class NotAModule:
    def __init__(self, input_shape, num_classes):
        pass

class NoArgs(nn.Module):
    def __init__(self):
        super().__init__()
'''


OWN_INIT = """
import random
import numpy as np
import torch

class OwnInit(torch.nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.body = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, num_classes)
        torch.nn.init.kaiming_normal_(self.body.weight, nonlinearity="relu")
        torch.nn.init.zeros_(self.body.bias)
        with torch.no_grad():   # drawn from numpy's and Python's global generators
            self.body.bias.add_(float(np.random.rand()) + random.random())
        torch.nn.init.zeros_(self.head.weight)   # a zero-initialised last layer
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(torch.relu(self.body(x.reshape(x.shape[0], -1))))
"""


def test_a_user_class_keeps_its_own_initialisation_the_same_from_every_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's init (Kaiming-normal weights, a zero last layer, values drawn from numpy and
    Python) was overwritten with torch's default for every Linear and Conv layer, so a
    model that loads its weights or needs its own scheme trained from something else.
    It stands now, identical on every build from one seed (every cluster builds its own),
    and the process's generators are as they were."""
    import random

    (tmp_path / "owninit.py").write_text(OWN_INIT)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec(name="owninit:OwnInit")
    before = (torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    try:
        a, b = (build_model(spec, DIGITS, 10, seed=5) for _ in range(2))
        other = build_model(spec, DIGITS, 10, seed=6)
    finally:
        sys.modules.pop("owninit", None)
    assert torch.count_nonzero(a.head.weight) == 0 and torch.count_nonzero(a.head.bias) == 0
    assert abs(float(a.body.weight.detach().std()) - (2 / 64) ** 0.5) < 0.03  # Kaiming normal
    bias = a.body.bias
    assert torch.allclose(bias, bias[0].expand_as(bias)) and 0 < float(bias[0].detach()) < 2
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    assert not torch.equal(a.body.weight, other.body.weight)
    assert not torch.equal(a.body.bias, other.body.bias)
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1]) and random.getstate() == before[2]


def test_user_class_by_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fedpilot_user_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = ModelSpec(name="fedpilot_user_models:Tiny")
        a = build_model(spec, DIGITS, 10, seed=5)
        b = build_model(spec, DIGITS, 10, seed=5)
        assert type(a).__name__ == "Tiny" and a(torch.zeros(2, *DIGITS)).shape == (2, 10)
        # even the parameter drawn from the global RNG is reproducible
        assert torch.equal(a.scale, b.scale)  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="not a torch.nn.Module subclass"):
            build_model(ModelSpec(name="fedpilot_user_models:NotAModule"), DIGITS, 10, seed=0)
        with pytest.raises(ModelError, match="has no attribute 'Missing'; its torch.nn.Module "
                           "classes: (Tiny, NoArgs|NoArgs, Tiny)$"):
            build_model(ModelSpec(name="fedpilot_user_models:Missing"), DIGITS, 10, seed=0)
        with pytest.raises(ModelError, match=r"takes 1 positional argument but 3 were given; a "
                           r"model class is called as Class\(input_shape, num_classes\), e\.g\. "
                           r"Class\(\(1, 8, 8\), 10\)$"):
            build_model(ModelSpec(name="fedpilot_user_models:NoArgs"), DIGITS, 10, seed=0)
        # a typo: the module's own classes, the closest first (not nn.Module it imports)
        with pytest.raises(ModelError, match="'Tyni'; its torch.nn.Module classes: Tiny, NoArgs$"):
            build_model(ModelSpec(name="fedpilot_user_models:Tyni"), DIGITS, 10, seed=0)
    finally:
        sys.modules.pop("fedpilot_user_models", None)
    # a module with no model class at all (json's JSONDecoder is no torch.nn.Module)
    with pytest.raises(ModelError, match="has no attribute 'Net'; it defines no "
                       "torch.nn.Module class$"):
        build_model(ModelSpec(name="json:Net"), DIGITS, 10, seed=0)
    with pytest.raises(ModelError, match="cannot import module 'no_such_pkg.models'"):
        build_model(ModelSpec(name="no_such_pkg.models:Net"), DIGITS, 10, seed=0)


LAZY = """
import torch
from torch import nn

class LazyNet(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.LazyLinear(32), nn.LazyBatchNorm1d(),
                                 nn.ReLU(), nn.Dropout(0.2), nn.LazyLinear(num_classes))

    def forward(self, x):
        return self.net(x)

class BadLazy(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.LazyLinear(num_classes)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], 3, -1))   # the user's bug: 64 is not 3 x n

class UnusedLazy(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)
        self.spare = nn.LazyLinear(8)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], -1))
"""


def test_a_user_class_with_lazy_layers_is_shaped_at_build_the_same_on_every_cluster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nn.LazyLinear / nn.LazyBatchNorm1d have no size until a forward pass: the learning
    rate trial refused such a model ("Attempted to use an uninitialized parameter") and its
    state dict could not be sent. They are shaped at build, by one forward pass of zeros in
    eval mode under the build's seed: the same weights on every build from one seed, the
    running statistics untouched, the model in training mode as built."""
    (tmp_path / "lazymodels.py").write_text(LAZY)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        a, b = (build_model(ModelSpec(name="lazymodels:LazyNet"), DIGITS, 10, seed=3)
                for _ in range(2))
        other = build_model(ModelSpec(name="lazymodels:LazyNet"), DIGITS, 10, seed=4)
        with pytest.raises(ModelError, match=r"'lazymodels:BadLazy' has lazy layers .* a batch "
                           r"of shape \(2, 1, 8, 8\) to shape them failed: RuntimeError"):
            build_model(ModelSpec(name="lazymodels:BadLazy"), DIGITS, 10, seed=0)
        with pytest.raises(ModelError, match="'lazymodels:UnusedLazy': lazy layers"):
            build_model(ModelSpec(name="lazymodels:UnusedLazy"), DIGITS, 10, seed=0)
    finally:
        sys.modules.pop("lazymodels", None)
    weights = model_weights(a)
    assert weights["net.1.weight"].shape == (32, 64) and weights["net.5.weight"].shape == (10, 32)
    assert all(np.array_equal(w, v) for w, v in zip(weights.values(),
                                                    model_weights(b).values(), strict=True))
    assert not np.array_equal(weights["net.1.weight"], model_weights(other)["net.1.weight"])
    assert a.training and np.array_equal(weights["net.2.running_mean"], np.zeros(32))
    assert int(weights["net.2.num_batches_tracked"]) == 0
    out = a(torch.randn(4, *DIGITS))
    assert out.shape == (4, 10) and torch.isfinite(out).all()
