"""The GPU probe. NVML is the permitted mock edge: this machine has no NVIDIA driver, so
the fallback path runs for real and the reading path runs against patched pynvml calls."""

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from services.workers.engine.base import GpuReading
from services.workers.gpu import (
    GpuProbeError,
    NvmlProbe,
    SimulatedGpuProbe,
    decode_clock_event_reasons,
    open_gpu_probe,
    visible_devices,
)

pytestmark = pytest.mark.unit


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _sim_reading(index: int = 0) -> GpuReading:
    return GpuReading(
        index=index,
        name="NVIDIA A100-SXM4-80GB",
        utilization_pct=42.0,
        memory_used_bytes=10,
        memory_total_bytes=100,
        temperature_c=55.0,
        power_w=250.0,
        power_limit_w=400.0,
    )


@pytest.mark.skipif(_nvml_works(), reason="NVML answers here; the fallback cannot be reached")
def test_without_a_driver_the_probe_is_simulated_and_says_so() -> None:
    probe = open_gpu_probe(lambda: [_sim_reading(0), _sim_reading(1)])
    assert isinstance(probe, SimulatedGpuProbe)
    assert probe.simulated
    readings = probe.sample()
    assert [r.index for r in readings] == [0, 1]
    assert all(r.simulated for r in readings)
    assert readings[0].utilization_pct == 42.0
    probe.close()


@pytest.mark.skipif(_nvml_works(), reason="NVML answers here; the fallback cannot be reached")
def test_without_a_driver_or_fallback_there_are_no_readings() -> None:
    probe = open_gpu_probe(None)
    assert probe.simulated
    assert probe.sample() == []


# --- the NVML path, with pynvml's device calls patched -------------------------------


class FakeDevice:
    def __init__(
        self,
        *,
        name: str = "NVIDIA H100 80GB HBM3",
        bus_id: str = "",
        processes: tuple[tuple[int, int], ...] = (),
        used: int = 60 * 1024**3,
        total: int = 80 * 1024**3,
        **unsupported: bool,
    ) -> None:
        self.unsupported = unsupported
        self.clock_mask = 0x004 | 0x040  # sw power cap + hw thermal slowdown
        self.name = name
        self.bus_id = bus_id
        self.processes = processes
        """(pid, bytes) of the compute processes on it."""
        self.used, self.total = used, total
        self.board: FakeDevice | None = None
        """Set for a MIG instance: its GPU."""


def _not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


