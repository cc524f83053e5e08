"""N replicas in one process, exchanging through memory with the round code the daemon runs.

    from node.simulator import SimulationSettings, run_simulation
    result = run_simulation(SimulationSettings("noloco", workers=8, rounds=10), load_config())

NoLoCo and DiLoCoX replicas run the daemon's own round classes (node/rounds/: contribution
checks, overlap correction, catch-up, delayed outer step, resync) over in-memory links; the
baselines (data-parallel, DiLoCo, local) are collectives.

Modules: settings (what to run, as the manifest sections the rounds take), replica (a trainer
per node), exchange (simulated time, latency, loss, byte counts), noloco_link and dilocox_link
(the in-memory links and their networks), lockstep (the replicas' ends of a round, together),
decoding (DiLoCoX decodings shared), methods/ (the collectives; rounds.py drives the round
classes), runner (the round loop and the measurements), report (JSON, plot, table), cli
(`lowcomm-node simulate`).

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
