"""The simulated methods, all driven round by round by the runner: the collectives (data-parallel,
DiLoCo, local training) here, NoLoCo and DiLoCoX through the daemon's own round classes."""

from node.simulator.methods.base import Method, MethodCounters
from node.simulator.methods.collective import DataParallel, DiLoCoBaseline, LocalOnly
from node.simulator.methods.rounds import RoundSwarm

METHODS: dict[str, type[Method]] = {
    "data-parallel": DataParallel,
    "diloco": DiLoCoBaseline,
    "noloco": RoundSwarm,
    "dilocox": RoundSwarm,
    "local": LocalOnly,
}

__all__ = ["METHODS", "DataParallel", "DiLoCoBaseline", "LocalOnly", "Method", "MethodCounters",
           "RoundSwarm"]
