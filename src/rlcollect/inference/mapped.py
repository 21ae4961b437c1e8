"""Host memory the GPU reads and writes in place: page-locked, mapped ranges.

``map_host`` page-locks a numpy array's memory (``cudaHostRegister``, mapped and
portable) and returns a CUDA tensor over the same bytes (unified addressing: the host
address is the device address). Kernels then read and write it over the bus, and the
CPU copies nothing: the action step gathers a batch's observations out of the ring
this way (``step.py``), and a worker's own GPU copies transitions' observations into
its chunk (``row_copy.py``). Device reads see what the CPUs wrote before the launch
(x86 keeps the bus coherent with the caches); the CPUs see what a kernel wrote once
they have waited for it (an event, a stream synchronisation).

A range is registered once per process: registering memory that overlaps a registered
range is refused, as is memory the driver cannot pin (some sandboxes); ``map_host``
then returns None and the caller copies on the CPU instead.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = ["map_host", "unmap_host"]

_MAPPED_PORTABLE = 0x02 | 0x01  # cudaHostRegisterMapped | cudaHostRegisterPortable


class _CudaArray:
    """A page-locked, mapped host range, presented to torch as CUDA memory (UVA)."""

    def __init__(self, array: np.ndarray) -> None:
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (array.ctypes.data, False),
            "version": 3,
        }


def map_host(array: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """Page-lock ``array`` (contiguous) and view it from ``device``, or None where that
    is refused. A mapped array must be released with :func:`unmap_host` before its
    memory goes, and only once no kernel still uses it."""
    if not array.flags.c_contiguous:
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    if int(cudart.cudaHostRegister(array.ctypes.data, array.nbytes, _MAPPED_PORTABLE)) != 0:
        # The refusal stays as the thread's last CUDA error, which torch would report
        # at its next launch as that launch's failure: clear it.
        _clear_last_cuda_error()
        return None
    try:
        return torch.as_tensor(_CudaArray(array), device=device)
    except Exception:
        cudart.cudaHostUnregister(array.ctypes.data)
        return None


def unmap_host(address: int) -> None:
    """Release the range :func:`map_host` registered at ``address`` (``array.ctypes.data``)."""
    torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


def _clear_last_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error (``cudaGetLastError``), through the
    runtime library torch loaded: torch's own bindings do not offer the call."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue
