"""The doctor: each stage's characteristic failure modes as small pure rules over the run's streams
(metrics.jsonl, evals.jsonl), live during a run and after it (docs/doctor.md).

Layer 2: reads records, never model weights; imports nothing from stages/ or pipeline/."""

from posttrain.doctor.diagnose import RULE_NAMES, RUN_RULES, STAGE_RULES, diagnose, diagnose_stage, read_findings, write_doctor_json
from posttrain.doctor.findings import Evidence, Finding, Severity
from posttrain.doctor.live import DoctorStop, LiveDoctor
from posttrain.doctor.streams import RunStreams, Series, StageStream, build_streams, load_streams

__all__ = ["RULE_NAMES", "RUN_RULES", "STAGE_RULES", "DoctorStop", "Evidence", "Finding", "LiveDoctor", "RunStreams",
           "Series", "Severity", "StageStream", "build_streams", "diagnose", "diagnose_stage", "load_streams",
           "read_findings", "write_doctor_json"]
