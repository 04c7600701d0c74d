"""Handing out episodes across generators.

`tasks` picks which domain, task instance and episode number comes next (a group at a time);
`coordinator` leases them to generators over ZeroMQ with flow control, watches the run and
writes its record (`report`: status.json, metrics.jsonl, the metrics endpoint's view,
`read_status`); `events` are its two append-only logs (leases and timeline).
"""
