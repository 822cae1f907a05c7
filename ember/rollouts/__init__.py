"""Rollout ETL on Kafka: producers, filtering, reward joins, advantages, training batches."""
