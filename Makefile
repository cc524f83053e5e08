# The two commands a newcomer needs: `make run` and `make test`. Both set everything up first.
.PHONY: setup run test

setup:
	bash .ci/setup

# A 3-node NoLoCo swarm on loopback: tiny model, this interpreter's stdlib as the corpus.
run: setup
	.venv/bin/lowcomm-node local-swarm --swarm local --nodes 3 --max-steps 300

# Two workers, each taking whole test files (tests/conftest.py): most integration tests wait on
# daemons' rounds with a core to spare. --durations: the slowest tests, to keep the suite within
# CI's 20 minutes on 2 cores.
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests
