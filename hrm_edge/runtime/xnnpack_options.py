"""XNNPACK's weight cache in the ExecuTorch pip wheel, as ExecuTorch's Android and iOS builds run it.

XNNPACK packs a delegated linear's weights at load time, once per operator. Our programs apply one shared
block T times, so without a cache the runtime holds T packed copies of weights the file stores once, and a
decode step streams T copies through the CPU caches. ExecuTorch's XNNPACK delegate has a weight cache that
packs each weight once, keyed by its content hash (`weight_cache_enabled`, a runtime backend option). Its
Android and Apple presets build it on (tools/cmake/preset/android.cmake, apple_common.cmake:
EXECUTORCH_XNNPACK_ENABLE_WEIGHT_CACHE ON); the pip wheel's pybind preset leaves it off, and the wheel's
Python bindings have no call that sets a backend option.

So this module calls the delegate's own `XnnpackBackend::set_option` through ctypes. The backend object is
a static in the wheel's library with no exported symbol; it is found by its vtable pointer (an exported
symbol) in the library's writable data. Every step is checked (exactly one object, the value read back),
and any surprise is one clear error, never a silent fallback to the other setting."""

from __future__ import annotations

import ctypes
import functools
import os

from hrm_edge.errors import UserError

_VTABLE = "_ZTVN10executorch8backends14XnnpackBackendE"
_SET = "_ZN10executorch8backends14XnnpackBackend10set_optionERNS_7runtime20BackendOptionContextERKNS2_4SpanINS2_13BackendOptionEEE"
_GET = "_ZN10executorch8backends14XnnpackBackend10get_optionERNS_7runtime20BackendOptionContextERNS2_4SpanINS2_13BackendOptionEEE"
_KEY = b"weight_cache_enabled"


class _BackendOption(ctypes.Structure):
    # executorch::runtime::BackendOption: char key[64]; std::variant<bool, int, std::array<char, 256>> value
    _fields_ = [("key", ctypes.c_char * 64), ("storage", ctypes.c_ubyte * 256), ("index", ctypes.c_ubyte),
                ("pad", ctypes.c_ubyte * 3)]


class _Span(ctypes.Structure):
    _fields_ = [("data", ctypes.POINTER(_BackendOption)), ("length", ctypes.c_size_t)]


def _library_data_ranges(path: str) -> list[tuple[int, int]]:
    """The library's writable mappings and its .bss (the anonymous mapping right after its last one)."""
    ranges, lib_end = [], None
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        name = fields[5] if len(fields) > 5 else ""
        if name == path:
            lib_end = hi
            if "w" in fields[1]:
                ranges.append((lo, hi))
        elif lib_end is not None and lo == lib_end and not name and "w" in fields[1]:
            ranges.append((lo, hi))
            lib_end = None
    return ranges


@functools.cache  # the object's address is fixed for the life of the process: one scan
def _backend() -> tuple[ctypes.CDLL, int]:
    """(the wheel's library, the address of its XnnpackBackend object)."""
    try:
        import executorch.extension.pybindings._portable_lib as portable
    except ImportError as e:
        raise UserError(f"ExecuTorch's Python runtime is not importable: {e}") from None
    lib = ctypes.CDLL(portable.__file__)
    try:
        vtable = ctypes.addressof(ctypes.c_void_p.in_dll(lib, _VTABLE))
    except ValueError:
        raise UserError("this ExecuTorch build exports no XnnpackBackend: its XNNPACK weight cache cannot be "
                        "set (bench: --no-weight-cache)") from None
    vptr = (vtable + 16).to_bytes(8, "little")  # Itanium ABI: the object's vptr points 2 words into its vtable
    hits = []
    for lo, hi in _library_data_ranges(os.path.realpath(portable.__file__)):  # /proc/self/maps names real paths
        data = ctypes.string_at(lo, hi - lo)
        hits += [lo + i for i in range(0, len(data) - 7, 8) if data[i:i + 8] == vptr] if vptr in data else []
    if len(hits) != 1:
        raise UserError(f"found {len(hits)} XnnpackBackend objects in ExecuTorch's library, expected 1: its "
                        "XNNPACK weight cache cannot be set (bench: --no-weight-cache)")
    return lib, hits[0]


def _call(symbol: str, option: _BackendOption) -> None:
    lib, backend = _backend()
    fn = lib[symbol]
    fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Span)]
    context = (ctypes.c_ubyte * 8)()  # BackendOptionContext: an empty class
    error = fn(backend, ctypes.addressof(context), ctypes.byref(_Span(ctypes.pointer(option), 1)))
    if error != 0:
        raise UserError(f"XnnpackBackend option {option.key.decode()}: ExecuTorch error {error:#x}")


def weight_cache_enabled() -> bool:
    option = _BackendOption(key=_KEY)
    _call(_GET, option)
    if option.index != 0:  # 0: the bool alternative
        raise UserError(f"XnnpackBackend option {_KEY.decode()} is not a bool in this ExecuTorch build")
    return bool(option.storage[0])


def child_flags(enabled: bool) -> list[str]:
    """The command-line flag that carries the setting to a benchmark's child process."""
    return [] if enabled else ["--no-weight-cache"]


def set_weight_cache(enabled: bool) -> None:
    """Programs loaded after this call pack each shared weight once (enabled) or once per operator."""
    option = _BackendOption(key=_KEY)
    option.storage[0], option.index = int(enabled), 0
    _call(_SET, option)
    if weight_cache_enabled() != enabled:
        raise UserError(f"XNNPACK weight cache: set to {enabled}, reads back {not enabled}")
