"""Real-time RL from product traffic (issue 34): served completions joined to user events hours later.

Pure logic over stdlib sqlite3: no Kafka, Beam or torch here (an import-linter contract says so); the
Kafka service feeds `ProductJoin` the same way it feeds the group engine.
"""
