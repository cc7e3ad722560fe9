"""Hardware-aware tree planner: decides which candidate trees to verify per decoding step."""
from planner.accept import Acceptance, load_acceptance
from planner.errors import UserError
from planner.profile import LatencyProfile, load_profile
from planner.tree import Tree, TreeState, load_tree, save_tree

__version__ = "0.1.0"
__all__ = [
    "Acceptance", "LatencyProfile", "Tree", "TreeState", "UserError",
    "load_acceptance", "load_profile", "load_tree", "save_tree",
]
