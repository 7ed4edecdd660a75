"""The connector's device plumbing (``device.Streams``): on the CPU backend every fence is
passed and every copy synchronous; on a GPU, side streams ordered by events. The same test
runs on CUDA tensors where torch sees a GPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcloud.integrations.vllm.device import PASSED, Streams  # noqa: E402

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
N = 1 << 20


@pytest.mark.parametrize("device", DEVICES)
def test_restores_are_in_when_loading_returns_and_saves_read_before_later_kernels(
    device: str,
) -> None:
    s = Streams(device)
    assert s.has_streams == (device == "cuda")
    host = s.host_empty((N,), torch.float32)
    assert host.shape == (N,) and host.is_pinned() == s.has_streams
    src = s.host_empty((N,), torch.float32)
    src.fill_(1.0)
    cache = torch.zeros(N, device=device)
    cache.fill_(3.0)  # the step that handed the blocks over, still queued on a GPU
    with s.loading(s.mark()):
        cache.copy_(src, non_blocking=True)
    # reported finished means written: nothing of the earlier step's fill survives
    assert cache.sum().item() == float(N)
    with s.saving():
        host.copy_(cache * 2, non_blocking=True)
    fence = s.after_save()
    cache.fill_(0.0)  # a later kernel (the blocks reused): ordered after the save's read
    fence.wait()
    assert bool((host == 2.0).all())


def test_without_streams_every_fence_is_passed() -> None:
    s = Streams("cpu")
    assert s.mark() is PASSED and s.after_save() is PASSED
    s.after_loads()  # nothing to order: every copy was synchronous
    PASSED.wait()


@pytest.mark.parametrize("device", DEVICES)
def test_a_pass_without_per_layer_waits_reads_the_load_streams_writes(device: str) -> None:
    """What a full CUDA graph replay relies on (``after_loads``): kernels queued on the
    engine's stream after it run after every write queued on the load stream before it."""
    s = Streams(device)
    src = s.host_empty((N,), torch.float32)
    src.fill_(1.0)
    cache = torch.zeros(N, device=device)
    if s.has_streams:  # a write still queued on the load stream, not waited for by the host
        with torch.cuda.stream(s._load):
            cache.copy_(src, non_blocking=True)
    else:
        cache.copy_(src)
    s.after_loads()
    assert (cache * 2).sum().item() == 2.0 * N  # the pass's read, on the engine's stream
