"""``compressor=cer`` alone sends CER's piecewise-constant code, not dense float32 (issue 43).

CER (pFedNet paper, "Personalized Federated Learning via Learning a Mixture of Models
for Medical Data", Sec. IV-A) makes a client's update piecewise constant; its code is the
run values and the change points. The byte counts here are computed by hand (the test's own
loops), not by the codec's helpers.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedexp.comm.runs import RunLengthCodec
from fedexp.engine.runner import build_channel
from fedexp.engine.runner import build_engine
from helpers import compose_config


def _code_bytes(v: np.ndarray) -> int:
    """The piecewise-constant code's length, counted independently of ``fedexp.comm``.

    Runs of equal values; the change points as run lengths ℓ − 1 Rice-coded with the
    parameter b (0 ≤ b < 32) that gives the fewest bits, ``⌊(ℓ − 1)/2^b⌋ + 1 + b`` each;
    1 + 4 + 1 header bytes, the bits padded to a byte, 4 bytes a value; a dense fallback of
    1 + 4d bytes when that is smaller.
    """
    lengths, run = [], 1
    for a, b in zip(v[:-1], v[1:], strict=True):
        if a == b:
            run += 1
        else:
            lengths.append(run)
            run = 1
    lengths.append(run)
    bits = min(sum((n - 1) // 2**b + 1 + b for n in lengths) for b in range(32))
    return min(6 + math.ceil(bits / 8) + 4 * len(lengths), 1 + 4 * v.size)


def test_the_code_of_a_small_piecewise_constant_vector_has_its_exact_length():
    """Runs 5, 3, 1, 7 of d = 16: gaps 4, 2, 0, 6 cost 16/14/14/16 bits for b = 0/1/2/3,
    so b = 1, 14 bits = 2 bytes; 6 + 2 + 4·4 = 24 bytes, against 64 dense."""
    v = np.array([0.5] * 5 + [-1.25] * 3 + [0.5] + [2.0] * 7, dtype=np.float32)
    assert _code_bytes(v) == 24
    channel = build_channel(
        compose_config(
            "compressor=cer", "compressor.uplink.transforms.0.gamma=0"
        ).compressor.uplink,
        "compressor.uplink",
    )
    payload, _, metrics = channel.send(torch.from_numpy(v), None)
    assert len(payload) == 24  # γ = 0: CER leaves the vector as it is
    assert metrics["cer/runs"] == 4
    assert torch.equal(channel.receive(payload, v.size, "cpu"), torch.from_numpy(v))


def test_cer_alone_sends_the_code_of_its_output():
    """A random update through ``compressor=cer``: the payload is exactly the hand-counted
    code of CER's output, well below dense, and decodes to that output exactly."""
    cfg = compose_config("compressor=cer", "compressor.uplink.transforms.0.gamma=0.5")
    channel = build_channel(cfg.compressor.uplink, "compressor.uplink")
    assert isinstance(channel.codec, RunLengthCodec)
    g = torch.randn(400, generator=torch.Generator().manual_seed(0))
    payload, _, _ = channel.send(g, None)
    sent = channel.receive(payload, g.numel(), "cpu")
    (cer,) = channel.transforms
    expected, _ = cer(g)
    assert torch.equal(sent, expected)
    assert len(payload) == _code_bytes(expected.numpy()) < 0.6 * 4 * g.numel()


def test_a_cer_round_counts_the_code_not_dense_bytes(small_cfg):
    """The ledger of a round with ``compressor=cer`` counts the code: fewer bytes up than
    dense (before, the run reported exactly ``bytes/up_dense``)."""
    engine = build_engine(small_cfg("compressor=cer", "compressor.uplink.transforms.0.gamma=1"))
    engine.setup()
    metrics = engine.run_round()
    assert metrics["train/cer/runs"] < engine.x0.numel()
    assert 0 < metrics["bytes/up"] < metrics["bytes/up_dense"]
