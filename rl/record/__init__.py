"""The trajectory record, once: its fields, its checks, its columnar form.

    from hpcrl.rl.record.trajectory import Trajectory, Step   # one episode, checked on construction
    from hpcrl.rl.record.columns import Columns               # a batch: two tables, three flat arrays

`trajectory` is the record a generator produces and the learner trains on; `checks` holds every
rule its values must pass, once, in the two forms they are applied in (one value, a column);
`columns` is the one layout a batch of them has outside a generator (the wire sends it, a store
segment keeps it) and checks a batch as it arrived by the same rules, vectorized (`flat` its
offsets and reusable encode buffers); `tables` holds the record
tables' dtypes and upgrades an older schema's; `synth` makes synthetic trajectories with
realistic shapes for benchmarks and drills. This wing imports no other wing of rl/.
"""
