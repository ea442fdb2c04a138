"""GPU probes: NVML on a GPU host, a clearly labelled simulation everywhere else.

:func:`open_gpu_probe` picks one: the NVML probe when ``nvmlInit`` succeeds, else a
:class:`SimulatedGpuProbe` whose readings come from the simulated engine and all carry
``simulated=True``, so nothing downstream mistakes them for hardware figures.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import psutil
import pynvml

from services.workers.engine.base import GpuReading

logger = logging.getLogger(__name__)

T = TypeVar("T")

CUDA_DEVICES = "CUDA_VISIBLE_DEVICES"

# Bit values of nvmlClocksEventReason* in nvml.h (the same bits as the deprecated
# nvmlClocksThrottleReason*, which adds the last two).
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
    (0x200, "board_limit"),
    (0x400, "reliability"),
)


def decode_clock_event_reasons(mask: int) -> tuple[str, ...]:
    """Name each bit set in an NVML clock-event mask; unknown bits keep their hex value."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASONS:
        known |= bit
    if unknown := mask & ~known:
        names.append(f"unknown_{unknown:#x}")
    return tuple(names)


class GpuProbe(Protocol):
    simulated: bool

    def sample(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


class GpuProbeError(RuntimeError):
    """The probe is closed."""


_MISSING_ERRORS = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,  # MIG instances, some boards: utilization, power, …
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NOT_FOUND,
)


def _optional(read: Callable[[], T], default: T, what: str, index: int) -> T:
    """Read a field some GPUs or drivers do not report: ``default`` when NVML does not
    answer it. A field NVML does not support is expected (logged at debug); any other
    error is logged as a warning, never raised: one missing figure must not take the
    worker down with it (a crash loop on a MIG instance that reports no utilization)."""
    try:
        return read()
    except pynvml.NVMLError as exc:
        level = logging.DEBUG if exc.value in _MISSING_ERRORS else logging.WARNING
        logger.log(level, "GPU %d: %s unavailable: %s", index, what, exc)
        return default


def _clock_event_mask(handle: Any) -> int:
    """The current clock-event mask, through the throttle-reasons call on older NVML."""
    event_reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if event_reasons is not None:
        try:
            return int(event_reasons(handle))
        except pynvml.NVMLError_FunctionNotFound:
            pass  # the library is newer than the driver
    return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def visible_devices(value: str | None) -> tuple[str, ...] | None:
    """The GPUs a process may use, as ``CUDA_VISIBLE_DEVICES`` names them: ``None``
    (unset) every GPU; else indices or UUIDs (``GPU-…``, ``MIG-…``), comma-separated, in
    order. As CUDA does, the list ends at the first entry that is neither (``""`` or
    ``-1``: no GPU at all)."""
    if value is None:
        return None
    devices: list[str] = []
    for entry in (e.strip() for e in value.split(",")):
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            devices.append(entry)
        else:
            break
    return tuple(devices)


def own_pids() -> set[int]:
    """This process and its descendants: where this worker's GPU memory lives (vLLM's
    engine core runs in a child process)."""
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids |= {child.pid for child in me.children(recursive=True)}
    return pids


@dataclass(frozen=True, slots=True)
class _Device:
    index: int
    """The physical GPU's NVML index (nvidia-smi's), a MIG instance's included."""
    handle: Any
    """The device, or the MIG instance, whose memory and processes are read."""
    board: Any
    """The physical GPU: temperature, power and clocks are the board's."""


