"""The records :attr:`dlo_runtime.backend.OffloadBackend.stats` returns."""

from __future__ import annotations

import dataclasses

@dataclasses.dataclass(frozen=True)
class BlockStats:
    """Per streamed block: its size and what moving it cost so far."""

    name: str
    nbytes: int
    copies: int  # device copies (one per load)
    h2d_bytes: int
    host_copies: int  # extra host copies (staging memcpy)
    collective_bytes: int = 0  # AllGather: bytes this rank received from the others


@dataclasses.dataclass(frozen=True)
class OffloadStats:
    """What the backend uses and has done; a snapshot."""

    transport: str
    reason: str
    device: str
    unified_memory: bool
    resident_blocks: int
    buffer_bytes: int  # each of the two device buffers
    staging_bytes: int  # each of the two staging slots (0 unless staging)
    registered_bytes: int
    registration_seconds: float
    registration_calls: int
    blocks: tuple[BlockStats, ...]
    group_size: int = 1  # AllGather group size (1: rank-local)
    shard_bytes: int = 0  # AllGather: this rank's private host shards, all blocks
    sequence_seconds: float = 0.0  # AllGather: time in block-sequence checks
    gather_wait_seconds: float = 0.0  # AllGather: time blocked on gathers before blocks ran
    #: Host seconds in staging memcpys and the waits for a free staging slot,
    #: on the thread that runs the forward hooks (CUDA): time the forward
    #: spends not issuing kernels.
    staging_seconds: float = 0.0
    pinned_host_bytes: int = 0  # the backend's own pinned buffers (staging slots, shards, packed blocks)
