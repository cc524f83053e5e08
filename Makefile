# The two commands a newcomer needs: `make run` and `make test`. Both set everything up first.
.PHONY: setup run test

setup:
	bash .ci/setup

run: setup
	.venv/bin/lowcomm-node train --config configs/train-tiny.toml

test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider tests
