"""Running a pipeline as a job: runner choice and options, the job process and its signals, job logs, progress
reporting, and the output guard that refuses to overwrite what is not ember's."""
