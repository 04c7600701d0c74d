"""The learner: from stored trajectories to the next policy version.

    from hpcrl.rl.learner.service import run_learner   # the component: read, train, publish

`batch` groups trajectories (staleness, token layout), `packing` lays a group out so its shared
prompt is computed once, `algorithms` holds the losses, `reference` the KL penalty's reference
model, `schedule` the learning rate and entropy bonus, `diagnostics` the per-step statistics
of a batch; `learner` is the DeepSpeed ZeRO-3 engine (`dsconfig` its config, `collectives` its
reductions on the backend's device, `checkpoints` which checkpoint to resume from) and
`service` its loop as a run component. `inprocess` runs generator and learner in one process,
taking turns: the synchronous reference loop. The learner is the top wing: it may use the
rollout wing (evaluation, the in-process loop, the judge).
"""
