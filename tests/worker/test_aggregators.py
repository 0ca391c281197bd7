"""Every aggregator against a hand computation on small known tensors; registry and errors."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from proto.job import AGGREGATORS as JOB_AGGREGATORS
from proto.job import AggregationSpec
from worker.aggregators import AGGREGATOR_NAMES, AggregationError, get_aggregator
from worker.aggregators.base import Aggregator
from worker.aggregators.krum import Krum


def _agg(name: str, **kw: object):  # type: ignore[no-untyped-def]
    return get_aggregator(replace(AggregationSpec(), name=name, **kw))  # type: ignore[arg-type]


def _w(x: list[float], b: list[float] | None = None) -> dict[str, np.ndarray]:
    out = {"w": np.array(x, dtype=np.float32)}
    if b is not None:
        out["b"] = np.array(b, dtype=np.float32)
    return out


def test_registry_covers_every_job_aggregator_and_rejects_unknown_names() -> None:
    assert set(AGGREGATOR_NAMES) == set(JOB_AGGREGATORS)
    for name in AGGREGATOR_NAMES:
        assert get_aggregator(AggregationSpec(name=name)).name == name
    with pytest.raises(AggregationError, match="unknown aggregation.name 'fedsgd'; use one of fedavg"):
        _agg("fedsgd")


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_fedavg_and_fedprox_weight_by_samples(name: str) -> None:
    g = {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32), "steps": np.array(0)}
    u1 = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32),
          "steps": np.array(1)}
    u2 = {"w": np.array([3.0, 6.0], np.float32), "b": np.array([4.0], np.float32),
          "steps": np.array(4)}
    out = _agg(name).aggregate(g, [(u1, 1), (u2, 3)])
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    np.testing.assert_allclose(out["b"], [3.0])
    assert out["w"].dtype == np.float32
    assert out["steps"] == 3 and out["steps"].dtype == g["steps"].dtype  # 3.25 rounded
    np.testing.assert_array_equal(u1["w"], [1.0, 2.0])  # inputs untouched


def test_fedavgm_server_momentum_by_hand() -> None:
    agg = _agg("fedavgm", server_momentum=0.5, server_learning_rate=1.0, server_step="plain")
    # round 1: g = 0 - [1, 2]; v = g; w = 0 - v = [1, 2]
    w1 = agg.aggregate(_w([0, 0]), [(_w([1, 2]), 5)])
    np.testing.assert_allclose(w1["w"], [1, 2])
    # round 2: g = [1, 2] - [2, 2] = [-1, 0]; v = 0.5 * [-1, -2] + [-1, 0] = [-1.5, -1]
    w2 = agg.aggregate(w1, [(_w([2, 2]), 5)])
    np.testing.assert_allclose(w2["w"], [2.5, 3.0])
    agg2 = _agg("fedavgm", server_momentum=0.0, server_learning_rate=0.5)
    np.testing.assert_allclose(agg2.aggregate(_w([0, 0]), [(_w([1, 2]), 1)])["w"], [0.5, 1.0])


def test_fedavgm_momentum_defaults_to_the_step_forms_own() -> None:
    """Unset, server_momentum is 0.5 under the scaled step (where it only picks the step's
    direction) and the literature's 0.9 under the plain one; a job's own value wins."""
    assert _agg("fedavgm").momentum == 0.5
    assert _agg("fedavgm", server_step="plain").momentum == 0.9
    assert _agg("fedavgm", server_momentum=0.9).momentum == 0.9
    assert _agg("fedavgm", server_momentum=0.0, server_step="plain").momentum == 0.0


def test_fedavgm_steps_a_batchnorm_model_as_fedavg_unless_the_job_sets_momentum(
        caplog: pytest.LogCaptureFixture) -> None:
    """Bounded to FedAvg's length, momentum could only turn a BatchNorm model's step away
    from the round's pseudo-gradient: unset, fedavgm steps it as FedAvg; set, it holds."""
    def bn(x: list[float], var: float) -> dict[str, np.ndarray]:
        return {"conv.weight": np.array(x, np.float32), "bn.running_var": np.array([var], np.float32)}

    def two_rounds(agg: Aggregator) -> np.ndarray:
        w1 = agg.aggregate(bn([0.0, 0.0], 1.0), [(bn([1.0, 0.0], 2.0), 1)])
        return agg.aggregate(w1, [(bn([1.0, 1.0], 3.0), 1), (bn([2.0, 1.0], 5.0), 1)])

    with caplog.at_level("INFO", logger="worker.aggregators.base"):
        out = two_rounds(_agg("fedavgm"))
    np.testing.assert_allclose(out["conv.weight"], [1.5, 1.0])   # the clients' mean
    # said once, with the key that keeps a momentum
    assert [r.getMessage().count("aggregation.server_momentum") for r in caplog.records] == [1]
    np.testing.assert_allclose(out["bn.running_var"], [4.0])
    kept = two_rounds(_agg("fedavgm", server_momentum=0.5))["conv.weight"]
    assert not np.allclose(kept, [1.5, 1.0])
    # a model without statistics keeps the default momentum 0.5
    w1 = _agg("fedavgm").aggregate(_w([0.0, 0.0]), [(_w([1.0, 0.0]), 1)])
    agg = _agg("fedavgm")
    agg.aggregate(_w([0.0, 0.0]), [(_w([1.0, 0.0]), 1)])
    assert not np.allclose(agg.aggregate(w1, [(_w([1.0, 1.0]), 1), (_w([2.0, 1.0]), 1)])["w"],
                           [1.5, 1.0])


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_steps_a_batchnorm_model_without_a_first_moment_unless_the_job_sets_it(
        name: str) -> None:
    """As fedavgm's momentum: unset, beta1 is 0 for a BatchNorm model (Adam's second
    moment still preconditions the step) and 0.5 for any other; a job's beta1 holds."""
    def bn(x: list[float], var: float) -> dict[str, np.ndarray]:
        return {"conv.weight": np.array(x, np.float32), "bn.running_var": np.array([var], np.float32)}

    def three_rounds(agg: Aggregator, model: Any) -> np.ndarray:
        w = model([0.0, 0.0, 0.0], 1.0)
        for target in ([1.0, 0.0, 0.2], [1.0, 1.0, 0.1], [2.0, 1.5, 0.4]):
            w = agg.aggregate(w, [(model(target, 2.0), 1), (model([t + 0.1 for t in target], 4.0), 1)])
        return np.asarray(w["conv.weight"] if "conv.weight" in w else w["w"])

    unset = three_rounds(_agg(name), bn)
    np.testing.assert_allclose(unset, three_rounds(_agg(name, beta1=0.0), bn))
    assert not np.allclose(unset, three_rounds(_agg(name, beta1=0.5), bn))
    def plain(x: list[float], _var: float) -> dict[str, np.ndarray]:
        return _w(x)
    np.testing.assert_allclose(three_rounds(_agg(name), plain),
                               three_rounds(_agg(name, beta1=0.5), plain))


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_turns_a_batchnorm_models_step_only_part_of_the_way_to_adams(
        name: str) -> None:
    """Past the warm-up, the scaled step of a model without statistics takes Adam's
    direction; a BatchNorm model's turns from FedAvg's only NORM_ADAM_SHARE of the way
    (its pooled statistics were measured around FedAvg's mean): its cosine with the
    round's pseudo-gradient stays between Adam's own and FedAvg's."""
    from worker.aggregators.adaptive import NORM_ADAM_SHARE, WARMUP_ROUNDS
    from worker.aggregators.base import NORM_STEP_RATIO

    def run(stats: bool) -> tuple[float, float]:
        agg = _agg(name)
        rng = np.random.default_rng(0)
        w = {"conv.weight": np.zeros(50, np.float32)}
        if stats:
            w["bn.running_var"] = np.ones(1, np.float32)
        scale = np.geomspace(1e-3, 1.0, 50)   # coordinates of very different sizes
        for _ in range(WARMUP_ROUNDS + 2):
            target = dict(w, **{"conv.weight": (w["conv.weight"] + scale * (
                1.0 + 0.1 * rng.standard_normal(50))).astype(np.float32)})
            new = agg.aggregate(w, [(target, 1)])
            delta = target["conv.weight"].astype(np.float64) - w["conv.weight"]
            step = new["conv.weight"].astype(np.float64) - w["conv.weight"]
            w = new
        cosine = float(delta @ step / (np.linalg.norm(delta) * np.linalg.norm(step)))
        return cosine, float(np.linalg.norm(step) / np.linalg.norm(delta))

    adam_cosine, _ = run(stats=False)
    norm_cosine, norm_length = run(stats=True)
    assert adam_cosine < 0.7            # Adam's direction evens out the coordinates
    # half-way between the unit vectors: cosine sqrt((1 + c) / 2) for Adam's cosine c
    # (0.58 here at share 1, FedAvg's direction 1.0)
    assert 0.85 < norm_cosine < 0.95
    # and NORM_STEP_RATIO x FedAvg's length at most (FedAvg's until stop 75): the bound binds
    assert norm_length == pytest.approx(NORM_STEP_RATIO, rel=1e-4)
    assert NORM_ADAM_SHARE == 0.5 and NORM_STEP_RATIO == 1.5


