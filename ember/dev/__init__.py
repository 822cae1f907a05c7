"""Local development services (Kafka, Slurm, Flink job-server jar) driven by the scripts in infra/."""
