"""Admission's pure cores: no Kafka or Redis I/O, no clock reads.

Time comes in as ``now`` (seconds of the caller's clock); the shell (``service``, ``intake``,
``dispatcher``, ``quota``…) reads the records, charges Redis and produces what these decide.
"""