def test_fedavgm_forgets_its_momentum_when_the_clients_turn_back() -> None:
    agg = _agg("fedavgm")   # the defaults: scaled step, momentum 0.5
    w1 = agg.aggregate(_w([0.0]), [(_w([1.0]), 1)])
    np.testing.assert_allclose(w1["w"], [1.0])
    # the clients now average 0.5: the kept velocity (0.5 x -1 + 0.5) would not move the
    # model; restarted, the step is FedAvg's
    np.testing.assert_allclose(agg.aggregate(w1, [(_w([0.5]), 1)])["w"], [0.5])
    # the literature's form keeps its momentum
    plain = _agg("fedavgm", server_step="plain")
    w1 = plain.aggregate(_w([0.0]), [(_w([1.0]), 1)])
    np.testing.assert_allclose(plain.aggregate(w1, [(_w([0.5]), 1)])["w"], [1.4])


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad"])
def test_adaptive_first_moment_restarts_when_the_clients_turn_back(name: str) -> None:
    agg = _agg(name)
    w1 = float(agg.aggregate(_w([0.0]), [(_w([1.0]), 1)])["w"][0])
    assert w1 > 0
    # the clients now average 1 below: kept, m_hat = (0.09 - 0.1) / 0.19 and the step
    # barely turns; restarted, m_hat = -1 and the step goes back, no further than FedAvg's
    # own (the job went past a minimum: not 2 x, as fedavgm's restarted velocity)
    w2 = float(agg.aggregate(_w([w1]), [(_w([w1 - 1.0]), 1)])["w"][0])
    assert w2 == pytest.approx(w1 - 1.0)
    # and the next round in the same direction may go further again
    w3 = float(agg.aggregate(_w([w2]), [(_w([w2 - 1.0]), 1)])["w"][0])
    assert w3 < w2 - 1.0


