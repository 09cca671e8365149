"""Switch planning: routing (who sends what), rank assignment, and the round schedule. Pure Python and numpy."""

from dynatrain.planner.assignment import Assignment
from dynatrain.planner.network import NetworkModel
from dynatrain.planner.route_table import route
from dynatrain.planner.routing import Routing, Transfer
from dynatrain.planner.schedule import Message, RankPlan, Round, SwitchPlan, plan_switch

__all__ = [
    "Assignment", "NetworkModel", "Routing", "Transfer", "route",
    "Message", "RankPlan", "Round", "SwitchPlan", "plan_switch",
]
