"""Argument checks of the tensor path: the manager's discipline for tensors.

Every public call of ``pagedkv.optimized.tensor`` refuses a bad argument
with a typed error from :mod:`pagedkv.spec.errors` whose message names the
argument, what was expected and what was given, *before* it writes any
tensor (docs/tensor-path.md, "Errors"). Without these checks torch fails
from deep inside with an untyped ``RuntimeError``/``IndexError``, or worse
accepts the input: a float position is truncated, an index past a CUDA
tensor is a device-side assert that ends the process's CUDA context.

Two kinds of check, so the hot path stays cheap:

- *metadata* (:func:`check_int_tensor`, :func:`check_same_length`): type,
  dtype, number of dimensions, length and device, read on the host, O(1);
- *values* (:func:`host_ints`): a few reductions (``min``, ``max``,
  ``sum``) gathered into one small tensor and read back in **one** transfer,
  O(n) device work and one device-to-host sync per call. While a CUDA stream
  is being captured into a graph a sync is impossible and the captured values
  are not the replayed ones, so the value checks are skipped there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.spec.errors import InvalidArgumentError

__all__ = ["check_device", "check_int", "check_int_tensor", "check_pin_memory",
           "check_same_length", "first_index", "host_ints", "int_array", "same_device"]


def check_int(name: str, value: object, minimum: int,
              error: type[InvalidArgumentError] = InvalidArgumentError) -> int:
    """``value`` as an int, refusing anything but an int (or numpy integer) ``>= minimum``.

    ``bool`` is refused: ``True`` as a count or id is a caller's mistake.

    Raises:
        InvalidArgumentError: not an int; below ``minimum`` (``error``, a
            subclass such as ``InvalidTokenCountError``, when given).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise error(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_device(name: str, device: object) -> torch.device:
    """``device`` (a ``torch.device`` or a string such as ``"cuda:0"``) as a
    ``torch.device`` that exists on this machine (a CUDA index below the device
    count).

    Raises:
        InvalidArgumentError: not a device, a malformed name, or a CUDA
            device that is not present.
    """
    if not isinstance(device, (str, torch.device)):
        raise InvalidArgumentError(f"{name} must be a torch.device or a device name, got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise InvalidArgumentError(f"{name} {device!r} is not a torch device: {error}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if parsed.index is not None and parsed.index >= count or count == 0:
            raise InvalidArgumentError(
                f"{name} {device!r} is not present: this machine has {count} CUDA device(s)")
    return parsed


def check_pin_memory(name: str, pin_memory: object) -> bool:
    """``pin_memory`` as a bool that this machine can honour (page-locked host
    memory needs a CUDA runtime).

    Raises:
        InvalidArgumentError: not a bool, or ``True`` without CUDA.
    """
    if not isinstance(pin_memory, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {pin_memory!r}")
    if pin_memory and not torch.cuda.is_available():
        raise InvalidArgumentError(
            f"{name}=True needs a CUDA runtime to page-lock host memory; none is available")
    return pin_memory


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def same_device(actual: torch.device, expected: torch.device) -> bool:
    """Whether a tensor on ``actual`` is on ``expected``; ``cuda`` without an
    index stands for the current CUDA device, as torch allocates there."""
    if actual == expected:
        return True
    expected_index: int | None = expected.index  # None for "cuda" (torch's stubs say int)
    if actual.type != expected.type or expected_index is not None:
        return False
    return actual.type != "cuda" or actual.index == torch.cuda.current_device()


def check_int_tensor(name: str, value: object, ndim: int, device: torch.device | None,
                     dtype: torch.dtype | None = None, device_of: str = "") -> torch.Tensor:
    """``value`` if it is a tensor of ``ndim`` dimensions on ``device`` (any
    device when ``None``; ``device_of`` names where the expected device comes
    from, for the message) with an integer dtype (exactly ``dtype`` when
    given). Cost: O(1), no sync.

    Raises:
        InvalidArgumentError: not a tensor, a float/bool/complex dtype (or
            not ``dtype``), another number of dimensions, another device.
    """
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None and value.dtype != dtype:
        raise InvalidArgumentError(f"{name} must have dtype {dtype}, got {value.dtype}")
    if not _is_int_dtype(value.dtype):
        raise InvalidArgumentError(f"{name} must have an integer dtype, got {value.dtype}")
    if value.dim() != ndim:
        raise InvalidArgumentError(
            f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    if device is not None and not same_device(value.device, device):
        source = f" (the device of {device_of})" if device_of else ""
        raise InvalidArgumentError(f"{name} is on {value.device}, expected {device}{source}")
    return value


def check_same_length(first: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor]) -> int:
    """The common length (``shape[0]``) of the named tensors.

    Raises:
        InvalidArgumentError: two lengths differ.
    """
    name, tensor = first
    n = tensor.shape[0]
    for other_name, other in others:
        if other.shape[0] != n:
            raise InvalidArgumentError(
                f"{other_name} has {other.shape[0]} entries, {name} has {n}; expected equal lengths")
    return n


def host_ints(values: Sequence[torch.Tensor]) -> list[int] | None:
    """The 0-d integer tensors ``values`` read on the host in one transfer,
    or ``None`` while the current CUDA stream is being captured (no sync is
    allowed there). Cost: one stack and one device-to-host copy (on the CPU,
    one item read each)."""
    if not values:
        return []
    device = values[0].device.type
    if device == "cpu":
        return [int(v) for v in values]  # no transfer to save: an item read is cheapest
    if device == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    # stack promotes mixed integer dtypes to a common one.
    return [int(v) for v in torch.stack(list(values)).tolist()]


def first_index(bad: torch.Tensor) -> int:
    """The index of the first ``True`` of the 1-D bool tensor ``bad`` (error
    path only: it syncs)."""
    return int(torch.nonzero(bad)[0, 0])


def int_array(name: str, values: object) -> npt.NDArray[np.int64]:
    """``values`` (a sequence, array or tensor of ints) as a 1-D int64 numpy
    array, for host-side checks.

    Raises:
        InvalidArgumentError: not a 1-D collection of ints (floats, bools, ragged).
    """
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):  # ragged or not array-like
        arr = np.asarray(None)
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must be a 1-D list of ints, got {values!r}")
    return arr.astype(np.int64, copy=False)
