"""Tasks: what data a run trains on and how it is protected, split, encoded and scored.

Built-in: ``dicom-classification`` (:mod:`.dicom`) and ``tabular-classification`` (:mod:`.tabular`);
any object following :class:`securetrain.pipeline.tasks.base.Task` can be named with
``task.target: "package.module:callable"`` (see ``docs/tasks.md``).
"""

from __future__ import annotations

from securetrain.pipeline.tasks.base import Task, TaskContext, TaskData, resolve_task

__all__ = ["Task", "TaskContext", "TaskData", "resolve_task"]
