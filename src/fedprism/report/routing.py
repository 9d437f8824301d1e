"""The name under which the committed reports cite the routing choice of FedPrism (dual-stream): the rule
lives with its method, in `fedprism.algorithms.fedprism_dual.routing`, and the report reaches it through
the method's `report_sections`; this module only keeps the cited path importable."""

from fedprism.algorithms.fedprism_dual.routing import MARGIN, Choice, choose_routing, routing_choice_table

__all__ = ["MARGIN", "Choice", "choose_routing", "routing_choice_table"]
