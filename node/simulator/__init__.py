"""N replicas in one process, exchanging through memory with the protocol code the daemon runs.

    from node.simulator import SimulationSettings, run_simulation
    result = run_simulation(SimulationSettings("noloco", workers=8, rounds=10), load_config())

Modules: settings (what to run), replica (a trainer per node), exchange (simulated time,
latency, loss, byte counts), methods/ (one class per protocol), runner (the round loop and the
measurements), report (JSON, plot, table), cli (`lowcomm-node simulate`).

The package imports lazily: `node.simulator.cli` must not pull torch in when the CLI starts.
"""

import importlib

_EXPORTS = {"RoundRecord": "runner", "SimulationResult": "runner", "run_simulation": "runner",
            "Simulation": "runner",
            "PROTOCOLS": "settings", "SimulationError": "settings", "SimulationSettings": "settings"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"node.simulator.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'node.simulator' has no attribute {name!r}")
