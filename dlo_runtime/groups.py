"""Which existing process group DLO shards its host weights over, and the
request-wave rules that sharding imposes (seed: "DLO consumes the existing
parallel topology", "Request and loading constraints").

DLO never creates a topology: the caller initializes its DP/SP groups as it
would without offload and passes them in; :func:`offload_group` only picks
one of them.

Example:
    >>> offload_group(dp_size=1, sp_size=1).group is None
    True
    >>> offload_group(dp_size=1, sp_size=1, tp_size=2).reason
    'rank-local: no DP or SP group larger than one (TP is never DLO's AllGather group)'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from hwr_client.core.errors import InvalidArgument

DP = "dp"
SP = "sp"
RANK_LOCAL = "rank-local"

#: Request arguments that change which collectives a step issues (how many
#: forwards a step runs, and over which shapes): every request of an
#: AllGather DP wave must agree on them. ``num_inference_steps`` is checked
#: first and must also be explicit.
PATH_FIELDS = ("height", "width", "num_frames", "guidance_scale", "true_cfg_scale", "max_sequence_length")


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """DLO's weight-sharding group.

    Attributes:
        kind: ``"dp"``, ``"sp"`` or ``"rank-local"``.
        group: the process group to pass as ``process_group`` (None: the
            rank-local path, no collective).
        size: the group's size (1 for rank-local).
        reason: why, in words.
    """

    kind: str
    group: Any
    size: int
    reason: str

    @property
    def allgather(self) -> bool:
        """Whether this choice takes the AllGather path (a group of 2 or more)."""
        return self.group is not None and self.size > 1


def _size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"offload_group: {name}={value!r}, expected an integer >= 1")
    return value


def _group_of(name: str, group: Any, size: int) -> Any:
    if group is None:
        raise InvalidArgument(f"offload_group: {name}_size={size} but no {name}_group was given; DLO uses the "
                              f"existing {name.upper()} group and never creates one")
    got = group.size() if callable(getattr(group, "size", None)) else None
    if got is not None and got != size:
        raise InvalidArgument(f"offload_group: {name}_group has {got} ranks, expected {name}_size={size}")
    return group


def offload_group(*, dp_size: int, sp_size: int, tp_size: int = 1, hsdp: bool = False, dp_group: Any = None,
                  sp_group: Any = None, allgather: bool = True) -> GroupChoice:
    """Picks DLO's weight-sharding group the way the seed states it.

    1. the DP group when ``dp_size > 1``;
    2. else the SP group when ``sp_size > 1``;
    3. else rank-local (no group, no collective).

    TP is never DLO's group. HSDP shards parameters itself and must not be
    sharded a second time: HSDP with AllGather is refused, HSDP without it
    runs rank-local. ``allgather=False`` (``--dlo-no-use-allgather``) always
    runs rank-local.

    Raises:
        InvalidArgument: a size below 1, a group missing or of another size,
            or HSDP with AllGather.
    """
    dp_size, sp_size, tp_size = _size("dp_size", dp_size), _size("sp_size", sp_size), _size("tp_size", tp_size)
    if hsdp and allgather:
        raise InvalidArgument("offload_group: HSDP with DLO AllGather is refused: HSDP has its own "
                              "parameter-sharding lifecycle and must not be sharded a second time; "
                              "use allgather=False (rank-local DLO)")
    if hsdp:
        return GroupChoice(RANK_LOCAL, None, 1, "rank-local: HSDP manages its own weights (AllGather disabled)")
    if not allgather:
        return GroupChoice(RANK_LOCAL, None, 1, "rank-local: AllGather disabled; complete blocks per rank")
    if dp_size > 1:
        return GroupChoice(DP, _group_of("dp", dp_group, dp_size), dp_size,
                           f"AllGather over the DP group ({dp_size} ranks)")
    if sp_size > 1:
        return GroupChoice(SP, _group_of("sp", sp_group, sp_size), sp_size,
                           f"AllGather over the SP group ({sp_size} ranks): DP is 1")
    return GroupChoice(RANK_LOCAL, None, 1,
                       "rank-local: no DP or SP group larger than one (TP is never DLO's AllGather group)")


def _field(request: Any, name: str) -> Any:
    if isinstance(request, Mapping):
        return request.get(name)
    return getattr(request, name, None)


def validate_wave(requests: Sequence[Any], *, allgather: bool = True,
                  path_fields: Sequence[str] = PATH_FIELDS) -> None:
    """Checks that a DP wave can run under DLO AllGather: every request
    issues the same weight collectives at every denoising step.

    Requires an explicit ``num_inference_steps`` (a default could differ
    between ranks' pipelines), the same on every request, and the same
    value of every ``path_fields`` argument (missing = None). Requests are
    mappings or objects with those attributes. The rank-local path
    (``allgather=False``) imposes none of this.

    Raises:
        InvalidArgument: naming the field, the requests and their values.
    """
    if not allgather:
        return
    requests = list(requests)
    for i, r in enumerate(requests):
        steps = _field(r, "num_inference_steps")
        if steps is None:
            raise InvalidArgument(f"wave: request {i} has no explicit num_inference_steps; an AllGather DP wave "
                                  f"needs it set on every request")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidArgument(f"wave: request {i} num_inference_steps={steps!r}, expected an integer >= 1")
    for name in ("num_inference_steps", *path_fields):
        values = [_field(r, name) for r in requests]
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"request {i}: {v!r}" for i, v in enumerate(values))
            raise InvalidArgument(f"wave: {name} differs across requests ({shown}); every request of an AllGather "
                                  f"DP wave takes the same collective path at every step")
