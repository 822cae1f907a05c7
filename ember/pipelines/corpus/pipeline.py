"""`ember corpus build` as one Beam graph: read -> unique ids -> filter -> quality classifier -> redact -> decontaminate
-> exact dedup -> near dedup -> write (dedup sees documents without their text, joined back at the write; the classifier only with `filters.classifier`, decontamination only with a
`decontamination:` section).

The graph is a list of stages folded in order: each stage (ember/pipelines/corpus/stages.py) takes
the previous one's documents and returns a `StageOutput`; the rejects, clusters and stats events of
all stages are flattened once and written with the kept documents (ember/pipelines/corpus/outputs.py).
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from ember.pipelines.corpus.config import CorpusConfig
from ember.pipelines.corpus.decontaminate import decontaminate_stage
from ember.pipelines.corpus.incremental import near_dedup_stage
from ember.pipelines.corpus.outputs import require_empty_output, write_outputs
from ember.pipelines.corpus.stages import (
    CLUSTER_TEXT_FIELDS, DEDUP_TRANSFORMS, REJECT_TEXT_FIELDS, ClassifyDocuments, ExactDedup, FilterDocuments, PerDocument,
    ReadSources, RedactDocuments, RedactRows, SplitText, StageOutput, UniqueIds,
)
from ember.pipelines.jobs.runners import run_pipeline


def corpus_stages(config: CorpusConfig, progress_dir: str | None = None) -> list[beam.PTransform]:
    """The stages `config` asks for, in the order they run."""
    stages: list[beam.PTransform] = [ReadSources(config.sources, progress_dir, config.max_tree_file_bytes)]
    # a files source's ids are repo/path: two checkouts of one remote share them
    id_sources = frozenset(s.name for s in config.sources if s.fields.id is not None or s.format == "files")
    if id_sources:
        stages.append(UniqueIds(id_sources))
    stages.append(PerDocument(FilterDocuments(config.filters, progress_dir), counted=True))
    if config.filters.classifier is not None:
        stages.append(PerDocument(ClassifyDocuments(config.filters.classifier, progress_dir), counted=True))
    stages.append(PerDocument(RedactDocuments(config.redaction, progress_dir), counted=False))
    if config.decontamination is not None:
        stages.append(decontaminate_stage(config.decontamination, progress_dir))
    if config.dedup.exact:
        stages.append(ExactDedup(config.dedup, progress_dir))
    if config.dedup.near:
        stages.append(near_dedup_stage(config, progress_dir))
    return stages


def build_pipeline(p: beam.Pipeline, config: CorpusConfig, progress_dir: str | None = None) -> None:
    """Add the whole corpus build to `p` (inputs must already have passed `check_inputs`)."""
    documents, outputs, texts = p, [], None
    for stage in corpus_stages(config, progress_dir):
        if isinstance(stage, DEDUP_TRANSFORMS) and texts is None:
            documents, texts = documents | "SplitText" >> SplitText(config.dedup)
        output = documents | stage
        outputs.append(output)
        documents = output.documents
    rejects, clusters, stats = (
        [getattr(o, name) for o in outputs] | f"All{name.title()}" >> beam.Flatten()
        for name in ("rejects", "clusters", "stats")
    )
    rejects = rejects | "RedactRejects" >> RedactRows(config.redaction, REJECT_TEXT_FIELDS)
    clusters = clusters | "RedactClusters" >> RedactRows(config.redaction, CLUSTER_TEXT_FIELDS)
    write_outputs(StageOutput(documents, rejects, clusters, stats), config, progress_dir, texts)


def run(config: CorpusConfig, options: PipelineOptions, progress_dir: str | None = None, wait: bool = True) -> str:
    """Submit the build into an empty or new output directory; with `wait`, block until it ends.
    Returns the job state Beam reports."""
    require_empty_output(config.output.directory)
    p = beam.Pipeline(options=options)
    build_pipeline(p, config, progress_dir)
    if not wait:
        return str(p.run().state)
    return run_pipeline(p, options, "corpus build")
