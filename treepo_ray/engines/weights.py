"""How a full set of weights travels from the learner to the engines, as plain data and collectives (no Ray).

Packed weights: every tensor's bytes at an aligned offset of one flat uint8 buffer, described by a list of
`TensorSpec`s. The same layout serves both ways of sending them:
- through Ray's object store: the buffer is a numpy array, which Ray stores once per node and hands to every reader
  on that node without a copy (`unpack` makes tensors that view it; torch tensors would be deserialised, one copy
  per engine actor);
- by broadcast: the sender sends the buffer in buckets of whole tensors over a process group of its own (nccl
  between GPUs, gloo on CPU; same calls), and each receiver turns every bucket into (name, tensor) pairs as it lands.

A broadcast group is made for one transfer and torn down after it, outside torch.distributed's default group (the
learner ranks' own), from a TCP store that the sender (rank 0) hosts on its node: engines that join or leave the
pool between two transfers need nothing special. A peer lost mid-transfer fails the transfer with an exception on
every rank within the group's timeout (gloo does so by itself; NCCL as `nccl_group` sets it up), never the process:
the sender is the learner's rank 0.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

ALIGN = 64
"""Byte alignment of each tensor in the buffer (any dtype may view it; keeps copies aligned)."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lies in a packed buffer."""

    name: str
    dtype: str
    """torch dtype name, e.g. 'bfloat16'."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def layout(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[TensorSpec], int]:
    """Specs of (name, dtype, shape) laid out one after another; returns them and the buffer's size in bytes."""
    specs, offset = [], 0
    for name, dtype, shape in tensors:
        spec = TensorSpec(name, str(dtype).removeprefix("torch."), tuple(int(d) for d in shape), offset)
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    return specs, offset


