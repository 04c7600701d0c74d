"""The ground floor: what every other package stands on, and which imports nothing else of hpcrl.

    from hpcrl.core.config import load_config     # the typed config tree, strictly from YAML
    from hpcrl.core.transport import Node         # CURVE ZeroMQ sockets, msgpack envelopes
    from hpcrl.core.rpc import RequestClient      # requests with retries; policy versions over PUB/SUB

`schema` turns YAML into frozen dataclasses (strict keys, types, bounds, dotted overrides);
`config` is the experiment's tree built on it (one section per component, `Limits` of a
sandboxed execution among them; `slurmconfig` its Slurm, scheduler and supervision sections);
`wire` is a message's form (msgpack envelope, zero-copy array frames), `transport` the layer
that moves it (keys, endpoint files, CURVE sockets) and `rpc` the patterns on it
(RequestServer/RequestClient, VersionPublisher/VersionSubscriber); `files` writes the run
directory's state atomically and durably; `liveness` has the heartbeats components write and the
supervisor's supervision.json; `metrics` serves each component's Prometheus endpoint and `sinks`
writes each learner step's metrics to TensorBoard and Weights & Biases under the same names.
Everything above imports downwards only (tests/test_architecture.py keeps it so).
"""
