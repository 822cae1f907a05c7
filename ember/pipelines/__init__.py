"""Apache Beam corpus pipelines: read, filter, redact, deduplicate."""