@dataclass
class FakeNvml:
    devices: list[FakeDevice] = field(
        default_factory=lambda: [
            FakeDevice(bus_id="00000000:07:00.0"),
            FakeDevice(bus_id="00000000:0F:00.0"),
        ]
    )
    calls: dict[str, int] = field(default_factory=lambda: {"init": 0, "shutdown": 0})
    migs: dict[str, FakeDevice] = field(default_factory=dict)


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Two devices behind patched pynvml calls; tests swap devices before probing."""
    fake = FakeNvml()
    devices, calls = fake.devices, fake.calls

    def optional(name: str, value: Callable[[FakeDevice], Any]) -> Callable[..., Any]:
        def call(device: FakeDevice, *args: Any) -> Any:
            if device.unsupported.get(name):
                raise _not_supported()
            return value(device)

        return call

    def init() -> None:
        calls["init"] += 1

    def shutdown() -> None:
        calls["shutdown"] += 1

    def pcie(device: FakeDevice, counter: int) -> int:
        if device.unsupported.get("pcie"):
            raise _not_supported()
        return 1500 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 700

    def ecc(device: FakeDevice, error_type: int, counter_type: int) -> int:
        if device.unsupported.get("ecc"):
            raise _not_supported()
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        return 3 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1

    def by_uuid(uuid: str) -> FakeDevice:
        for i, device in enumerate(devices):
            if uuid == f"GPU-{i:04d}":
                return device
        if uuid in fake.migs:
            return fake.migs[uuid]
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def index_of(d: FakeDevice) -> int:
        if d.board is not None:  # NVML has no index for a MIG instance
            raise _not_supported()
        return devices.index(d)

    def board_of(d: FakeDevice) -> FakeDevice:
        assert d.board is not None
        return d.board

    def processes(d: FakeDevice) -> list[SimpleNamespace]:
        if d.unsupported.get("list_processes"):
            raise _not_supported()
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in d.processes]

    patches: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: len(devices),
        "nvmlDeviceGetHandleByIndex": lambda i: devices[i],
        "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetIndex": index_of,
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": board_of,
        "nvmlDeviceGetPciInfo": lambda d: SimpleNamespace(busId=d.bus_id.encode()),
        "nvmlDeviceGetComputeRunningProcesses": processes,
        "nvmlDeviceGetName": optional("name", lambda d: d.name),
        "nvmlDeviceGetUtilizationRates": optional(
            "utilization", lambda d: SimpleNamespace(gpu=87, memory=40)
        ),
        "nvmlDeviceGetMemoryInfo": optional(
            "memory", lambda d: SimpleNamespace(used=d.used, total=d.total, free=d.total - d.used)
        ),
        "nvmlDeviceGetTemperature": optional("temperature", lambda d: 71),
        "nvmlDeviceGetPowerUsage": optional("power", lambda d: 612_500),
        "nvmlDeviceGetEnforcedPowerLimit": optional("power", lambda d: 700_000),
        "nvmlDeviceGetPcieThroughput": pcie,
        "nvmlDeviceGetTotalEccErrors": ecc,
        "nvmlDeviceGetCurrentClocksEventReasons": optional("clocks", lambda d: d.clock_mask),
        "nvmlDeviceGetCurrentClocksThrottleReasons": optional(
            "throttle", lambda d: d.clock_mask | 0x200
        ),
    }
    for name, value in patches.items():
        monkeypatch.setattr(pynvml, name, value)
    return fake


def test_nvml_reading_converts_units(nvml: FakeNvml) -> None:
    probe = open_gpu_probe(lambda: pytest.fail("the fallback must not be used"))
    assert isinstance(probe, NvmlProbe)
    assert not probe.simulated
    first, second = probe.sample()
    assert first == GpuReading(
        index=0,
        name="NVIDIA H100 80GB HBM3",
        utilization_pct=87.0,
        memory_used_bytes=60 * 1024**3,
        memory_total_bytes=80 * 1024**3,
        temperature_c=71.0,
        power_w=612.5,
        power_limit_w=700.0,
        pcie_tx_kbps=1500.0,
        pcie_rx_kbps=700.0,
        ecc_corrected=3,
        ecc_uncorrected=1,
        clock_event_reasons=("sw_power_cap", "hw_thermal_slowdown"),
        memory_utilization_pct=40.0,
        process_memory_bytes=0,  # no process on it, so none of ours
        simulated=False,
    )
    assert second.index == 1


def test_unsupported_optional_fields_fall_back_one_by_one(nvml: FakeNvml) -> None:
    nvml.devices[1] = FakeDevice(pcie=True, ecc=True)
    probe = NvmlProbe()
    first, second = probe.sample()
    assert (second.pcie_tx_kbps, second.pcie_rx_kbps) == (0.0, 0.0)
    assert (second.ecc_corrected, second.ecc_uncorrected) == (0, 0)
    assert second.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert second.power_w == 612.5
    assert first.ecc_corrected == 3


def test_clock_reasons_use_the_throttle_call_where_the_driver_lacks_the_new_one(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(handle: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", missing)
    (reading, _) = NvmlProbe().sample()
    assert reading.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown", "board_limit")


def test_clock_reasons_use_the_throttle_call_where_pynvml_lacks_the_new_one(
    nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
    (reading, _) = NvmlProbe().sample()
    assert reading.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown", "board_limit")


def test_unsupported_clock_reasons_read_as_none(nvml: FakeNvml) -> None:
    nvml.devices[0] = FakeDevice(clocks=True, throttle=True)
    (reading, _) = NvmlProbe().sample()
    assert reading.clock_event_reasons == ()


def test_every_figure_is_optional_and_a_missing_one_reads_as_missing(nvml: FakeNvml) -> None:
    """A board that reports neither utilization, power, temperature nor memory (nor its
    processes) is read all the same, each missing figure ``None`` — never an error that
    would crash-loop the worker."""
    nvml.devices[1] = FakeDevice(
        utilization=True, power=True, temperature=True, memory=True, list_processes=True
    )
    nvml.devices[1].unsupported["name"] = True
    first, second = NvmlProbe().sample()
    assert (second.utilization_pct, second.memory_utilization_pct) == (None, None)
    assert (second.power_w, second.power_limit_w, second.temperature_c) == (None, None, None)
    assert (second.memory_used_bytes, second.memory_total_bytes) == (None, None)
    assert second.process_memory_bytes is None
    assert second.name == "unknown"
    assert first.power_w == 612.5


def test_memory_is_attributed_to_this_workers_processes(nvml: FakeNvml) -> None:
    """Another process on the same GPU holds 50 GiB: this worker's processes (itself and
    its engine core child) hold 12 GiB, and that is what it reports as its own."""
    gib = 1024**3
    nvml.devices[0] = FakeDevice(processes=((100, 10 * gib), (101, 2 * gib), (999, 50 * gib)))
    nvml.devices[1] = FakeDevice(processes=((5000, 30 * gib),))  # PIDs of another namespace
    first, second = NvmlProbe(pids=lambda: {100, 101}).sample()
    assert first.process_memory_bytes == 12 * gib
    assert first.memory_used_bytes == 60 * gib  # the device's, every process's
    assert second.process_memory_bytes is None  # listed, none ours: not attributable


def test_cuda_indices_follow_cudas_device_order_not_nvmls(nvml: FakeNvml) -> None:
    """NVML index 0 sits on PCI bus 0F, index 1 on bus 07: CUDA's device 0 is the one
    on bus 07 (by bus id, and fastest-first between equal GPUs)."""
    nvml.devices[0].bus_id, nvml.devices[1].bus_id = "00000000:0F:00.0", "00000000:07:00.0"
    assert [r.index for r in NvmlProbe(("0",), device_order="PCI_BUS_ID").sample()] == [1]
    assert [r.index for r in NvmlProbe(("0",), device_order="FASTEST_FIRST").sample()] == [1]
    assert [r.index for r in NvmlProbe(("1", "0")).sample()] == [0, 1]


def test_indices_on_a_host_of_mixed_gpus_are_warned_about(
    nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    nvml.devices[1].name = "NVIDIA A100-SXM4-80GB"
    NvmlProbe(("0",))
    assert "Name them by UUID" in caplog.text
    caplog.clear()
    NvmlProbe(("0",), device_order="PCI_BUS_ID")  # the order is known: no warning
    NvmlProbe(("GPU-0001",))
    assert "Name them by UUID" not in caplog.text


def test_a_mig_instance_reads_its_own_memory_and_its_gpus_board_figures(
    nvml: FakeNvml,
) -> None:
    """A MIG instance has no utilization or power of its own (NVML: not supported):
    those are missing; its memory and processes are its own; temperature is its GPU's,
    and it is reported under its GPU's index."""
    gib = 1024**3
    mig = FakeDevice(
        utilization=True, power=True, temperature=True, used=5 * gib, total=10 * gib,
        processes=((100, 4 * gib),),
    )  # fmt: skip
    mig.board = nvml.devices[1]
    nvml.migs["MIG-abcd"] = mig
    (reading,) = NvmlProbe(("MIG-abcd",), pids=lambda: {100}).sample()
    assert reading.index == 1
    assert (reading.memory_used_bytes, reading.memory_total_bytes) == (5 * gib, 10 * gib)
    assert reading.process_memory_bytes == 4 * gib
    assert reading.utilization_pct is None
    assert reading.temperature_c == 71.0  # the board's
    assert reading.power_w == 612.5


