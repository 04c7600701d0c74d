"""What a run recorded of itself, read back.

`audit` checks the learner's lineage log (what each step trained on) against the store;
`trace` follows one trajectory's life through the coordinator's logs, the store and the audit
(`hpcrl traj trace`).
"""
