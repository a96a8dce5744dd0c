"""Where each parameter of a DeepSpeed ZeRO run lies in the ranks' flat partitions: pure arithmetic on shapes and
partition sizes, as ``zero_to_fp32`` slices them (see :mod:`.deepspeed`)."""

from __future__ import annotations

import math

from ckptfix.errors import FormatError

# A run of elements: (rank, group, first element in that rank's partition of the group, count).
Segment = tuple[int, int, int, int]


def layout_partitioned(
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    sizes: list[list[int]],
    *,
    paddings: list[list[int]] | None = None,
    source: str,
) -> dict[str, list[Segment]]:
    """ZeRO-1/2: where each parameter's elements are. ``shapes[g]``: group ``g``'s parameters in order;
    ``sizes[r][g]``: rank ``r``'s partition length of group ``g`` (the ranks' partitions, joined, are the group)."""
    world = len(sizes)
    if paddings is not None and (len(paddings) != len(shapes) or not all(isinstance(p, list) for p in paddings)):
        raise FormatError(
            f"{source}: param_alignment_paddings is not one list per parameter group ({len(shapes)}); "
            f"the rank files are damaged"
        )
    out: dict[str, list[Segment]] = {}
    for g, params in enumerate(shapes):
        starts = [0]
        for r in range(world):
            starts.append(starts[-1] + sizes[r][g])
        avail = starts[-1]
        offset = 0
        pads = paddings[g] if paddings is not None else None
        if pads is not None and len(pads) != len(params):
            raise FormatError(f"{source}: group {g} has {len(params)} parameters but {len(pads)} alignment paddings")
        if pads is not None and not all(type(p) is int and p >= 0 for p in pads):  # a negative one overlaps two
            raise FormatError(
                f"{source}: param_alignment_paddings of group {g} are {pads!r}, not counts of elements; "
                f"the rank files are damaged"
            )
        for i, (name, shape) in enumerate(params):
            numel = math.prod(shape)
            if offset + numel > avail:
                raise FormatError(
                    f"{source}: parameter '{name}' ends at element {offset + numel} of group {g}, whose partitions "
                    f"hold {avail}; the rank files are from different runs"
                )
            out[name] = _segments(starts, g, offset, numel)
            offset += numel + (pads[i] if pads is not None else 0)
        align = 2 * world  # zero_to_fp32's check: both sides padded to 2 * world (two unrelated paddings)
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise FormatError(
                f"{source}: group {g}'s parameters take {offset} elements but its partitions hold {avail}; the rank "
                f"files are from different runs, or the shapes do not match the partitions"
            )
    return out


def _segments(starts: list[int], group: int, offset: int, numel: int) -> list[Segment]:
    segs: list[Segment] = []
    end = offset + numel
    for r in range(len(starts) - 1):
        lo, hi = max(offset, starts[r]), min(end, starts[r + 1])
        if lo < hi:
            segs.append((r, group, lo - starts[r], hi - lo))
    return segs


def layout_stage3(
    shapes: list[tuple[str, tuple[int, ...]]], sizes: list[list[int]], *, source: str
) -> dict[str, list[Segment]]:
    """ZeRO-3: each rank holds ``ceil(numel / world)`` elements of every parameter, in order, across its groups
    (``sizes[r][g]``); a parameter is its slice of each rank in rank order, cut to its size."""
    world = len(sizes)
    bounds = [0]
    for n in sizes[0]:
        bounds.append(bounds[-1] + n)
    if any(s != sizes[0] for s in sizes):
        raise FormatError(
            f"{source}: the ranks' fp32 partitions differ in size ({sizes[0]} vs others); the rank "
            f"files are from different runs"
        )
    out: dict[str, list[Segment]] = {}
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > bounds[-1]:  # checked before placing: every element placed lies in some group
            raise FormatError(
                f"{source}: parameter '{name}' needs element {offset + part} of each rank's partitions, which hold "
                f"{bounds[-1]}; the rank files are from different runs"
            )
        segs: list[Segment] = []
        left = numel
        for r in range(world):
            take = min(part, left)
            left -= take
            at = offset
            while take:  # a slice may cross from one group into the next
                g = next(i for i in range(len(sizes[r])) if bounds[i] <= at < bounds[i + 1])
                n = min(take, bounds[g + 1] - at)
                segs.append((r, g, at - bounds[g], n))
                at, take = at + n, take - n
        offset += part
        out[name] = segs
    if offset != bounds[-1]:
        raise FormatError(
            f"{source}: the parameters take {offset * world} elements but the partitions hold {bounds[-1] * world}; "
            f"the rank files are from different runs, or the shapes do not match the partitions"
        )
    return out
