"""The controller's decider: for each pool, telemetry in, control events out. Pure: no
Kafka, no faust; time is what the caller passes as ``now``.

- ``pool``: ``PoolDecider``, what telemetry and time decide (and its ``Output``);
- ``state``: ``PoolState``, the decisions in force for a pool and its workers, how they
  are issued, re-published and persisted, and what is read of them;
- ``records``: what survives a restart (``PoolRecord``, ``WorkerRecord``, ``Records``);
- ``evidence``: the wire's bounds on evidence, re-publication and the descriptions of a
  state;
- ``config``: ``DeciderConfig`` and ``scaled_config``.
"""
