# The README commands. Each sets everything up on a fresh machine first.
.PHONY: demo test setup bench

demo: setup
	.venv/bin/ember demo

test:
	bash infra/test.sh

setup:
	bash infra/setup-env.sh

# Every benchmark, quick profile (<= 15 min on 2 cores) into bench/results.json; services first, some need them.
# make bench BENCH_ARGS=--full for the sizes BENCHMARKS.md quotes; BENCH_ARGS="--only codec etl" for a subset.
bench: setup
	.venv/bin/ember dev up
	.venv/bin/python bench/run_all.py $(BENCH_ARGS)