class NvmlProbe:
    """Reads this worker's GPUs through NVML: ``devices`` as ``visible_devices`` gives
    them (``None``: every GPU of the host). On an 8-GPU host a worker of one GPU reads
    that one, or a leak on it would be diluted in the others' mean.

    - A UUID (``GPU-…``, or ``MIG-…`` for a MIG instance) names one device whatever the
      order. An index is CUDA's, which NVML's need not be: under
      ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` CUDA counts GPUs by PCI bus id; by default
      (``FASTEST_FIRST``) it puts faster GPUs first and orders equal ones by bus id. So
      indices are mapped through the bus order, and where the host's GPUs are not all
      the same model (the fastest-first order cannot be known from NVML) a warning says
      to name them by UUID.
    - Every figure is optional: one NVML does not report (a MIG instance has no
      utilization or power of its own; some boards report no power) is ``None`` —
      missing, never fatal. Board figures of a MIG instance are its GPU's.
    - ``process_memory_bytes`` is the memory of this worker's own processes (``pids``)
      on the device, from ``nvmlDeviceGetComputeRunningProcesses``: what the controller
      judges, so that another process's memory cannot restart this worker. ``None``
      where NVML lists processes none of which is ours (in a container with its own
      PID namespace NVML reports the host's PIDs): the device's use is judged then.

    Raises ``pynvml.NVMLError`` if NVML cannot start or a named device is not found."""

    simulated = False

    def __init__(
        self,
        devices: tuple[str, ...] | None = None,
        pids: Callable[[], set[int]] = own_pids,
        device_order: str | None = None,
    ) -> None:
        pynvml.nvmlInit()
        self._open = True
        self._pids = pids
        try:
            self._devices = self._resolve(devices, device_order)
        except pynvml.NVMLError:
            self.close()
            raise

    @staticmethod
    def _resolve(devices: tuple[str, ...] | None, device_order: str | None) -> list[_Device]:
        count = int(pynvml.nvmlDeviceGetCount())
        boards = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        if devices is None:
            return [_Device(i, h, h) for i, h in enumerate(boards)]
        indexed = any(d.isdigit() for d in devices)
        by_cuda_index = _cuda_order(boards, device_order) if indexed else []
        out: list[_Device] = []
        for d in devices:
            if d.isdigit():
                board = by_cuda_index[int(d)] if int(d) < len(by_cuda_index) else None
                if board is None:
                    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
                out.append(_Device(int(pynvml.nvmlDeviceGetIndex(board)), board, board))
                continue
            handle = pynvml.nvmlDeviceGetHandleByUUID(d)
            board = handle
            if d.startswith("MIG-"):
                board = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            out.append(_Device(int(pynvml.nvmlDeviceGetIndex(board)), handle, board))
        return out

    def sample(self) -> list[GpuReading]:
        if not self._open:
            raise GpuProbeError("the NVML probe is closed")
        pids = self._pids()
        return [self._read(device, pids) for device in self._devices]

    def _read(self, device: _Device, pids: set[int]) -> GpuReading:
        index, handle, board = device.index, device.handle, device.board
        utilization = _optional(
            lambda: pynvml.nvmlDeviceGetUtilizationRates(handle), None, "utilization", index
        )
        memory = _optional(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle), None, "memory", index)
        return GpuReading(
            index=index,
            name=_optional(lambda: str(pynvml.nvmlDeviceGetName(handle)), "unknown", "name", index),
            utilization_pct=None if utilization is None else float(utilization.gpu),
            memory_utilization_pct=None if utilization is None else float(utilization.memory),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            process_memory_bytes=_optional(
                lambda: _process_memory(handle, pids), None, "processes", index
            ),
            temperature_c=_optional(
                lambda: float(pynvml.nvmlDeviceGetTemperature(board, pynvml.NVML_TEMPERATURE_GPU)),
                None,
                "temperature",
                index,
            ),
            power_w=_optional(
                lambda: pynvml.nvmlDeviceGetPowerUsage(board) / 1000.0, None, "power", index
            ),
            power_limit_w=_optional(
                lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(board) / 1000.0,
                None,
                "power limit",
                index,
            ),
            pcie_tx_kbps=_optional(
                lambda: float(
                    pynvml.nvmlDeviceGetPcieThroughput(board, pynvml.NVML_PCIE_UTIL_TX_BYTES)
                ),
                0.0,
                "PCIe TX",
                index,
            ),
            pcie_rx_kbps=_optional(
                lambda: float(
                    pynvml.nvmlDeviceGetPcieThroughput(board, pynvml.NVML_PCIE_UTIL_RX_BYTES)
                ),
                0.0,
                "PCIe RX",
                index,
            ),
            ecc_corrected=_optional(
                lambda: int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        board, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                ),
                0,
                "corrected ECC",
                index,
            ),
            ecc_uncorrected=_optional(
                lambda: int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        board, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                ),
                0,
                "uncorrected ECC",
                index,
            ),
            clock_event_reasons=_optional(
                lambda: decode_clock_event_reasons(_clock_event_mask(board)),
                (),
                "clock-event reasons",
                index,
            ),
            simulated=False,
        )

    def close(self) -> None:
        if self._open:
            self._open = False
            pynvml.nvmlShutdown()


def _process_memory(handle: Any, pids: set[int]) -> int | None:
    """The memory ``pids`` hold on the device; ``None`` when NVML lists processes and
    none is ours (PIDs of another namespace: not attributable)."""
    processes = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    ours = [p for p in processes if int(p.pid) in pids]
    if processes and not ours:
        return None
    return sum(int(p.usedGpuMemory or 0) for p in ours)


def _bus_id(board: Any) -> str:
    info = pynvml.nvmlDeviceGetPciInfo(board)
    bus = info.busId
    return (bus.decode() if isinstance(bus, bytes) else str(bus)).lower()


def _cuda_order(boards: list[Any], device_order: str | None) -> list[Any]:
    """The host's GPUs in CUDA's order (``CUDA_DEVICE_ORDER``; see ``NvmlProbe``)."""
    order = (device_order or os.environ.get("CUDA_DEVICE_ORDER") or "FASTEST_FIRST").upper()
    by_bus = sorted(boards, key=_bus_id)
    if order != "PCI_BUS_ID" and len({str(pynvml.nvmlDeviceGetName(b)) for b in boards}) > 1:
        logger.warning(
            "GPUs named by index on a host of different GPU models: CUDA orders them "
            "fastest first, which NVML cannot tell; they are read in PCI bus order. Name "
            "them by UUID in CUDA_VISIBLE_DEVICES, or set CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    return by_bus


class SimulatedGpuProbe:
    """Readings from the simulated engine (or none), every one flagged ``simulated``."""

    simulated = True

    def __init__(self, fallback: Callable[[], list[GpuReading]] | None) -> None:
        self._fallback = fallback

    def sample(self) -> list[GpuReading]:
        if self._fallback is None:
            return []
        return [replace(reading, simulated=True) for reading in self._fallback()]

    def close(self) -> None:
        """Nothing to release."""


def open_gpu_probe(
    fallback: Callable[[], list[GpuReading]] | None = None,
    devices: tuple[str, ...] | None = None,
) -> GpuProbe:
    """NVML for ``devices`` (``visible_devices``) when a driver answers, else the
    simulated probe (with the reason logged)."""
    try:
        return NvmlProbe(devices)
    except pynvml.NVMLError as exc:
        logger.info("NVML unavailable (%s): GPU readings are simulated", exc)
        return SimulatedGpuProbe(fallback)
