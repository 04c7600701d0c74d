"""The trajectory store: HDF5 shards on the parallel filesystem, the durable truth the learner trains from.

    from hpcrl.rl.store.writer import ShardWriter        # buffer, flush, acknowledge only what is durable
    from hpcrl.rl.store.reader import StoreReader        # arrival order, exactly-once cursor
    from hpcrl.rl.store.stream import TrajectorySender   # generators -> writer over CURVE ZeroMQ, acked

A segment stores a batch in the record's columnar form (`hpcrl.rl.record.columns`). `layout` is
the on-disk shape (shards of immutable segments, manifests, recovery and quarantine) and why it
survives a kill at any moment; `index` is each finalized shard's id index and per-domain sums,
which a restarted writer's dedup check, `hpcrl report` and `hpcrl traj show` read instead of the
segments; `writer` and `reader` are its two sides (`sync` the writer's sync thread, `shards` the
shards it opens, retires and finalizes, `lease` who holds a shard and what a writer name
stored); `stream` is the acknowledged, deduplicated delivery from generators to the writer that
feeds it; `verify` lists and checks a store and finalizes what dead writers left open (`hpcrl
traj ls`, `verify`), by the run's `store.lease_s`.
"""
