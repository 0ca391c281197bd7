"""fabricd._relay._Frames: the frames a relay finds in a circuit it cannot decrypt."""

from __future__ import annotations

import math

from fabricd._relay import _Frames
from fabricd.admission import RATE_GRACE

OPENING = b"\x13/multistream/1.0.0\n\x07/noise\n"


def _noise(n: int) -> bytes:
    return n.to_bytes(2, "big") + bytes(n)


def test_an_honest_circuit_is_between_frames_after_each_frame_whatever_the_reads() -> None:
    stream = OPENING + _noise(100) + _noise(65535) + _noise(0) + _noise(3)
    for size in (1, 2, 7, 4096, len(stream)):
        frames = _Frames(1024.0)
        for i in range(0, len(stream), size):
            assert frames.feed(stream[i:i + size]) is None
        assert frames.noise and frames.floor is None and frames.wait() == math.inf, size


def test_a_frame_begun_must_keep_the_minimum_rate() -> None:
    frames = _Frames(1024.0)
    assert frames.feed(OPENING + b"\xff\xff\0") is None
    assert frames.floor is not None and frames.wait() < math.inf
    frames.floor.started -= RATE_GRACE + 10  # as if the frame began grace + 10 s ago
    reason = frames.feed(b"\0")
    assert reason is not None and "minimum rate" in reason
    # a multistream message dripped before Noise is chosen is on the same clock
    frames = _Frames(1024.0)
    assert frames.feed(b"\x13/multi") is None and frames.floor is not None
