"""What an on-policy round's copy costs in fresh memory against memory already mapped.

``RolloutBuilder`` copies each round (rows gathered from the ring's step-major chunks
into env-major batch rows) into tensors allocated for that batch alone. Fresh memory is
mapped by the kernel page by page on first write, so the copy also pays a page fault
per page. This times one field of the Atari round of ``examples/ppo_atari.py`` (32 envs
of 128 steps, 4 x 84 x 84 uint8 each, 116 MB) copied with the builder's ``np.take``:

* ``fresh``: into a new ``np.empty`` array, as the builder did before ``prefault``;
* ``prefault_cost``: one byte written per page of a new array (``ChunkBuilder.prefault``);
* ``prefaulted``: the copy into that array afterwards;
* ``warm_reuse``: into an array copied into before (no faults at all).

``python benchmarks/experiments/first_touch.py`` prints the medians of 7 repeats.
"""

import mmap
import statistics
import time

import numpy as np

T, K, SHAPE = 128, 32, (4, 84, 84)


def main() -> None:
    src = np.random.default_rng(0).integers(0, 255, (T * K, *SHAPE), dtype=np.uint8)
    order = np.argsort(np.tile(np.arange(K), T), kind="stable")  # step-major → env-major

    def copy(dst: np.ndarray) -> None:
        np.take(src, order, axis=0, out=dst, mode="clip")

    times: dict[str, list[float]] = {
        "fresh": [],
        "prefault_cost": [],
        "prefaulted": [],
        "warm_reuse": [],
    }
    reuse = np.empty_like(src)
    copy(reuse)
    for _ in range(7):
        t = time.perf_counter()
        dst = np.empty_like(src)
        copy(dst)
        times["fresh"].append(time.perf_counter() - t)
        del dst
        dst = np.empty_like(src)
        t = time.perf_counter()
        dst.reshape(-1)[:: mmap.PAGESIZE] = 0
        times["prefault_cost"].append(time.perf_counter() - t)
        t = time.perf_counter()
        copy(dst)
        times["prefaulted"].append(time.perf_counter() - t)
        del dst
        t = time.perf_counter()
        copy(reuse)
        times["warm_reuse"].append(time.perf_counter() - t)
    for name, values in times.items():
        median = statistics.median(values) * 1e3
        print(f"{name:14s} {median:6.1f} ms (one field, {src.nbytes / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