def _adaptive_two_rounds(name: str) -> tuple[float, float]:
    agg = _agg(name, server_learning_rate=1.0, beta1=0.9, beta2=0.99, tau=0.1,
               server_step="plain")
    # scalar model: round 1 moves the average to +1 from 0, round 2 to +2 beyond the new global
    w1 = agg.aggregate({"w": np.array([0.0])}, [(_w([1.0]), 1), (_w([1.0]), 3)])
    w1f = float(w1["w"][0])
    w2 = agg.aggregate(w1, [(_w([w1f + 2.0]), 2)])
    return w1f, float(w2["w"][0])


@pytest.mark.parametrize(
    ("name", "v2", "v_correction"),
    [
        ("fedadam", 0.99 * 0.01 + 0.01 * 4.0, True),   # beta2 v + (1 - beta2) d^2
        ("fedyogi", 0.01 + 0.01 * 4.0, True),          # v - (1 - beta2) d^2 sign(v - d^2)
        ("fedadagrad", 1.0 + 4.0, False),              # v + d^2 (a sum: not corrected)
    ],
)
def test_adaptive_optimizers_by_hand(name: str, v2: float, v_correction: bool) -> None:
    """Reddi et al.'s Algorithm 2 with Adam's bias correction: m_hat = m / (1 - beta1^t),
    v_hat = v / (1 - beta2^t) for the exponential averages (server_step = "plain")."""
    v1 = {"fedadagrad": 1.0}.get(name, 0.01)  # first round: delta = 1
    m1 = 0.1
    v1_hat = v1 / (1 - 0.99) if v_correction else v1
    w1_expected = 0.0 + (m1 / (1 - 0.9)) / (math.sqrt(v1_hat) + 0.1)
    m2 = 0.9 * m1 + 0.1 * 2.0
    v2_hat = v2 / (1 - 0.99**2) if v_correction else v2
    w2_expected = w1_expected + (m2 / (1 - 0.9**2)) / (math.sqrt(v2_hat) + 0.1)
    w1, w2 = _adaptive_two_rounds(name)
    assert w1 == pytest.approx(w1_expected, rel=1e-6)
    assert w2 == pytest.approx(w2_expected, rel=1e-6)


