"""GPU probes: NVML on a GPU host, a clearly labelled simulation everywhere else.

:func:`open_gpu_probe` picks one: the NVML probe when ``nvmlInit`` succeeds, else a
:class:`SimulatedGpuProbe` whose readings come from the simulated engine and all carry
``simulated=True``, so nothing downstream mistakes them for hardware figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

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
    """A device did not answer a reading every GPU supports (e.g. the GPU was lost)."""


def _optional(read: Callable[[], T], default: T, what: str, index: int) -> T:
    """Read a field some GPUs or drivers do not support; its absence is not a fault."""
    try:
        return read()
    except pynvml.NVMLError as exc:
        logger.debug("GPU %d: %s unavailable: %s", index, what, exc)
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


class NvmlProbe:
    """Reads this worker's GPUs through NVML: ``devices`` as ``visible_devices`` gives
    them (``None``: every GPU of the host). On an 8-GPU host a worker of one GPU reads
    that one, or a leak on it would be diluted in the others' mean. Raises
    ``pynvml.NVMLError`` if NVML cannot start or a device is not found."""

    simulated = False

    def __init__(self, devices: tuple[str, ...] | None = None) -> None:
        pynvml.nvmlInit()
        self._open = True
        try:
            if devices is None:
                count = int(pynvml.nvmlDeviceGetCount())
                handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            else:
                handles = [
                    pynvml.nvmlDeviceGetHandleByIndex(int(d))
                    if d.isdigit()
                    else pynvml.nvmlDeviceGetHandleByUUID(d)
                    for d in devices
                ]
            # reported by NVML's own index (nvidia-smi's), whichever way it was named
            self._handles = [(int(pynvml.nvmlDeviceGetIndex(h)), h) for h in handles]
        except pynvml.NVMLError:
            self.close()
            raise

    def sample(self) -> list[GpuReading]:
        if not self._open:
            raise GpuProbeError("the NVML probe is closed")
        return [self._read(index, handle) for index, handle in self._handles]

    def _read(self, index: int, handle: Any) -> GpuReading:
        try:
            name = str(pynvml.nvmlDeviceGetName(handle))
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            power_mw = pynvml.nvmlDeviceGetPowerUsage(handle)
            power_limit_mw = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)
        except pynvml.NVMLError as exc:
            raise GpuProbeError(f"GPU {index}: {exc}") from exc
        return GpuReading(
            index=index,
            name=name,
            utilization_pct=float(utilization.gpu),
            memory_utilization_pct=float(utilization.memory),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            temperature_c=float(temperature),
            power_w=power_mw / 1000.0,
            power_limit_w=power_limit_mw / 1000.0,
            pcie_tx_kbps=_optional(
                lambda: float(
                    pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
                ),
                0.0,
                "PCIe TX",
                index,
            ),
            pcie_rx_kbps=_optional(
                lambda: float(
                    pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
                ),
                0.0,
                "PCIe RX",
                index,
            ),
            ecc_corrected=_optional(
                lambda: int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                ),
                0,
                "corrected ECC",
                index,
            ),
            ecc_uncorrected=_optional(
                lambda: int(
                    pynvml.nvmlDeviceGetTotalEccErrors(
                        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                ),
                0,
                "uncorrected ECC",
                index,
            ),
            clock_event_reasons=_optional(
                lambda: decode_clock_event_reasons(_clock_event_mask(handle)),
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
