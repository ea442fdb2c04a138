"""The workers' pure cores: no Kafka, Redis or engine I/O, no clock reads.

Translating a dispatch into an engine request, coalescing token deltas into reply chunks,
fingerprinting outputs for shadow comparison, and summarising a second of requests and
engine readings into the worker's report. The shell (``service``, ``serving``,
``telemetry``, ``shadowing``…) drives the engine and the bus around them.
"""
