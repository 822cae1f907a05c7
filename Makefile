# The two README commands. Each sets everything up on a fresh machine first.
.PHONY: demo test setup bench

demo: setup
	.venv/bin/ember demo

test:
	bash infra/test.sh

setup:
	bash infra/setup-env.sh

bench: setup
	.venv/bin/python bench/bench_codec.py