def view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` describes, as a view of the uint8 `buffer` (no copy)."""
    return buffer[spec.offset:spec.offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)


def as_bytes(buffer) -> torch.Tensor:
    """A uint8 torch view of a packed buffer (a numpy array from the object store is read-only: it is only read)."""
    if isinstance(buffer, torch.Tensor):
        return buffer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(buffer)


def unpack(specs: list[TensorSpec], buffer) -> dict[str, torch.Tensor]:
    """name -> tensor views of a packed buffer (numpy or torch), without copying."""
    data = as_bytes(buffer)
    return {s.name: view(data, s) for s in specs}


@dataclass
class PackedWeights:
    """A set of weights in one buffer (None in a manifest: the bytes stay with the sender, which broadcasts them)."""

    specs: list[TensorSpec]
    nbytes: int
    buffer: np.ndarray | torch.Tensor | None = None

    def manifest(self) -> PackedWeights:
        return PackedWeights(self.specs, self.nbytes)


def buckets(specs: list[TensorSpec], nbytes: int, bucket_bytes: int) -> list[tuple[int, int, list[TensorSpec]]]:
    """Consecutive byte ranges [start, end) of whole tensors, each at most `bucket_bytes` (or one tensor if larger)."""
    out: list[tuple[int, int, list[TensorSpec]]] = []
    start, members = 0, []
    for i, spec in enumerate(specs):
        end = specs[i + 1].offset if i + 1 < len(specs) else nbytes
        if members and end - start > bucket_bytes:
            out.append((start, spec.offset, members))
            start, members = spec.offset, []
        members.append(spec)
    if members:
        out.append((start, nbytes, members))
    return out


# ---------------------------------------------------------------------------------------------- broadcast


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of one transfer, hosted by the sender on a free port of every interface."""
    return dist.TCPStore("0.0.0.0", 0, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class Broadcast:
    """One transfer's process group: rank 0 sends, every other rank receives. `backend` 'nccl' moves CUDA buffers,
    'gloo' CPU ones; nothing else differs."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float,
                 device: torch.device | None = None):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend = {backend!r}; 'nccl' (GPU) or 'gloo' (CPU)")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._left: list[tuple[int, int, list[TensorSpec]]] = []
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore("treepo-weights/", store)
        self.stream = None
        if backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)  # this thread's current device (a new thread starts on device 0)
            self.group = nccl_group(store, rank, world_size, timeout)
            # A stream of its own: the transfer neither waits for nor holds up the work queued on the default one
            # (the learner's step on rank 0, decoding on an engine).
            self.stream = torch.cuda.Stream(self.device)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.group._set_sequence_number_for_group()  # as torch.distributed does for each group it makes

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()

    def _on_stream(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Make a bucket and broadcast it on this group's stream; returns it ready for the default stream."""
        if self.stream is None:
            tensor = make()
            self._broadcast(tensor)
            return tensor
        with torch.cuda.stream(self.stream):
            tensor = make()
            self._broadcast(tensor)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        tensor.record_stream(current)  # its memory is not reused before the default stream is done with it
        return tensor

    def send(self, packed: PackedWeights, bucket_bytes: int) -> None:
        """Rank 0: broadcast `packed.buffer`, bucket by bucket."""
        data = as_bytes(packed.buffer)
        for start, end, _ in buckets(packed.specs, packed.nbytes, bucket_bytes):
            chunk = data[start:end]
            self._on_stream(lambda: chunk if chunk.device == self.device else chunk.to(self.device, non_blocking=True))
        if self.stream is not None:
            self.stream.synchronize()

    def receive(self, packed: PackedWeights, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Other ranks: (name, tensor) pairs on this group's device, bucket by bucket as they arrive (each bucket a
        fresh buffer, so a consumer may keep the tensors). A consumer that stops early must call `drain`."""
        self._left = buckets(packed.specs, packed.nbytes, bucket_bytes)
        return self._pairs()

    def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        while self._left:
            start, end, members = self._left.pop(0)
            chunk = self._on_stream(lambda: torch.empty(end - start, dtype=torch.uint8, device=self.device))
            for spec in members:
                yield spec.name, view(chunk, TensorSpec(spec.name, spec.dtype, spec.shape, spec.offset - start))

    def drain(self) -> None:
        """Receive (and drop) the buckets a failed consumer left, so the sender and the other receivers finish."""
        for start, end, _ in self._left:
            self._broadcast(torch.empty(end - start, dtype=torch.uint8, device=self.device))
        self._left = []

    def close(self, failed: bool = False) -> None:
        """Free the communicator now rather than at garbage collection; after a failed transfer by aborting it (a
        graceful shutdown would wait on a peer that is gone)."""
        if self.backend == "nccl" and self.group is not None:
            if failed:
                self.group.abort()
            else:
                self.group.shutdown()
        self.group = None


@dataclass
class Receiver:
    """A place in one transfer, picklable: made on the driver, used where the weights land (an engine actor, or each
    worker process of a tensor-parallel vLLM engine, worker i as rank `rank + i`)."""

    manifest: PackedWeights
    address: str
    port: int
    rank: int
    world_size: int
    backend: str
    bucket_bytes: int
    timeout_s: float

    def pairs(self, offset: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
        """Join as rank `rank + offset` and yield (name, tensor) pairs bucket by bucket (on this process's current
        GPU with nccl). Close the iterator when done: a consumer that stopped early (it failed) then drains the
        rest, so the sender and the other receivers finish, and the group is torn down."""
        store = dist.TCPStore(self.address, self.port, self.world_size, False, timedelta(seconds=self.timeout_s))
        group = Broadcast(store, self.rank + offset, self.world_size, self.backend, self.timeout_s)
        failed = False
        try:
            yield from group.receive(self.manifest, self.bucket_bytes)
        except GeneratorExit:
            try:
                group.drain()
            except Exception:  # noqa: BLE001 - the group itself failed: nothing left to drain
                failed = True
            raise
        except BaseException:
            failed = True
            raise
        finally:
            group.close(failed=failed)


# A lost peer must not take this process down: the weight transfer runs on the learner's rank 0, beside its
# training. ProcessGroupNCCL reads these when it is made (torch's defaults tear the process down on a communicator
# error or timeout, and its health monitor kills a process whose watchdog seems stuck); set for this group only.
_NCCL_FAIL_IN_PLACE = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",  # wait() blocks at most the group's timeout, then raises and aborts the comm
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",  # the watchdog never tears the process down
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}


def nccl_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta):
    """A NCCL process group that fails in place: each wait on it raises past `timeout` (the communicator is set up
    non-blocking, so a peer that never joins cannot hold the others in set-up either), and an error or a lost peer
    is an exception here, never the end of the process."""
    from torch.distributed.distributed_c10d import ProcessGroupNCCL  # only in CUDA builds of torch

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.config.blocking = 0  # non-blocking communicator set-up, bounded by the timeout and abortable
    saved = {k: os.environ.get(k) for k in _NCCL_FAIL_IN_PLACE}
    os.environ.update(_NCCL_FAIL_IN_PLACE)
    try:
        return ProcessGroupNCCL(store, rank, world_size, options)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
