"""What every wing of rl/ may use: nothing here imports another wing.

`registry` holds the named registries (domains, rewards, algorithms) with their did-you-mean
errors, `meter` the busy fraction over a sliding window, `distenv` a process's rank in the
learner's group and the run's own authenticated rendezvous store for torch.distributed (the
learner's group and the direct weight path's).
"""
