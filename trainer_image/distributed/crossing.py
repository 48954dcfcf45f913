"""Which bytes of one message go from which sending device to which receiving device,
in rounds of point-to-point transfers (pure: positions, boxes, no JAX).

The collective transport (:mod:`.collective`) moves a message from mesh ``A`` to mesh
``B`` with one ``ppermute`` per round over the devices of both meshes. This module
decides what each round carries:

1. The transfer plan (:func:`~alpajob.trainer_image.runtime.transfer.plan_transfer`, over
   mesh positions) sends each needed piece across once, to the first device of each
   group of receivers that need the same tile, and lets that device copy the tile to
   the rest of its group inside ``B``. A copy whose two ends belong to different
   processes of ``B`` cannot be a local copy: it becomes a second set of
   **routes** straight from ``A`` (as :func:`.transport.cut_for_hosts` does).
2. :func:`permutation_rounds` splits the routes into rounds in which every sending
   device sends at most one piece and every receiving device receives at most one,
   so each round is a permutation and one ``ppermute`` carries it. Greedy: a route
   goes into the first round where both its ends are free (at most ``2 d - 1``
   rounds for a device degree ``d``; ``d`` for the common one-to-one case).
3. Every piece of a round is flattened and padded to the round's longest piece: the
   round moves one ``(length,)`` block per device.

Example: ``A`` = 2 devices holding rows ``[0, 4)`` and ``[4, 8)`` of an 8 x 4 array,
``B`` = 1 device needing all of it: two routes ``0 -> 0`` (rows 0-4) and ``1 -> 0``
(rows 4-8) share their receiver, so they go in two rounds of 16 elements each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from alpajob.trainer_image.runtime.transfer import Box, box_size, plan_transfer

#: Position in a mesh -> the tile it holds.
Tiles = Mapping[int, Box]


@dataclass(frozen=True)
class Route:
    """Piece ``box`` (global coordinates) from sending position ``src`` to receiving
    position ``dst``."""

    src: int
    dst: int
    box: Box

    @property
    def size(self) -> int:
        return box_size(self.box)


@dataclass(frozen=True)
class Crossing:
    """How one message crosses from its sending mesh to its receiving mesh.

    ``rounds[r]`` are the routes of round ``r`` (a permutation), ``lengths[r]`` its
    padded block length in elements; ``copies`` are ``(from, to)`` receiving positions
    of one process (whole tiles); ``dst_tiles`` every receiving position's tile.
    """

    shape: tuple[int, ...]
    rounds: tuple[tuple[Route, ...], ...]
    lengths: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    dst_tiles: Mapping[int, Box]


def permutation_rounds(pairs: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Indices of ``pairs`` (source, destination) grouped into rounds in which no
    source and no destination repeats; every pair in exactly one round, in order."""
    rounds: list[list[int]] = []
    busy: list[tuple[set[int], set[int]]] = []
    for i, (src, dst) in enumerate(pairs):
        for members, (sending, receiving) in zip(rounds, busy, strict=True):
            if src not in sending and dst not in receiving:
                members.append(i)
                sending.add(src)
                receiving.add(dst)
                break
        else:
            rounds.append([i])
            busy.append(({src}, {dst}))
    return rounds


def plan_crossing(shape: Sequence[int], src_tiles: Tiles, dst_tiles: Tiles, dst_process: Mapping[int, int]) -> Crossing:
    """The rounds that give every receiving position its tile (see the module
    docstring); ``dst_process``: receiving position -> its process."""
    plan = plan_transfer(shape, 1, src_tiles, dst_tiles)
    routes = [Route(s.src, s.dst, s.box) for s in plan.sends]
    copies: list[tuple[int, int]] = []
    for copy in plan.copies:
        if dst_process[copy.src] == dst_process[copy.dst]:
            copies.append((copy.src, copy.dst))
        else:
            routes.extend(Route(s.src, copy.dst, s.box) for s in plan.sends if s.dst == copy.src)
    rounds = [tuple(routes[i] for i in members)
              for members in permutation_rounds([(r.src, r.dst) for r in routes])]
    return Crossing(
        shape=tuple(shape),
        rounds=tuple(rounds),
        lengths=tuple(max(r.size for r in members) for members in rounds),
        copies=tuple(copies),
        dst_tiles=dict(dst_tiles),
    )
