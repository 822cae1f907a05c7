"""Entry point of the Dataflow flex template (infra/dataflow/): `--config gs://.../corpus.yaml` plus
the pipeline options the template launcher passes. It submits the job and returns without waiting:
the launcher VM is not meant to outlive the submit. stats.json is written by the job itself;
`ember corpus report gs://OUT` renders report.md afterwards.
"""

from __future__ import annotations

import argparse

from ember.pipelines.corpus import pipeline
from ember.pipelines.corpus.build import prepare_options
from ember.pipelines.corpus.config import check_inputs, load_config


def parser() -> argparse.ArgumentParser:
    """The template's own parameters; infra/dataflow/metadata.json must declare exactly these."""
    p = argparse.ArgumentParser(prog="ember-corpus-flex-template")
    p.add_argument("--config", required=True, help="corpus build YAML on any Beam filesystem (gs://...)")
    return p


def main(argv: list[str] | None = None) -> str:
    known, beam_args = parser().parse_known_args(argv)
    config = load_config(known.config)
    _, options = prepare_options(beam_args)
    check_inputs(config)
    return pipeline.run(config, options, wait=False)


if __name__ == "__main__":
    main()