def test_adaptive_state_moves_between_instances() -> None:
    a, b = _agg("fedadam", server_learning_rate=0.1), _agg("fedadam", server_learning_rate=0.1)
    w1 = a.aggregate(_w([0, 0]), [(_w([1, -1]), 1)])
    b.load_state_dict(a.state_dict())
    assert set(a.state_dict()) == {"m/w", "v/w", "t/w"}
    step = [(_w([3, 1]), 1)]
    np.testing.assert_array_equal(a.aggregate(w1, step)["w"], b.aggregate(w1, step)["w"])
    a.reset()
    assert a.state_dict() == {}


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad", "fedavgm"])
def test_a_server_state_that_lies_is_refused_naming_the_key_and_the_old_one_kept(
        name: str) -> None:
    """A migrating node's aggregator state comes from the cluster that held it, which may
    lie: a negative second moment made sqrt NaN, a round count of 0 made Adam's bias
    correction divide by 0, a negative step scale turned every server step around, another
    shape broke the next round. Each is refused naming the key; the state held is kept."""
    model = _w([0, 0])
    honest = _agg(name)
    honest.classes = 10
    honest.aggregate(model, [(_w([1, -1]), 1)])
    assert honest.observe(model, accuracy=0.5, loss=1.0) is None   # guard, start, best
    honest.aggregate(model, [(_w([3, 1]), 1)])
    state = honest.state_dict()
    assert {"guard/best_loss", "start/w", "best/w"} <= state.keys(), state.keys()
    agg = _agg(name)
    agg.load_state_dict(state, model)   # the honest one is taken as it is
    assert agg.state_dict().keys() == state.keys()
    kept = agg.state_dict()
    moment = "velocity/w" if name == "fedavgm" else "m/w"
    lies = [({moment: np.zeros(3)}, "has shape"),
            ({moment: np.array([np.nan, 0.0])}, "NaN"),
            ({"velocity/x" if name == "fedavgm" else "m/x": np.zeros(2)}, "names no tensor"),
            ({"mystery/w": np.zeros(2)}, "keeps no 'mystery'"),
            ({"guard/scale": np.array(-0.5)}, "guard/scale' must be one number"),
            ({"guard/gain": np.array(1.0)}, "is unknown"),
            ({"best/w": np.ones(5)}, "has shape"),
            ({"nodash": np.zeros(2)}, "slot/tensor"),
            ({moment: np.array(["a", "b"])}, "not numbers")]
    if name != "fedavgm":
        lies += [({"v/w": np.array([1.0, -1.0])}, "negative"),
                 ({"t/w": np.array(0)}, "round count"),
                 ({"t/w": np.array(1.5)}, "round count"),
                 ({"t/w": np.array([1, 2])}, "round count")]
    for lie, needle in lies:
        with pytest.raises(AggregationError, match=needle):
            agg.load_state_dict({**state, **lie}, model)
        assert {k: v.tolist() for k, v in agg.state_dict().items()} == {
            k: v.tolist() for k, v in kept.items()}, lie


def test_median_coordinatewise_odd_and_even() -> None:
    agg = _agg("median")
    g = _w([0, 0], [0])
    out = agg.aggregate(g, [(_w([1, 10], [1]), 1), (_w([2, -5], [2]), 1), (_w([100, 0], [3]), 50)])
    np.testing.assert_allclose(out["w"], [2, 0])
    np.testing.assert_allclose(out["b"], [2])
    out = agg.aggregate(g, [(_w([i, -i], [0]), 1) for i in (1, 2, 3, 4)])
    np.testing.assert_allclose(out["w"], [2.5, -2.5])


def test_trimmed_mean_trims_per_side() -> None:
    ups = [(_w([v, -v]), 1) for v in (4, 100, 1, 3, 2)]
    np.testing.assert_allclose(_agg("trimmed_mean", trim_ratio=0.2).aggregate(_w([0, 0]), ups)["w"],
                               [3, -3])
    np.testing.assert_allclose(_agg("trimmed_mean", trim_ratio=0.1).aggregate(_w([0, 0]), ups)["w"],
                               [22, -22])
    with pytest.raises(AggregationError, match=r"aggregation.trim_ratio = 0.5"):
        _agg("trimmed_mean", trim_ratio=0.5)


def test_krum_picks_the_most_central_update() -> None:
    # points (x, y) spread over two tensors; with f = 1 and n = 5 each is scored by its
    # 2 nearest: 0 -> 1 + 4 = 5, 1 -> 1 + 1 = 2, 2 -> 1 + 2.25 = 3.25, 3.5 -> 8.5, 100 -> huge
    agg = _agg("krum", krum_byzantine=1)
    assert isinstance(agg, Krum)
    ups = [(_w([x], [0.0]), 1) for x in (0.0, 1.0, 2.0, 3.5, 100.0)]
    np.testing.assert_allclose(agg.scores(ups)[:4], [5.0, 2.0, 3.25, 8.5])
    out = agg.aggregate(_w([0], [0]), ups)
    assert agg.last_selected == 1
    np.testing.assert_allclose(out["w"], [1.0])
    with pytest.raises(AggregationError, match="at least krum_byzantine \\+ 3 = 4 updates, got 3"):
        agg.scores(ups[:3])


def test_krum_with_too_few_updates_takes_their_median_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """A hierarchy's root or a hybrid group at client_fraction < 1 may get fewer than
    krum_byzantine + 3 updates: the round takes their coordinate-wise median (a liar among
    3 moves nothing) and warns once, instead of failing the job."""
    agg = _agg("krum", krum_byzantine=1)
    liar = (_w([1e6], [-1e6]), 1)
    with caplog.at_level("WARNING"):
        out = agg.aggregate(_w([0], [0]), [(_w([1.0], [2.0]), 1), liar, (_w([1.2], [2.2]), 1)])
        np.testing.assert_allclose(out["w"], [1.2])
        np.testing.assert_allclose(out["b"], [2.0])
        assert agg.last_selected is None
        np.testing.assert_allclose(agg.aggregate(_w([0], [0]), [(_w([3.0], [1.0]), 1)])["w"], [3.0])
    assert sum("event=krum_too_few updates=3" in r.getMessage() for r in caplog.records) == 1
    assert not any("updates=1" in r.getMessage() for r in caplog.records)
    agg.aggregate(_w([0], [0]), [(_w([float(x)], [0.0]), 1) for x in range(4)])
    assert agg.last_selected is not None


