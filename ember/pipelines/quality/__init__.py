"""Quality stages: code and web filters, secret/PII redaction, benchmark decontamination, MinHash near-dedup and
its connected components, language ID, and their settings."""
