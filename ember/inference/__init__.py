"""The inference worker (`ember rollouts sample`): rollouts sampled from published weights by transformers.

It sits above `ember.midtrain` (the one export reader lives there) and `ember.rollouts` (Kafka transport),
so neither has to import the other.
"""