def test_trimmed_mean_says_when_it_trims_nothing(caplog: pytest.LogCaptureFixture) -> None:
    agg = _agg("trimmed_mean", trim_ratio=0.19)
    with caplog.at_level("WARNING"):
        out = agg.aggregate(_w([0.0]), [(_w([x]), 1) for x in (1.0, 2.0, 9.0)])
        np.testing.assert_allclose(out["w"], [4.0])  # 3 updates at 0.19: the plain mean
        _agg("trimmed_mean", trim_ratio=0.19).aggregate(  # said once per process
            _w([0.0]), [(_w([x]), 1) for x in (1.0, 2.0, 9.0)])
        out = agg.aggregate(_w([0.0]), [(_w([x]), 1) for x in (1.0, 2.0, 3.0, 4.0, 5.0, 90.0)])
        np.testing.assert_allclose(out["w"], [3.5])
    said = [r.getMessage() for r in caplog.records if "trimmed_mean_trims_nothing" in r.getMessage()]
    assert len(said) == 1 and "updates=3 trim_ratio=0.19" in said[0]


def test_robust_aggregators_shrug_off_one_outlier() -> None:
    honest = [(_w([1.0 + 0.01 * i, 2.0]), 10) for i in range(6)]
    attack = [(_w([1e6, -1e6]), 10)]
    for name in ("median", "trimmed_mean", "krum"):
        out = _agg(name, trim_ratio=0.2).aggregate(_w([0, 0]), honest + attack)
        assert np.all(np.abs(out["w"] - [1.03, 2.0]) < 0.1), name
    assert _agg("fedavg").aggregate(_w([0, 0]), honest + attack)["w"][0] > 1e5


@pytest.mark.parametrize("name", AGGREGATOR_NAMES)
def test_malformed_updates_fail_clearly(name: str) -> None:
    agg = _agg(name, krum_byzantine=0)
    g = _w([0, 0], [0])
    ok = (_w([1, 1], [1]), 1)
    with pytest.raises(AggregationError, match="no updates"):
        agg.aggregate(g, [])
    with pytest.raises(AggregationError, match=r"update 1 does not match.*missing \['b'\]"):
        agg.aggregate(g, [ok, (_w([1, 1]), 1), ok])
    with pytest.raises(AggregationError, match=r"update 2 tensor 'w' has shape \(3,\)"):
        agg.aggregate(g, [ok, ok, (_w([1, 1, 1], [1]), 1)])
    with pytest.raises(AggregationError, match="sample count -1"):
        agg.aggregate(g, [ok, ok, (_w([1, 1], [1]), -1)])


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [("fedadam", "beta1", 1.0), ("fedyogi", "tau", 0.0), ("fedavgm", "server_momentum", 1.5),
     ("fedadagrad", "server_learning_rate", -1.0), ("krum", "krum_byzantine", -1)],
)
def test_bad_settings_name_the_key(name: str, key: str, value: float) -> None:
    with pytest.raises(AggregationError, match=f"aggregation.{key} = "):
        _agg(name, **{key: value})


def test_weighted_aggregators_need_some_samples() -> None:
    with pytest.raises(AggregationError, match="all 2 updates report 0 samples"):
        _agg("fedavg").aggregate(_w([0]), [(_w([1]), 0), (_w([2]), 0)])


def test_server_learning_rate_none_means_the_algorithm_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the scaled step's rate is in lengths of the (momentum) pseudo-gradient
    for name in ("fedadam", "fedyogi", "fedadagrad"):
        assert _agg(name, server_learning_rate=None).server_lr == 2.0
    assert _agg("fedavgm", server_learning_rate=None).server_lr == 1.0
    # the literature's plain step: Reddi et al.'s region
    assert _agg("fedadam", server_learning_rate=None, server_step="plain").server_lr == 0.05
    assert _agg("fedyogi", server_learning_rate=None, server_step="plain").server_lr == 0.05
    assert _agg("fedadagrad", server_learning_rate=None, server_step="plain").server_lr == 0.03
    with caplog.at_level("WARNING"):
        _agg("fedadam", server_learning_rate=1.0)
    assert "large_server_learning_rate" not in caplog.text
    with caplog.at_level("WARNING"):
        _agg("fedadam", server_learning_rate=1.0, server_step="plain")
    assert "large_server_learning_rate aggregator=fedadam" in caplog.text


