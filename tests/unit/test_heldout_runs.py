"""benchmarks/heldout.py and ladder.py never take a run of a swarm protocol's earlier defaults
for today's: NoLoCo's and DiLoCoX's run files name the manifest schema version whose defaults
they ran, and (heldout.py) a file whose recorded [protocol] section differs from what its job
runs now stops the table."""

import sys
from pathlib import Path

import pytest

from node.config.manifest import SCHEMA_VERSIONS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def heldout():
    path = list(sys.path)  # heldout.py puts benchmarks/ and the root first: undone after
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import heldout
        yield heldout
    finally:
        sys.path[:] = path


def test_a_swarm_protocols_run_names_its_schema_version_and_the_others_serve_every_version(heldout):
    for setting in heldout.SETTINGS:
        for method in heldout.METHODS:
            key = setting.job(method).key
            if method in SCHEMA_VERSIONS:
                assert f"-{method}.v{SCHEMA_VERSIONS[method]}-" in key
                earlier = setting.job(method, {**SCHEMA_VERSIONS, method: SCHEMA_VERSIONS[method] + 1})
                assert earlier.key != key
            else:
                assert setting.job(method, {}).key == key and ".v" not in key


def test_a_run_file_that_ran_other_protocol_values_than_its_name_says_is_refused(heldout):
    from grid_jobs import protocol_section
    job = heldout.SETTINGS[0].job("dilocox")
    recorded = protocol_section(job.settings())
    heldout.check_current({job.key: {"protocol_section": recorded}})  # as it runs now: accepted
    heldout.check_current({job.key: {}})  # recorded nothing (an older run file): accepted
    recorded["outer_momentum"] += 0.1
    with pytest.raises(SystemExit, match=r"ran other \[protocol\] values than dilocox/\d+'s defaults "
                                          r"\(outer_momentum\)"):
        heldout.check_current({job.key: {"protocol_section": recorded}})


def test_the_ladders_runs_name_the_schema_version_of_noloco_and_dilocox_too(heldout):
    import ladder  # benchmarks/ is on the path while `heldout` is in use
    budget = ladder.Budget()
    for method, (name, _) in ladder.METHODS.items():
        key = ladder.job(ladder.SIZES[0], method, 0, budget).key
        if name in SCHEMA_VERSIONS:
            assert f"-{name}.v{SCHEMA_VERSIONS[name]}-" in key, key
        else:
            assert ".v" not in key, key
