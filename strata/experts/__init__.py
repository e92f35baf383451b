"""Routed-expert computation: the reference executor now; arena, cache, planner and miss paths
build on the same interface."""

from strata.experts.reference import ExpertExecutor, ReferenceExperts

__all__ = ["ExpertExecutor", "ReferenceExperts"]
