"""Moved: ``parallelize`` and the plan types live in ``overlap.nn`` now. This module keeps
``from overlap.tp.parallelize import TPPlan, parallelize, ...`` (the old README form) working."""

from overlap.nn.parallelize import gather_grads, gather_state_dict, parallelize
from overlap.nn.plan import STYLES, Style, TPPlan

__all__ = ["Style", "TPPlan", "STYLES", "parallelize", "gather_state_dict", "gather_grads"]