def test_close_shuts_nvml_down_once(nvml: FakeNvml) -> None:
    probe = NvmlProbe()
    probe.close()
    probe.close()
    assert nvml.calls == {"init": 1, "shutdown": 1}
    with pytest.raises(GpuProbeError, match="closed"):
        probe.sample()


def test_nvml_init_failure_falls_back(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    probe = open_gpu_probe(lambda: [_sim_reading()])
    assert probe.simulated
    assert probe.sample()[0].simulated


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0, ()),
        (0x001, ("gpu_idle",)),
        (0x008 | 0x080, ("hw_slowdown", "hw_power_brake_slowdown")),
        (0x100 | 0x400, ("display_clock_setting", "reliability")),
        (0x002 | 0x10000, ("applications_clocks_setting", "unknown_0x10000")),
    ],
)
def test_decode_clock_event_reasons(mask: int, names: tuple[str, ...]) -> None:
    assert decode_clock_event_reasons(mask) == names


def test_decoded_bits_match_pynvml_constants() -> None:
    for constant, name in [
        ("nvmlClocksEventReasonGpuIdle", "gpu_idle"),
        ("nvmlClocksEventReasonApplicationsClocksSetting", "applications_clocks_setting"),
        ("nvmlClocksEventReasonSwPowerCap", "sw_power_cap"),
        ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
        ("nvmlClocksEventReasonSyncBoost", "sync_boost"),
        ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal_slowdown"),
        ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal_slowdown"),
        ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "hw_power_brake_slowdown"),
        ("nvmlClocksEventReasonDisplayClockSetting", "display_clock_setting"),
        ("nvmlClocksThrottleReasonBoardLimit", "board_limit"),
        ("nvmlClocksThrottleReasonReliability", "reliability"),
    ]:
        assert decode_clock_event_reasons(getattr(pynvml, constant)) == (name,)


