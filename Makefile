# The two commands a newcomer needs: `make run` and `make test`. Each sets up what it needs first:
# run only the node (.ci/setup-run: .venv, torch, lowcomm-node; no Debian package), test the node
# and the suite's tools too (.ci/setup: extras, mosquitto, tmux, docker.io, ... as root).
.PHONY: setup setup-run run test

setup-run:
	bash .ci/setup-run

setup:
	bash .ci/setup

# A 3-node NoLoCo swarm on loopback: tiny model, this interpreter's stdlib as the corpus.
run: setup-run
	.venv/bin/lowcomm-node local-swarm --swarm local --nodes 3 --max-steps 300

# Two workers, each taking whole test files (tests/conftest.py): most integration tests wait on
# daemons' rounds with a core to spare. --durations: the slowest tests, to keep the suite within
# CI's 20 minutes on 2 cores.
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests
