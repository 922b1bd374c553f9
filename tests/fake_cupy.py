"""A strict stand-in for CuPy on the CPU: NumPy's arithmetic behind CuPy's rules at the host
boundary, so the engine's array path can be checked for the mistakes that only a GPU would
otherwise reveal.

CI has no GPU, and running the array path with ``xp = numpy`` cannot catch a device array that
leaks into NumPy, Numba or gguf, or a host array handed to a device operation: NumPy accepts
both. CuPy refuses them, and so does this module:

- ``numpy.asarray(device_array)`` (and anything that converts implicitly: a Numba kernel, a
  NumPy function CuPy does not dispatch) raises ``TypeError``, as ``cupy.ndarray.__array__`` does;
- a NumPy array as an operand of a device operation (``dev + host``, ``xp.where(host, ...)``,
  ``dev[...] = host``) raises ``TypeError``, as CuPy's "Unsupported type" does;
- only ``xp.asarray``/``xp.array`` copy host to device, and ``.get()``/``xp.asnumpy`` back;
- reductions and full indexing give 0-d device arrays, not NumPy scalars, and a device array
  has no ``__index__`` (a 0-d array cannot be a slice bound or a ``range`` argument).

- only names CuPy has (``tests/cupy_names.txt``: CuPy 14.2's module and ndarray names) exist,
  so a NumPy-only function or method is an AttributeError here too.

NumPy functions and ufuncs called on device arrays are dispatched to the device, as CuPy's
``__array_function__``/``__array_ufunc__`` do. Indices may be host integer arrays (CuPy copies
them). Everything computes with NumPy underneath, so a model run through this module must give
exactly the logits of the ``xp = numpy`` array path.

To refresh the name list after a CuPy release (no GPU needed, the wheel imports without one):
``pip install --target /tmp/cupy cupy-cuda12x`` and write ``dir(cupy)`` and ``dir(cupy.ndarray)``
(public names) into the two sections of tests/cupy_names.txt.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy

# every read of a device value on the host (.get(), asnumpy, int/float/bool of a device array,
# a synchronize): what a GPU would wait for; tests/fake_cupy_kernels.py counts them per step
READS: collections.Counter[str] = collections.Counter()
# every host-to-device write into an existing device array (.set()): a graph's replay is held
# to at most one (its slots' indices)
WRITES: collections.Counter[str] = collections.Counter()
# the stream capture under way (tests/fake_cupy_kernels.py): a copy between host and device
# while it records is an error on a GPU (cudaErrorStreamCaptureUnsupported), and here
CAPTURING: list[Any] = []


def _not_capturing(what: str) -> None:
    if CAPTURING:
        raise RuntimeError(f"{what} while a stream capture records (capture unsupported)")


IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
    "a NumPy array explicitly."
)


def _cupy_names() -> dict[str, frozenset[str]]:
    """The sections of tests/cupy_names.txt: [cupy] and [cupy.ndarray]."""
    sections: dict[str, set[str]] = {}
    current: set[str] = set()
    for line in (Path(__file__).parent / "cupy_names.txt").read_text().splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), set())
        elif line and not line.startswith("#"):
            current.add(line)
    return {name: frozenset(names) for name, names in sections.items()}


CUPY_NAMES = _cupy_names()


def _cupy_has(section: str, name: str) -> None:
    if not name.startswith("_") and name not in CUPY_NAMES[section]:
        raise AttributeError(f"{section} has no attribute {name!r} (NumPy has; CuPy does not)")


def _device(value: Any, where: str) -> Any:
    """The NumPy array behind a device operand; a host array here is CuPy's TypeError."""
    if isinstance(value, DeviceArray):
        return value.host_view
    if isinstance(value, numpy.ndarray):
        raise TypeError(
            f"Unsupported type {type(value)} in {where}: a host array where CuPy "
            "wants a device array (copy it with xp.asarray first)"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_device(item, where) for item in value)
    return value  # Python and NumPy scalars, dtypes, None, slices, Ellipsis


def _index(key: Any) -> Any:
    """An index: device arrays unwrap, host integer arrays and lists pass (CuPy copies them)."""
    if isinstance(key, DeviceArray):
        return key.host_view
    if isinstance(key, tuple):
        return tuple(_index(item) for item in key)
    return key


def _on_device(value: Any) -> Any:
    if isinstance(value, numpy.ndarray):
        return DeviceArray(value)
    if isinstance(value, numpy.generic):  # CuPy gives 0-d arrays, never NumPy scalars
        return DeviceArray(numpy.asarray(value))
    if isinstance(value, tuple):
        return tuple(_on_device(item) for item in value)
    if isinstance(value, list):
        return [_on_device(item) for item in value]
    return value


def _device_call(function: Callable[..., Any], where: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_device(a, where) for a in args)
        kwargs = {k: _device(v, where) for k, v in kwargs.items()}
        return _on_device(function(*args, **kwargs))

    return call


class DeviceArray:
    """A CuPy-like array: the data is a NumPy array the engine may not touch directly."""

    __slots__ = ("host_view",)
    __array_priority__ = 100.0

    def __init__(self, data: numpy.ndarray):
        self.host_view = data  # the tests' own window onto the data; the engine never sees it

    def __array__(self, *args: Any, **kwargs: Any) -> numpy.ndarray:
        raise TypeError(IMPLICIT)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        where = f"numpy.{ufunc.__name__}"
        return _device_call(getattr(ufunc, method), where)(*inputs, **kwargs)

    def __array_function__(self, function: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        return _device_call(function, f"numpy.{function.__name__}")(*args, **kwargs)

    def get(self) -> numpy.ndarray:
        """The host copy, as cupy.ndarray.get."""
        _not_capturing("a device-to-host copy")
        READS["get"] += 1
        return self.host_view.copy()

    def set(self, host: numpy.ndarray) -> None:
        _not_capturing("a host-to-device copy")
        WRITES["set"] += 1
        self.host_view[...] = host

    @property
    def data(self) -> Any:  # CuPy's is a device pointer, not a host buffer
        raise TypeError("a device array has no host buffer (.data is a cupy MemoryPointer)")

    @property
    def T(self) -> DeviceArray:
        return DeviceArray(self.host_view.T)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # NumPy's __array_interface__/__array_struct__: CuPy has none
            raise AttributeError(name)
        _cupy_has("cupy.ndarray", name)
        value = getattr(self.host_view, name)
        if callable(value):
            return _device_call(value, f"ndarray.{name}")
        return value  # shape, dtype, ndim, size, nbytes, strides, flags, itemsize

    def __getitem__(self, key: Any) -> Any:
        return _on_device(self.host_view[_index(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.host_view[_index(key)] = _device(value, "ndarray.__setitem__")

    def __len__(self) -> int:
        return len(self.host_view)

    def __iter__(self) -> Any:
        return (_on_device(row) for row in self.host_view)

    def __bool__(self) -> bool:
        READS["bool"] += 1
        return bool(self.host_view)

    def __float__(self) -> float:
        READS["float"] += 1
        return float(self.host_view)

    def __int__(self) -> int:
        READS["int"] += 1
        return int(self.host_view)

    def __repr__(self) -> str:
        return f"device {self.host_view!r}"

    # no __index__: CuPy arrays have none


def _operator(name: str) -> Callable[..., Any]:
    def apply(self: DeviceArray, *others: Any) -> Any:
        method = getattr(self.host_view, name)
        result = method(*(_device(o, f"ndarray.{name}") for o in others))
        if result is NotImplemented:
            return result
        if name.startswith("__i"):  # in place: the same device array
            return self
        return _on_device(result)

    apply.__name__ = name
    return apply


for _name in [
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
    "matmul",
    "and",
    "or",
    "xor",
    "lshift",
    "rshift",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
]:
    for _form in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        if hasattr(numpy.ndarray, _form):
            setattr(DeviceArray, _form, _operator(_form))
for _form in ("__neg__", "__pos__", "__abs__", "__invert__"):
    setattr(DeviceArray, _form, _operator(_form))


class FakeCupy(types.ModuleType):
    """``import cupy`` for the tests: NumPy's names, with CuPy's rules at the host boundary."""

    ndarray = DeviceArray

    def __init__(self) -> None:
        super().__init__("fake_cupy")
        self.transfers = 0  # host -> device copies, so a test can see weights went over once

    def asarray(self, value: Any, dtype: Any = None, order: Any = None) -> DeviceArray:
        """The host-to-device copy (CuPy's cupy.asarray of a NumPy array)."""
        if isinstance(value, DeviceArray):
            return value if dtype is None else DeviceArray(value.host_view.astype(dtype))
        _not_capturing("a host-to-device copy")
        self.transfers += 1
        return DeviceArray(numpy.array(value, dtype=dtype, order=order or "K", copy=True))

    array = asarray

    @staticmethod
    def asnumpy(value: Any) -> numpy.ndarray:
        if isinstance(value, DeviceArray):
            READS["asnumpy"] += 1
            return value.host_view.copy()
        return numpy.asarray(value)

    @staticmethod
    def get_array_module(*args: Any) -> types.ModuleType:
        return FAKE if any(isinstance(a, DeviceArray) for a in args) else numpy

    def __getattr__(self, name: str) -> Any:
        _cupy_has("cupy", name)
        value = getattr(numpy, name)
        if isinstance(value, type) or not callable(value):
            return value  # dtypes (xp.float32(1) is a NumPy scalar in CuPy too), constants
        return _device_call(value, f"cupy.{name}")


FAKE = FakeCupy()
