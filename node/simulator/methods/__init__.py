"""The simulated methods, one class per protocol, all driven round by round by the runner."""

from node.simulator.methods.base import Method, MethodCounters
from node.simulator.methods.collective import DataParallel, DiLoCoBaseline, LocalOnly
from node.simulator.methods.dilocox import DiLoCoXSwarm
from node.simulator.methods.noloco import NoLoCoSwarm

METHODS: dict[str, type[Method]] = {
    "data-parallel": DataParallel,
    "diloco": DiLoCoBaseline,
    "noloco": NoLoCoSwarm,
    "dilocox": DiLoCoXSwarm,
    "local": LocalOnly,
}

__all__ = ["METHODS", "DataParallel", "DiLoCoBaseline", "DiLoCoXSwarm", "LocalOnly", "Method",
           "MethodCounters", "NoLoCoSwarm"]
