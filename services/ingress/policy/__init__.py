"""Ingress's pure cores: no HTTP, Kafka or Redis I/O, no clock reads.

The pre-filters (body size, geography, prompt length, user agent), the API-key lifecycle
(peppered hashes, rotation, revocation) and the edge's reading of admission's quota
hints. The shell (``pipeline``, ``keystore``, ``hint_feed``, the routes) does the I/O and
asks these what to do.
"""
