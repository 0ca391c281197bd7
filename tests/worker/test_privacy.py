"""worker.privacy: pairwise masks, fixed point, Shamir recovery, clipping, noise, accountant."""

from __future__ import annotations

import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from dp_accounting import pld, rdp
from scipy import stats

from proto.job import JobSpec, JobSpecError
from worker.privacy import Privacy, dp, flatten, secagg

CLUSTERS = ("a", "b", "c")
JOB = "job-p"


def keys() -> dict[str, X25519PrivateKey]:
    return {c: X25519PrivateKey.from_private_bytes(bytes([i + 1]) * 32)
            for i, c in enumerate(CLUSTERS)}


def secrets(keyset: dict[str, X25519PrivateKey], cluster: str) -> dict[str, bytes]:
    return {c: secagg.pair_secret(keyset[cluster], secagg.public_bytes(k), JOB)
            for c, k in keyset.items()}


def masked_round(placement: dict[str, str], values: dict[str, np.ndarray], weights: dict[str, float],
                 clip_range: float, tag: str = "r1") -> tuple[dict[str, np.ndarray],
                                                               dict[str, np.ndarray]]:
    """(quantized, masked) contribution of every contributor."""
    keyset = keys()
    n = len(next(iter(values.values())))
    clusters = sorted(set(placement.values()))
    quantized, masked = {}, {}
    for cluster in clusters:
        mine = [c for c, where in placement.items() if where == cluster]
        masks = secagg.cluster_masks(cluster, mine, clusters, secrets(keyset, cluster), tag, n)
        for c in mine:
            quantized[c], _ = secagg.quantize(values[c], weights[c], clip_range)
            masked[c] = secagg.mask(quantized[c], masks[c])
    return quantized, masked


PLACEMENT = {"c0": "a", "c1": "a", "c2": "b", "c3": "b", "c4": "b", "c5": "c"}


def test_masked_sum_unmasks_exactly_to_the_quantized_sum() -> None:
    rng = np.random.default_rng(0)
    values = {c: rng.normal(0, 0.3, 5000) for c in PLACEMENT}
    samples = {c: 10 + i for i, c in enumerate(PLACEMENT)}
    total = sum(samples.values())
    weights = {c: samples[c] / total for c in PLACEMENT}
    quantized, masked = masked_round(PLACEMENT, values, weights, clip_range=2.0)
    got = secagg.masked_sum(list(masked.values()))
    assert np.array_equal(got, secagg.masked_sum(list(quantized.values())))
    plain = sum(weights[c] * np.clip(values[c], -2, 2) for c in PLACEMENT)
    step = 2.0 / 2 ** 22
    assert np.max(np.abs(secagg.dequantize(got, 2.0) - plain)) <= len(PLACEMENT) * step
    # nothing cancels when a contribution is missing
    partial = secagg.masked_sum([m for c, m in masked.items() if c != "c5"])
    assert not np.array_equal(partial, secagg.masked_sum([q for c, q in quantized.items()
                                                          if c != "c5"]))


def test_quantize_clips_and_counts() -> None:
    q, clipped = secagg.quantize(np.array([0.5, -3.0, 3.0, -0.25]), 1.0, 1.0)
    assert clipped == 2
    assert np.allclose(secagg.dequantize(q, 1.0), [0.5, -1.0, 1.0, -0.25])


def test_one_masked_contribution_is_uniform() -> None:
    values = {c: np.full(60_000, 0.125) for c in PLACEMENT}  # a constant: far from uniform
    weights = dict.fromkeys(PLACEMENT, 1 / len(PLACEMENT))
    quantized, masked = masked_round(PLACEMENT, values, weights, clip_range=1.0)
    for c in ("c0", "c2", "c5"):  # first of a cluster (pair masks), inner, alone in c
        buckets = np.bincount(masked[c] >> (secagg.RING_BITS - 8), minlength=256)
        assert stats.chisquare(buckets).pvalue > 1e-6, c
        low = np.bincount(masked[c] & 0xFF, minlength=256)
        assert stats.chisquare(low).pvalue > 1e-6, c
    # the same test tells a plain quantized update apart
    plain = np.bincount(quantized["c0"] >> (secagg.RING_BITS - 8), minlength=256)
    assert stats.chisquare(plain + 1).pvalue < 1e-6
    # masks differ by round
    _, again = masked_round(PLACEMENT, values, weights, 1.0, tag="r2")
    assert not np.array_equal(again["c0"], masked["c0"])


