"""Reading the learner's audit log (learner/trained.jsonl): the package's own reader (rl/audit.py)."""

from hpcrl.rl.audit import lineage

__all__ = ["lineage"]
