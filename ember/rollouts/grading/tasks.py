"""Task sets: the prompts a policy was asked, with what checks its answers, found by `prompt_id`.

A task set is JSONL (optionally gzipped) or Parquet, one task per record, in the form `ember corpus benchmarks
fetch humaneval` writes (id, prompt, solution, tests, entry_point); other sets name their keys in the config's
`tasks.fields`, as decontamination's benchmark files do. The set is the grader's configuration, so a bad record
stops the start with one line naming file:line (or the Parquet row) and the reason: a grader running on half a
task set would dead-letter the other half's rollouts as unknown prompts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path


from ember.files import read_records, record_format
from ember.rollouts.grading.base import Task

MAX_LINE_BYTES = 16 * 2**20
TASK_FIELDS = ("id", "prompt", "tests", "entry_point", "reference")
"""The keys of `fields`: a Task's attributes (`id` is the rollouts' `prompt_id`)."""


class TaskSetError(ValueError):
    """A task set that cannot be used; the message names the file and the line or row."""


def task_format(path: str | Path) -> str:
    return record_format(path, TaskSetError, "task set", "tasks.format")


def _records(path: Path, fmt: str) -> Iterator[tuple[str, Mapping[str, object]]]:
    return read_records(path, fmt, TaskSetError, MAX_LINE_BYTES)


def _text(value: object, where: str, key: str) -> str:
    """A field's text: a string, or a list of strings (MBPP's test_list) joined by newlines."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)
    if not isinstance(value, str):
        raise TaskSetError(f"{where}: field {key!r} holds {type(value).__name__}, expected text or a list of texts")
    return value


def _task(record: Mapping[str, object], fields: Mapping[str, str | None], where: str) -> Task:
    values: dict[str, str] = {}
    for name in TASK_FIELDS:
        key = fields.get(name)
        if key is None:
            continue
        value = record.get(key)
        if value is None:
            if name in ("id", "prompt"):
                raise TaskSetError(f"{where}: no {name} field {key!r}; the record has {sorted(record)[:10]}")
            continue
        values[name] = str(value) if name == "id" and isinstance(value, int) else _text(value, where, key)
    if not values["id"]:
        raise TaskSetError(f"{where}: the id field {fields['id']!r} is empty")
    return Task(prompt_id=values.pop("id"), **values)


def load_tasks(path: str | Path, fields: Mapping[str, str | None], fmt: str | None = None) -> dict[str, Task]:
    """prompt_id -> Task for every record of the file; `fields` maps TASK_FIELDS to record keys (None: absent)."""
    path = Path(path)
    if not path.is_file():
        raise TaskSetError(f"{path}: task set not found (HumanEval: `ember corpus benchmarks fetch humaneval --out DIR`)")
    tasks: dict[str, Task] = {}
    for where, record in _records(path, fmt or task_format(path)):
        task = _task(record, fields, where)
        if task.prompt_id in tasks:
            raise TaskSetError(f"{where}: task id {task.prompt_id!r} repeats")
        tasks[task.prompt_id] = task
    if not tasks:
        raise TaskSetError(f"{path}: the task set holds no task")
    return tasks
