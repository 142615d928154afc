"""posttrain.telemetry: phases on the roofline, beside the naive busy line (docs/telemetry.md).

    from posttrain.telemetry import Telemetry, costs
    tele = Telemetry.open(run_dir, device=device, dtype=torch.bfloat16)
    with tele.phase("update", stage="sft", step=step, cost=costs.train_step(cfg, batch=B, seq_len=T)):
        ...
    sink.log({"stage": "sft", "step": step, **tele.step_metrics(stage="sft", step=step)})
    tele.close()
"""

from __future__ import annotations

from posttrain.telemetry import costs
from posttrain.telemetry.busy import BusySampler, BusySource, CpuBusy, NvmlBusy
from posttrain.telemetry.costs import Cost, ModelShape
from posttrain.telemetry.devices import (
    PEAKS_TABLE,
    DeviceSpec,
    Peaks,
    detect,
    measure_cpu_peaks,
)
from posttrain.telemetry.gap import Gap, gap, gaps_by_cycle, gaps_by_stage
from posttrain.telemetry.memory import consumers
from posttrain.telemetry.phases import (
    STANDARD_PHASES,
    Phase,
    PhaseRecord,
    Telemetry,
    read_phases,
)
from posttrain.telemetry.revision import Revision, revise
from posttrain.telemetry.roofline import (
    OVERHEAD_BELOW,
    Bound,
    Placement,
    place,
    ridge_point,
)
from posttrain.telemetry.sinks import (
    JsonlSink,
    MetricSink,
    MultiSink,
    TensorBoardSink,
    WandbSink,
)

__all__ = [
    "OVERHEAD_BELOW",
    "PEAKS_TABLE",
    "STANDARD_PHASES",
    "Bound",
    "BusySampler",
    "BusySource",
    "Cost",
    "CpuBusy",
    "DeviceSpec",
    "Gap",
    "JsonlSink",
    "MetricSink",
    "ModelShape",
    "MultiSink",
    "NvmlBusy",
    "Peaks",
    "Phase",
    "PhaseRecord",
    "Placement",
    "Revision",
    "Telemetry",
    "TensorBoardSink",
    "WandbSink",
    "consumers",
    "costs",
    "detect",
    "gap",
    "gaps_by_cycle",
    "gaps_by_stage",
    "measure_cpu_peaks",
    "place",
    "read_phases",
    "revise",
    "ridge_point",
]