def test_dropped_cluster_is_recovered_from_shamir_shares() -> None:
    rng = np.random.default_rng(1)
    values = {c: rng.normal(0, 0.2, 3000) for c in PLACEMENT}
    weights = dict.fromkeys(PLACEMENT, 1 / len(PLACEMENT))
    quantized, masked = masked_round(PLACEMENT, values, weights, clip_range=1.0)
    keyset = keys()
    shares = secagg.share_key(keyset["b"], threshold=2, count=3)  # one per cluster
    survivors = [c for c, where in PLACEMENT.items() if where != "b"]
    partial = secagg.masked_sum([masked[c] for c in survivors])
    rebuilt = secagg.combine_key([shares[0], shares[2]])  # a's and c's shares
    assert secagg.private_bytes(rebuilt) == secagg.private_bytes(keyset["b"])
    fix = secagg.dropped_correction("b", rebuilt, {c: secagg.public_bytes(keyset[c])
                                                   for c in ("a", "c")}, JOB, "r1", 3000)
    recovered = secagg.masked_sum([partial, fix])
    assert np.array_equal(recovered, secagg.masked_sum([quantized[c] for c in survivors]))
    # one share alone is not the key
    wrong = secagg.combine_key([shares[1]])
    assert secagg.private_bytes(wrong) != secagg.private_bytes(keyset["b"])


def test_clip_bounds_the_l2_norm() -> None:
    x = np.array([3.0, 4.0])
    clipped, norm = dp.clip(x, 1.0)
    assert norm == 5.0 and np.isclose(np.linalg.norm(clipped), 1.0)
    same, _ = dp.clip(x, 10.0)
    assert np.array_equal(same, x)


@pytest.mark.parametrize(("z", "q", "rounds"), [(1.0, 0.1, 100), (1.1, 1.0, 30), (0.8, 0.25, 50)])
def test_accountant_matches_the_library(z: float, q: float, rounds: int) -> None:
    inner: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        inner = dp_accounting.PoissonSampledDpEvent(q, inner)
    library = pld.PLDAccountant(value_discretization_interval=1e-3)
    library.compose(inner, rounds)
    assert dp.epsilon(z, q, rounds, 1e-5) == pytest.approx(library.get_epsilon(1e-5), rel=1e-12)
    # a finer discretization moves it by little; RDP's bound is looser
    fine = pld.PLDAccountant(value_discretization_interval=1e-4)
    fine.compose(inner, rounds)
    assert fine.get_epsilon(1e-5) <= dp.epsilon(z, q, rounds, 1e-5) < fine.get_epsilon(1e-5) * 1.01
    loose = rdp.RdpAccountant()
    loose.compose(inner, rounds)
    assert dp.epsilon(z, q, rounds, 1e-5) < loose.get_epsilon(1e-5)
    # full participation: T rounds of z are one Gaussian of z / sqrt(T), exactly
    if q == 1:
        once = pld.PLDAccountant(value_discretization_interval=1e-3)
        once.compose(dp_accounting.GaussianDpEvent(z / math.sqrt(rounds)))
        assert dp.epsilon(z, q, rounds, 1e-5) == pytest.approx(once.get_epsilon(1e-5), rel=0.01)


