"""The verl hook's id hashing on a CUDA device: wrapping int64 arithmetic must give the same ids as on the
CPU, so a sequence keeps its id whatever device computed it. Skipped without a GPU (verl is not needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from kldiag.integrations.verl import batch as hook  # noqa: E402


def test_row_hash_is_the_same_on_cuda_and_cpu():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 3000, (64,), generator=g)
    tokens = torch.randint(0, 151_936, (int(lengths.sum()),), generator=g)
    bits = (-torch.rand(int(lengths.sum()), generator=g)).view(torch.int32)
    for values in (tokens, bits):
        cpu = hook.row_hash(values, lengths)
        cuda = hook.row_hash(values.cuda(), lengths.cuda())
        assert cuda.device.type == "cuda" and torch.equal(cpu, cuda.cpu())
        assert len(set(cpu.tolist())) == 64  # distinct rows, distinct ids


def test_row_hash_tells_apart_swapped_and_shifted_tokens():
    rows = torch.tensor([[5, 7, 9], [7, 5, 9], [5, 7, 9]], device="cuda")
    h = hook.row_hash(rows.flatten(), torch.tensor([3, 3, 3], device="cuda")).tolist()
    assert h[0] == h[2] and h[0] != h[1]
    short = hook.row_hash(torch.tensor([5, 7], device="cuda"), torch.tensor([2], device="cuda")).tolist()
    assert short[0] not in h