def test_on_stall_restores_a_real_collapse_not_early_jitter_on_a_flat_loss() -> None:
    """Early rounds' accuracy jumps between chance and a few classes while the loss sits
    near ln(classes): 0.25 then 0.165 on 2.27 against 2.27 is no collapse (restoring there
    halved fedavgm's step twice on MNIST beta 0.1); 0.9 then 0.2 with the loss tripled is."""
    def run(steps: list[tuple[float, float]]) -> list[bool]:
        agg = get_aggregator(replace(AggregationSpec(), name="fedavgm"), classes=10)
        acted = []
        for i, (accuracy, loss) in enumerate(steps):
            acted.append(agg.observe(_w([float(i)]), accuracy, loss, start=_w([0.0]))
                         is not None)
        return acted

    assert run([(0.25, 2.27), (0.165, 2.2737), (0.14, 2.2766), (0.4, 1.9)]) == [False] * 4
    collapse = run([(0.5, 1.2), (0.9, 0.35), (0.2, 1.05)])
    assert collapse == [False, False, True]
    # a swing FedAvg's own loop makes and recovers from (digits SmallCNN, beta 0.1, 100
    # clients: the reference loop's rounds 5-9), its loss 1.29x its best: not a collapse
    swing = run([(0.546, 1.952), (0.451, 1.705), (0.515, 1.529), (0.373, 1.713),
                 (0.265, 1.979), (0.457, 1.81), (0.708, 1.45)])
    assert swing == [False] * 7