def test_simulated_probe_relabels_readings() -> None:
    probe = SimulatedGpuProbe(lambda: [_sim_reading()])
    (reading,) = probe.sample()
    assert reading.simulated
    assert reading.name == "NVIDIA A100-SXM4-80GB"


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        (None, None),  # unset: every GPU
        ("", ()),  # set and empty: none
        ("-1", ()),
        ("3", ("3",)),
        ("2, 0", ("2", "0")),
        ("1,x,2", ("1",)),  # CUDA stops at the first entry that is not a device
        ("GPU-8a1b,MIG-3c", ("GPU-8a1b", "MIG-3c")),
    ],
)
def test_visible_devices_reads_cuda_visible_devices_as_cuda_does(
    value: str | None, devices: tuple[str, ...] | None
) -> None:
    assert visible_devices(value) == devices


def test_a_worker_reads_only_its_own_gpus(nvml: FakeNvml) -> None:
    """On a host of four GPUs, a worker given GPU 2 (by index) or GPU 3 (by UUID) reads
    that one, reported by NVML's own index; without a list it reads them all."""
    nvml.devices.extend(
        [FakeDevice(bus_id="00000000:10:00.0"), FakeDevice(bus_id="00000000:11:00.0")]
    )
    assert [r.index for r in NvmlProbe().sample()] == [0, 1, 2, 3]
    assert [r.index for r in NvmlProbe(("2",)).sample()] == [2]
    assert [r.index for r in NvmlProbe(("GPU-0003", "0")).sample()] == [3, 0]
    assert NvmlProbe(()).sample() == []


def test_a_device_that_does_not_exist_is_an_nvml_error(nvml: FakeNvml) -> None:
    with pytest.raises(pynvml.NVMLError):
        NvmlProbe(("GPU-ffff",))
    assert nvml.calls["shutdown"] == nvml.calls["init"]  # closed on the way out


def test_a_reading_is_exported_with_dcgm_like_names() -> None:
    from prometheus_client import REGISTRY

    from services.workers.metrics import export_gpu

    reading = GpuReading(
        index=5,
        name="H100",
        utilization_pct=87.0,
        memory_used_bytes=60,
        memory_total_bytes=80,
        temperature_c=71.0,
        power_w=612.5,
        power_limit_w=700.0,
        pcie_tx_kbps=1500.0,
        pcie_rx_kbps=700.0,
        ecc_corrected=3,
        ecc_uncorrected=1,
        clock_event_reasons=("sw_power_cap",),
        memory_utilization_pct=40.0,
    )
    export_gpu("test-pool", reading)

    def value(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"pool": "test-pool", "gpu": "5", **labels})

    assert value("seawall_gpu_utilization_ratio") == 0.87
    assert value("seawall_gpu_memory_copy_utilization_ratio") == 0.40
    assert value("seawall_gpu_power_watts") == 612.5
    assert value("seawall_gpu_enforced_power_limit_watts") == 700.0
    assert value("seawall_gpu_pcie_bytes_per_second", direction="tx") == 1_500_000.0
    assert value("seawall_gpu_ecc_errors", type="uncorrected") == 1
    assert value("seawall_gpu_clock_event_active", reason="sw_power_cap") == 1
    assert value("seawall_gpu_clock_event_active", reason="hw_thermal_slowdown") == 0
