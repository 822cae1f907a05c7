"""The task set the sampler prompts with: JSONL, one task per line, `prompt_id` (or HumanEval's `id`) and `prompt`.

Only the two fields the sampler needs are read (the graders read the rest: tests, entry points). A line that
is not such an object is rejected with its file and line named and counted, never fatal: one bad task must not
stop a fleet. Ids must be unique, since a group id is built from one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ember.schemas.rollouts import MAX_ID_CHARS
from ember.schemas.wire_json import DecodeError, parse_json


@dataclass(frozen=True)
class Task:
    prompt_id: str
    prompt: str


@dataclass
class TaskSet:
    tasks: list[Task] = field(default_factory=list)
    rejects: list[str] = field(default_factory=list)  # "file:line: reason", one per rejected line


def _task(raw: bytes, where: str) -> Task:
    value = parse_json(raw, where)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    prompt_id = value.get("prompt_id", value.get("id"))
    if not isinstance(prompt_id, str) or not 0 < len(prompt_id) <= MAX_ID_CHARS - 40:
        raise ValueError(f"prompt_id (or id) must be a string of 1 to {MAX_ID_CHARS - 40} characters")
    prompt = value.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    return Task(prompt_id, prompt)


def read_tasks(path: Path) -> TaskSet:
    """Every well-formed task of `path` in file order; OSError when the file itself cannot be read."""
    found = TaskSet()
    seen: set[str] = set()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                task = _task(raw, where)
                if task.prompt_id in seen:
                    raise ValueError(f"prompt_id {task.prompt_id!r} repeats an earlier line")
            except (DecodeError, ValueError) as exc:
                found.rejects.append(f"{where}: {str(exc).removeprefix(where + ': ')}")
                continue
            seen.add(task.prompt_id)
            found.tasks.append(task)
    return found
