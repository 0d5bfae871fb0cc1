"""Testing helpers for podium users and backend authors: the conformance suite."""

__all__ = ["conformance"]
