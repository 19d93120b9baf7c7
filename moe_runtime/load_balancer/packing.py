"""Balanced packing of weighted items into equal-size bins.

Used twice: expert groups onto nodes, and expert replicas onto ranks. Every
bin receives exactly `bin_size` items and never two items with the same key
(two replicas of one expert on one rank would take no load off that rank).
"""

from __future__ import annotations

import numpy as np


def balanced_pack(
    weight: np.ndarray, key: np.ndarray, num_bins: int, bin_size: int
) -> np.ndarray:
    """[n] int64 bin of each item; n must equal num_bins * bin_size.

    Longest-processing-time first: items by decreasing weight, each into the
    lightest bin that has room and does not hold its key yet. When every bin
    with room already holds the key, a full bin without the key hands one of
    its items to a bin with room (one always exists when no key appears more
    than `num_bins` times), and the item takes the freed place.
    """
    num_items = weight.shape[0]
    if num_items != num_bins * bin_size:
        raise ValueError(f"{num_items} items do not fill {num_bins} bins of {bin_size}")
    if num_items and np.bincount(key).max() > num_bins:
        raise ValueError(f"a key appears more than {num_bins} times; bins would share it")
    order = np.lexsort((np.arange(num_items), key, -weight))
    bin_of = np.full(num_items, -1, dtype=np.int64)
    bin_load = np.zeros(num_bins, dtype=np.float64)
    bin_fill = np.zeros(num_bins, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(num_bins)]
    keys_in_bin: list[set[int]] = [set() for _ in range(num_bins)]

    def place(item: int, target: int) -> None:
        bin_of[item] = target
        bin_load[target] += weight[item]
        bin_fill[target] += 1
        members[target].append(item)
        keys_in_bin[target].add(int(key[item]))

    for item in order:
        item_key = int(key[item])
        open_bins = [b for b in range(num_bins) if bin_fill[b] < bin_size and item_key not in keys_in_bin[b]]
        if open_bins:
            place(item, min(open_bins, key=lambda b: (bin_load[b], b)))
            continue
        donor, receiver, moved = _repair_move(item, weight, key, bin_load, bin_fill, bin_size, members, keys_in_bin)
        members[donor].remove(moved)
        keys_in_bin[donor].discard(int(key[moved]))
        bin_load[donor] -= weight[moved]
        bin_fill[donor] -= 1
        place(moved, receiver)
        place(item, donor)
    return bin_of


def _repair_move(item, weight, key, bin_load, bin_fill, bin_size, members, keys_in_bin):
    """Pick (donor bin, receiver bin, moved item) that frees room for `item`.

    Donor: a full bin without the item's key. Receiver: a bin with room that
    does not hold the moved item's key. Among all such triples, the one whose
    two touched bins end up with the smallest maximum load.
    """
    item_key = int(key[item])
    best = None
    receivers = [b for b in range(len(members)) if bin_fill[b] < bin_size]
    for donor in range(len(members)):
        if item_key in keys_in_bin[donor] or bin_fill[donor] < bin_size:
            continue
        for moved in members[donor]:
            for receiver in receivers:
                if int(key[moved]) in keys_in_bin[receiver]:
                    continue
                peak = max(bin_load[receiver] + weight[moved], bin_load[donor] - weight[moved] + weight[item])
                if best is None or peak < best[0]:
                    best = (peak, donor, receiver, moved)
    if best is None:  # unreachable when no key exceeds num_bins occurrences
        raise RuntimeError("balanced_pack: no repair move exists")
    return best[1], best[2], best[3]