def test_an_executor_imports_the_accountant_only_when_it_accounts() -> None:
    """dp_accounting (scipy under it) is ~1.5 s of CPU at every executor's start."""
    code = ("import sys, worker.executor.__main__\n"
            "print(','.join(m for m in ('dp_accounting', 'scipy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    assert dp.epsilon(2.0, 0.5, 3, 1e-5) > 0  # and imports it when it does


def test_noise_for_a_target_epsilon() -> None:
    for target in (1.0, 4.0, 8.0):
        z = dp.noise_for(target, 1e-5, 0.1, 20)
        assert dp.epsilon(z, 0.1, 20, 1e-5) <= target * (1 + 1e-6)
        assert dp.epsilon(z * 0.97, 0.1, 20, 1e-5) > target
    assert dp.epsilon(1.0, 0.1, 0, 1e-5) == 0.0


def job(**privacy: object) -> JobSpec:
    return JobSpec.from_dict({"job": {"id": JOB}, "aggregation": {"name": "fedavg"},
                              "data": {"number_of_clients": 6},
                              "training": {"federated_learning_rounds": 10},
                              "privacy": privacy})


def model(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((40, 50), value, dtype=np.float32), "b": np.full(7, value, np.float32),
            "bn.num_batches_tracked": np.array(10, dtype=np.int64)}


def test_central_noise_has_the_expected_scale() -> None:
    spec = job(dp="central", clip_norm=0.5, noise_multiplier=2.0)
    privacy = Privacy(spec, "a", locate=lambda c: "a", samples=lambda c: 10)
    start = {"w": np.zeros((300, 400), np.float32), "b": np.zeros(7, np.float32)}
    [(out, samples)] = privacy.combine(start, [(start, 10)] * 4)
    noise = flatten(out)
    assert samples == 40
    assert np.std(noise) == pytest.approx(2.0 * 0.5 / 4, rel=0.03)
    assert abs(np.mean(noise)) < 0.01
    # without DP nothing is added
    plain = Privacy(job(secure_aggregation=True), "a", locate=lambda c: "a",
                    samples=lambda c: 10)
    assert plain.epsilon(3) != plain.epsilon(3)  # NaN: no accountant without DP


def central(epsilon: float = 8.0, fraction: float = 1.0, **privacy: object) -> Privacy:
    spec = JobSpec.from_dict({"job": {"id": JOB}, "data": {"number_of_clients": 100},
                              "training": {"federated_learning_rounds": 15,
                                           "client_fraction": fraction},
                              "privacy": {"dp": "central", "epsilon": epsilon, **privacy}})
    return Privacy(spec, "a", locate=lambda c: "a", samples=lambda c: 10)


def test_central_dp_from_a_target_epsilon_spends_it_over_the_rounds() -> None:
    """A fresh draw a round (not tree noise: a client in all of 15 rounds changes a tree's
    nodes by sqrt(120) clip norms, not by the depth's 2), accounted as the library does."""
    private = central(8.0)
    z = private.noise_multiplier
    library = pld.PLDAccountant(value_discretization_interval=dp.DISCRETIZATION)
    library.compose(dp_accounting.GaussianDpEvent(z), 15)
    assert private.epsilon(15) == pytest.approx(library.get_epsilon(1e-5), rel=1e-12)
    assert private.epsilon(15) == pytest.approx(8.0, rel=0.01)
    assert private.epsilon(7) < private.epsilon(8) < private.epsilon(15)
    assert central(8.0, fraction=0.05).sampling_rate == 0.05


def test_adaptive_clipping_accounts_the_count_and_follows_the_quantile() -> None:
    """clip_quantile: the update's noise and the noised count of updates within the clip
    norm (sensitivity 1/2) are one Gaussian of the accountant's z per round, so the epsilon
    reported is the library's for that Gaussian; the norm moves to the quantile asked."""
    for epsilon in (1.0, 8.0):
        private = central(epsilon, clip_quantile=0.5)
        fixed = central(epsilon)
        assert private.count_std == max(5.0, fixed.noise_multiplier)  # 0.05 x 100 clients
        assert private.update_z > fixed.noise_multiplier == private.noise_multiplier
        joint = (private.update_z ** -2 + (2 * private.count_std) ** -2) ** -0.5
        library = pld.PLDAccountant(value_discretization_interval=dp.DISCRETIZATION)
        library.compose(dp_accounting.GaussianDpEvent(joint), 15)
        assert private.epsilon(15) == pytest.approx(library.get_epsilon(1e-5), rel=1e-6)
        assert private.epsilon(15) == pytest.approx(epsilon, rel=0.01)
    private = central(8.0, clip_quantile=0.5, clip_norm=0.1)
    private._rng = np.random.default_rng(3)
    start = {"w": np.zeros(400, np.float32)}
    norms = np.linspace(0.2, 2.0, 100)  # median 1.1
    updates = [({"w": np.full(400, n / 20, np.float32)}, 10) for n in norms]
    seen = []
    for _ in range(60):
        bound = private.clip.get("root", 0.1)
        [(out, _)] = private.combine(start, updates, "root")
        seen.append(bound)
    assert seen[0] == 0.1 and seen[1] > 0.1  # all clipped: the norm grows
    assert 0.85 < np.median(seen[-20:]) < 1.4
    zero = [({"w": np.zeros(400, np.float32)}, 10)] * 100
    [(out, _)] = private.combine(start, zero, "other")  # its own norm, from clip_norm
    assert np.std(flatten(out)) == pytest.approx(private.update_z * 0.1 / 100, rel=0.15)
    assert private.clip["other"] < 0.1  # all within: it shrinks


def test_clipping_leaves_integer_buffers_out() -> None:
    privacy = Privacy(job(dp="central", clip_norm=0.5, noise_multiplier=1.0), "a",
                      locate=lambda c: "a", samples=lambda c: 10)
    start = {"w": np.zeros(4, np.float32), "n": np.array(3, np.int64)}
    trained = {"w": np.array([0.3, 0, 0, 0], np.float32), "n": np.array(1003, np.int64)}
    sent = privacy.protect("c0", 1, start, trained, ["c0"], "server")
    assert np.array_equal(sent["w"], trained["w"]) and sent["n"] == 1003  # norm 0.3 < 0.5
    far = {"w": np.array([3.0, 4.0, 0, 0], np.float32), "n": np.array(5, np.int64)}
    assert np.allclose(privacy.protect("c0", 1, start, far, ["c0"], "server")["w"],
                       [0.3, 0.4, 0, 0])


def test_local_noise_is_added_by_the_client() -> None:
    spec = job(dp="local", clip_norm=1.0, noise_multiplier=1.5)
    privacy = Privacy(spec, "a", locate=lambda c: "a", samples=lambda c: 10)
    start = {"w": np.zeros((300, 400), np.float32)}
    sent = privacy.protect("c0", 1, start, start, ["c0"], "server")
    assert np.std(flatten(sent)) == pytest.approx(1.5, rel=0.03)
    assert privacy.sampling_rate == 1.0


def privacy_sides(spec: JobSpec, samples: dict[str, int]) -> tuple[dict[str, Privacy], dict[str, bytes | None]]:
    """Each cluster's executor side of `spec` (clients placed by PLACEMENT), the public keys
    exchanged: (sides, public keys)."""
    sides = {c: Privacy(spec, c, locate=PLACEMENT.__getitem__, samples=samples.__getitem__)
             for c in CLUSTERS}
    public = {c: p.public_key() for c, p in sides.items()}
    for p in sides.values():
        p.set_peer_keys(public)  # type: ignore[arg-type]
    return sides, public


def test_honest_but_curious_aggregator_sees_only_masked_updates() -> None:
    """Three clusters' executors; the aggregator (on a) records what reaches it: every
    update is uniform-looking, and the combined model is FedAvg's."""
    spec = job(secure_aggregation=True, clip_range=1.0)
    samples = {c: 5 + 3 * i for i, c in enumerate(PLACEMENT)}
    sides, _ = privacy_sides(spec, samples)
    rng = np.random.default_rng(3)
    start = model(0.1)
    trained = {c: {k: v + rng.normal(0, 0.05, v.shape).astype(v.dtype)
                   if v.dtype.kind == "f" else v + 4 + i  # a counter: in the clear, averaged
                   for k, v in start.items()} for i, c in enumerate(PLACEMENT)}
    contributors = sorted(PLACEMENT)
    received = [(sides[PLACEMENT[c]].protect(c, 4, start, trained[c], contributors, "g"),
                 samples[c])
                for c in contributors]
    for (w, _), c in zip(received, contributors, strict=True):
        seen = flatten(w)
        assert np.all(seen == np.rint(seen)) and seen.min() >= 0
        assert seen.max() < 2 ** secagg.RING_BITS
        assert np.corrcoef(seen, flatten(trained[c]) - flatten(start))[0, 1] < 0.1
        assert np.mean(seen) / 2 ** secagg.RING_BITS == pytest.approx(0.5, abs=0.05)
    [(combined, total)] = sides["a"].combine(start, received)
    plain = sum(samples[c] * flatten(trained[c]) for c in contributors) / sum(samples.values())
    assert total == sum(samples.values())
    assert np.max(np.abs(flatten(combined) - plain)) < 1e-5
    counter = sum(samples[c] * (14 + i) for i, c in enumerate(contributors)) / total
    assert combined["bn.num_batches_tracked"] == round(counter)
    # a repeated round (a new attempt) masks afresh: no mask is used in two sums
    sides["b"].attempt = 1
    again = sides["b"].protect("c2", 4, start, trained["c2"], contributors, "g")
    assert not np.array_equal(flatten(again), flatten(received[2][0]))


def test_a_dropped_cluster_is_recovered_through_the_executors_masks() -> None:
    """The executors' own masks (Privacy.protect, sample weights, the round's attempt in
    the tag): cluster b drops after the masks were fixed; a's and c's Shamir shares of b's
    key rebuild it, and the survivors' masked sum plus `dropped_correction` is exactly
    their quantized sum, whose rescaled value is their weighted mean update."""
    spec = job(secure_aggregation=True, clip_range=1.0)
    samples = {c: 4 + 5 * i for i, c in enumerate(PLACEMENT)}
    sides, public = privacy_sides(spec, samples)
    for p in sides.values():
        p.attempt = 2
    rng = np.random.default_rng(7)
    start = model(0.2)
    trained = {c: {k: v + rng.normal(0, 0.05, v.shape).astype(v.dtype) if v.dtype.kind == "f"
                   else v for k, v in start.items()} for c in PLACEMENT}
    contributors = sorted(PLACEMENT)
    sent = {c: flatten(sides[PLACEMENT[c]].protect(c, 6, start, trained[c], contributors, "g"))
            for c in contributors}
    survivors = [c for c in contributors if PLACEMENT[c] != "b"]
    total = sum(samples.values())
    deltas = {c: flatten(trained[c]) - flatten(start) for c in contributors}
    quantized = secagg.masked_sum([secagg.quantize(deltas[c], samples[c] / total, 1.0)[0]
                                   for c in survivors])
    partial = secagg.masked_sum([sent[c].astype(np.uint32) for c in survivors])
    assert not np.array_equal(partial, quantized)  # b's pair masks do not cancel
    shares = secagg.share_key(sides["b"].key, threshold=2, count=3)  # type: ignore[arg-type]
    rebuilt = secagg.combine_key([shares[2], shares[0]])
    tag = sides["a"].tag(6, "g")
    fix = secagg.dropped_correction("b", rebuilt, {c: public[c] for c in ("a", "c")},  # type: ignore[misc]
                                    JOB, tag, partial.size)
    recovered = secagg.masked_sum([partial, fix])
    assert np.array_equal(recovered, quantized)
    weight = sum(samples[c] for c in survivors)
    mean = secagg.dequantize(recovered, 1.0) * total / weight
    plain = sum(samples[c] * deltas[c] for c in survivors) / weight
    assert np.max(np.abs(mean - plain)) <= len(survivors) * total / weight / 2 ** 22
    # the previous attempt's tag, or a key from one share, leaves the masks in
    sides["a"].attempt = 1
    stale = secagg.dropped_correction("b", rebuilt, {c: public[c] for c in ("a", "c")},  # type: ignore[misc]
                                      JOB, sides["a"].tag(6, "g"), partial.size)
    assert not np.array_equal(secagg.masked_sum([partial, stale]), quantized)
    one = secagg.combine_key([shares[1]])
    wrong = secagg.dropped_correction("b", one, {c: public[c] for c in ("a", "c")},  # type: ignore[misc]
                                      JOB, tag, partial.size)
    assert not np.array_equal(secagg.masked_sum([partial, wrong]), quantized)


def test_job_privacy_keys() -> None:
    spec = job(secure_aggregation=True, dp="central", epsilon=4.0, clip_norm=0.7)
    assert spec.privacy.secure_aggregation and spec.privacy.delta == 1e-5
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_dict({}).privacy.dp == "none"
    bad = [
        ({"privacy": {"dp": "central"}}, "noise_multiplier"),
        ({"privacy": {"secure_aggregation": 1}}, "true or false"),
        ({"privacy": {"dp": "global"}}, "central"),
        ({"privacy": {"secure_aggregation": True}, "topology": {"kind": "hierarchical"}},
         "star"),
        ({"privacy": {"secure_aggregation": True},
          "topology": {"kind": "hybrid", "inter_cluster_period": 2}}, "every round"),
        ({"privacy": {"secure_aggregation": True}, "transfer": {"compression": "int8"}},
         "no codec"),
        ({"privacy": {"dp": "central", "epsilon": 1.0}, "aggregation": {"name": "krum"}},
         "each update"),
        ({"privacy": {"dp": "local", "epsilon": 1.0}, "topology": {"kind": "ring"}}, "parent"),
        ({"privacy": {"delta": 1.0}}, "delta"),
        ({"privacy": {"dp": "central", "epsilon": 1.0, "clip_quantile": 1.0}}, "< 1"),
        ({"privacy": {"dp": "local", "epsilon": 1.0, "clip_quantile": 0.5}}, "norm it adapts"),
        ({"privacy": {"dp": "central", "epsilon": 1.0, "clip_quantile": 0.5,
                      "secure_aggregation": True}}, "norm it adapts"),
    ]
    for data, words in bad:
        with pytest.raises(JobSpecError, match=words):
            JobSpec.from_dict({"data": {"number_of_clients": 10}, **data})
    # central DP from a budget: fedavgm's plain step unless the job names one
    budget = {"privacy": {"dp": "central", "epsilon": 8.0}}
    assert JobSpec.from_dict(budget).aggregation.server_step == "plain"
    assert JobSpec.from_dict({**budget, "aggregation": {"server_step": "scaled"}}
                             ).aggregation.server_step == "scaled"
    assert JobSpec.from_dict({"privacy": {"dp": "central", "noise_multiplier": 1.0}}
                             ).aggregation.server_step == "scaled"
    assert JobSpec.from_dict({**budget, "aggregation": {"name": "fedadam"}}
                             ).aggregation.server_step == "scaled"
    # local DP alone works on a hierarchy
    JobSpec.from_dict({"privacy": {"dp": "local", "noise_multiplier": 1.0},
                       "topology": {"kind": "hierarchical"}})


def test_budget_caps_the_rounds() -> None:
    spec = job(dp="central", noise_multiplier=3.0, epsilon=3.0)
    privacy = Privacy(spec, "a", locate=lambda c: "a", samples=lambda c: 1)
    allowed = privacy.max_rounds()
    assert 0 < allowed < 10
    assert privacy.epsilon(allowed) <= 3.0 < privacy.epsilon(allowed + 1)
    calibrated = Privacy(job(dp="central", epsilon=3.0), "a", locate=lambda c: "a",
                         samples=lambda c: 1)
    assert calibrated.max_rounds() == 10
    assert calibrated.epsilon(10) == pytest.approx(3.0, rel=0.01)
    assert math.isfinite(calibrated.noise_multiplier)
