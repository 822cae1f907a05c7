"""Web input: WARC records, HTML to text, and the URL block-list; pure Python, no Beam, Kafka or torch."""