def test_on_stall_acts_on_a_model_worse_than_a_uniform_guess_two_rounds_running() -> None:
    """Two classes, one a client (beta 0.1): the mean swings between all-majority (0.62,
    not chance) and all-minority (0.38) guesses, its loss above a uniform guess's (ln 2)
    and rising: no collapse (0.62 is no gain over chance) and never two rounds at chance,
    so the guard used to let it swing; a loss worse than a uniform guess's, 5% above its
    best, two rounds running, is a stall at any accuracy. Below ln(classes) the same rise
    is not (a plateau's jitter)."""
    def run(classes: int, steps: list[tuple[float, float]]) -> list[bool]:
        agg = get_aggregator(replace(AggregationSpec(), name="fedavg"), classes=classes)
        return [agg.observe(_w([float(i)]), accuracy, loss, start=_w([0.0])) is not None
                for i, (accuracy, loss) in enumerate(steps)]

    swing = [(0.62, 0.53), (0.38, 0.69), (0.62, 0.955), (0.38, 0.81)]
    assert run(2, swing) == [False, False, True, False]
    assert run(10, [(0.5, 1.5), (0.45, 1.7), (0.5, 1.9), (0.55, 1.6)]) == [False] * 4


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavgm", "fedadam"])
def test_on_stall_acts_on_a_slide_not_on_a_swing_or_a_confident_model(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    """MNIST SmallCNN, shards:2, hierarchical fedprox's last rounds: from its best (0.813,
    loss 0.567) to 0.772 / 0.711 / 0.588 with its loss 0.613 / 0.939 / 1.375, below a
    uniform guess's and no round losing half its gain, so the guard let it slide; now its
    best model comes back after two rounds with the loss 1.5x its best and the accuracy
    down by more than a tenth of its gain. The same split's swings (the reference loop's
    accuracy 0.74 / 0.70 / 0.59 / 0.62 / 0.76 on a loss up by at most 1.4x), a loss that
    climbs 2x while the accuracy holds (a model growing confident) and one round's dip
    are left as they are."""
    def run(steps: list[tuple[float, float]]) -> list[bool]:
        agg = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
        return [agg.observe(_w([float(i)]), accuracy, loss, start=_w([0.0])) is not None
                for i, (accuracy, loss) in enumerate(steps)]

    slide = [(0.55, 1.3), (0.813, 0.567), (0.772, 0.613), (0.711, 0.939), (0.588, 1.375)]
    with caplog.at_level(logging.WARNING, logger="worker.aggregators.base"):
        assert run(slide) == [False] * 4 + [True]
    assert "reason=slid accuracy=0.5880" in caplog.text   # the log says which rule acted
    swing = [(0.55, 1.3), (0.74, 0.80), (0.70, 0.95), (0.59, 1.12), (0.62, 1.10), (0.76, 0.78)]
    assert run(swing) == [False] * 6
    confident = [(0.5, 1.4), (0.95, 0.15), (0.95, 0.24), (0.94, 0.30), (0.95, 0.33)]
    assert run(confident) == [False] * 5
    dip = [(0.55, 1.3), (0.813, 0.567), (0.6, 1.2), (0.8, 0.6), (0.6, 1.2), (0.81, 0.58)]
    assert run(dip) == [False] * 6


@pytest.mark.parametrize("name", ["fedavg", "fedprox"])
def test_on_stall_halves_fedavgs_move_to_the_mean_and_brings_back_its_best(name: str) -> None:
    """A FedAvg-family job that collapsed (0.9 then 0.2, the loss tripled) goes back to its
    best model, and from then on moves half way to the clients' mean (its step halved;
    before, FedAvg had no step to halve and never acted); the statistics take the mean.
    With on_stall = warn, or a robust aggregator (median: its step is its defence), the
    same rounds change nothing."""
    def model(x: float) -> dict[str, np.ndarray]:
        return {"w": np.full(3, x, np.float32), "bn.running_var": np.full(2, 1.0 + x),
                "bn.num_batches_tracked": np.array(4)}

    def run(agg: Any) -> tuple[list[bool], dict[str, np.ndarray] | None]:
        acted, back = [], None
        for i, (accuracy, loss) in enumerate([(0.5, 1.2), (0.9, 0.35), (0.2, 1.05)]):
            back = agg.observe(model(float(i)), accuracy, loss, start=model(-1.0))
            acted.append(back is not None)
        return acted, back

    agg = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    acted, back = run(agg)
    assert acted == [False, False, True] and back is not None
    assert np.all(back["w"] == 1.0) and back["w"].dtype == np.float32   # round 2's, the best
    assert agg.step_scale == 0.5
    updates = [(model(3.0), 10), (model(5.0), 30)]   # mean w 4.5, running_var 5.5
    out = agg.aggregate(back, updates)
    np.testing.assert_allclose(out["w"], 1.0 + 0.5 * (4.5 - 1.0))
    assert out["w"].dtype == np.float32 and out["bn.num_batches_tracked"] == 4
    fresh = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    unscaled = fresh.aggregate(back, updates)
    np.testing.assert_allclose(unscaled["w"], 4.5)
    np.testing.assert_allclose(out["bn.running_var"], 5.5)   # the mean, not half way to it
    np.testing.assert_allclose(unscaled["bn.running_var"], 5.5)
    for other in (get_aggregator(replace(AggregationSpec(), name=name, on_stall="warn"),
                                 classes=10),
                  get_aggregator(replace(AggregationSpec(), name="median"), classes=10)):
        assert run(other) == ([False] * 3, None)
        assert other.step_scale == 1.0 and other.state_dict() == {}


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_on_stall_halves_the_step_a_server_optimizer_takes_not_only_its_own(name: str) -> None:
    """A server optimizer's step is bounded by FedAvg's own (2x, 1.5x for a BatchNorm model);
    after a stall halved the optimizer's step the bound halves too, so the step taken is
    half of what it was. Before, the optimizer's own step (2 x the momentum) was halved
    to 1 x, still longer than the bound, and the model moved as far as before the stall:
    a BatchNorm table's fedadam swung between 0.95 and 0.80 every round to the end."""
    def model(x: float) -> dict[str, np.ndarray]:
        return {"w": np.array([x, 2 * x, -x], np.float64), "bn.running_var": np.full(2, 1.0)}

    def steps(stalled: bool) -> list[float]:
        agg = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
        if stalled:
            for i, (accuracy, loss) in enumerate([(0.5, 1.2), (0.9, 0.35), (0.2, 1.05)]):
                agg.observe(model(float(i)), accuracy, loss, start=model(-1.0))
            assert agg.step_scale == 0.5
        current, taken = model(0.0), []
        for target in (1.0, 2.5, 4.0):   # the clients' mean moves on each round
            out = agg.aggregate(current, [(model(target), 10)])
            fedavg = np.linalg.norm(model(target)["w"] - current["w"])
            taken.append(float(np.linalg.norm(out["w"] - current["w"]) / fedavg))
            current = out
        return taken

    from worker.aggregators.base import NORM_STEP_RATIO

    before, after = steps(False), steps(True)
    # fedavgm: no momentum for a BatchNorm model, its server rate 1: FedAvg's step
    bound = 1.0 if name == "fedavgm" else NORM_STEP_RATIO
    assert max(before) <= bound + 1e-9 and max(after) <= bound / 2 + 1e-9, (before, after)
    assert before[-1] > 0.9 * bound, before   # unstalled, the bound is the one that binds


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadam"])
def test_on_stall_of_a_decentralized_node_keeps_its_best_by_reference_and_in_checkpoints(
        name: str) -> None:
    """A decentralized node (shared=True) keeps its best and first models by reference,
    not copied (the engine never modifies a model it handed over); its server state (a
    checkpoint of every node) holds a copy of the best but not the first: after the same
    collapse the node goes back to its best and halves its step, and so does the node
    resumed from its state (before stop 72 the state left the best out, and a resumed
    node went back to its round's start: a decentralized job resumed to another model).
    Resumed from a state with no best yet, it goes back to the model it began the stalled
    round from. Without that model it cannot act: refused."""
    def model(x: float) -> dict[str, np.ndarray]:
        return {"w": np.full(3, x, np.float32)}

    def run(agg: Any, steps: list[tuple[float, float]], first: int = 0) -> list[Any]:
        backs = []
        for i, (accuracy, loss) in enumerate(steps, start=first):
            seen = model(float(i))
            backs.append(agg.observe(seen, accuracy, loss, start=model(i - 0.5), shared=True))
            slots = {k.partition("/")[0] for k in agg.state_dict()}
            assert "start" not in slots, slots
            assert name != "fedavg" or slots <= {"guard", "best"}, slots
        return backs

    agg = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    backs = run(agg, [(0.5, 1.2), (0.9, 0.35), (0.2, 1.05)])
    assert [b is not None for b in backs] == [False, False, True]
    assert np.all(backs[-1]["w"] == 1.0) and backs[-1]["w"].dtype == np.float32  # the best
    assert agg.step_scale == 0.5
    state = agg.state_dict()
    assert np.all(state["best/w"] == 1.0)
    resumed = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    resumed.load_state_dict(state)
    again = run(resumed, [(0.1, 9.0)], first=3)   # diverged after the resume
    assert again[0] is not None and np.all(again[0]["w"] == 1.0)   # the same best
    assert again[0]["w"].dtype == np.float32 and resumed.step_scale == 0.25
    early = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    run(early, [(0.1, 2.3)])   # at chance: no best yet
    assert "best/w" not in early.state_dict()
    fresh = get_aggregator(replace(AggregationSpec(), name=name), classes=10)
    fresh.load_state_dict(early.state_dict())
    backs = run(fresh, [(0.1, 9.0)], first=3)
    assert backs[0] is not None and np.all(backs[0]["w"] == 2.5)   # this round's start
    with pytest.raises(ValueError, match="start model"):
        agg.observe(model(3.0), 0.2, 1.05, shared=True)


def _models(seed: int, count: int) -> list[tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    return [({"w": rng.normal(size=(3, 4)).astype(np.float32),
              "bn.running_mean": rng.normal(size=4), "bn.running_var": rng.uniform(1, 2, 4),
              "bn.num_batches_tracked": np.array(5)}, int(n))
            for n in rng.integers(5, 50, size=count)]


def test_shared_means_compute_one_mean_per_set_of_models_whatever_their_order() -> None:
    """Nodes that average the same models, each listing its own first, share one pooled
    mean: the same object, equal to the plain `pooled_mean` up to the summation order."""
    from worker.aggregators import base

    updates = _models(0, 5)
    shared = base.SharedMeans()
    calls: list[int] = []
    plain = base.pooled_mean

    def counted(u: Any, algorithm: str) -> Any:
        calls.append(len(u))
        return plain(u, algorithm)

    orders = [updates[i:] + updates[:i] for i in range(len(updates))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base, "pooled_mean", counted)
        means = [shared.mean([(dict(w), n) for w, n in order], "fedavg") for order in orders]
    assert calls == [5]
    assert all(m is means[0] for m in means)
    reference = plain(updates, "fedavg")
    for name in reference:
        np.testing.assert_allclose(means[0][name], reference[name], rtol=1e-12)


def test_shared_means_know_a_model_by_its_content_not_its_sender() -> None:
    """A member that sends its neighbours different models under one name gets each
    averaged as received: two nodes whose sets differ in one model's content, or only in
    one model's sample count, get different means; a new array with equal content is
    the same model."""
    from worker.aggregators import base

    updates = _models(1, 4)
    shared = base.SharedMeans()
    forged = [(dict(updates[0][0], w=updates[0][0]["w"] + 1), updates[0][1])] + updates[1:]
    recounted = [(updates[0][0], updates[0][1] + 7)] + updates[1:]
    copied = [({k: v.copy() for k, v in updates[0][0].items()}, updates[0][1])] + updates[1:]
    honest = shared.mean(updates, "fedavg")
    assert not np.allclose(shared.mean(forged, "fedavg")["w"], honest["w"])
    assert not np.allclose(shared.mean(recounted, "fedavg")["w"], honest["w"])
    assert shared.mean(copied, "fedavg") is honest


def test_shared_means_pass_a_failure_to_every_node_that_asked() -> None:
    from worker.aggregators import base

    shared = base.SharedMeans()
    empty = [(w, 0) for w, _ in _models(2, 3)]
    for _ in range(2):
        with pytest.raises(AggregationError, match="report 0 samples"):
            shared.mean(empty, "fedavg")


def test_shared_means_keep_no_model_alive_and_only_their_latest_means() -> None:
    """A sparse graph's nodes each average another set: the memo holds no update (weak
    references only) and at most SHARED_MEANS_KEPT means, so its memory stays what the
    node threads held before."""
    import gc
    import weakref

    from worker.aggregators import base

    shared = base.SharedMeans()
    updates = _models(3, 3)
    first = shared.mean(updates, "fedavg")
    watched = weakref.ref(updates[0][0]["w"])
    del updates
    gc.collect()
    assert watched() is None
    sets = [_models(10 + i, 2) for i in range(base.SHARED_MEANS_KEPT + 1)]
    means = [shared.mean(s, "fedavg") for s in sets]
    assert shared.mean(sets[-1], "fedavg") is means[-1]
    assert shared.mean(sets[0], "fedavg") is not means[0]  # the oldest, computed again
    np.testing.assert_array_equal(shared.mean(sets[0], "fedavg")["w"], means[0]["w"])
    assert first["w"].shape == (3, 4)
