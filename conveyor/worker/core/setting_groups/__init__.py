"""The groups of ``Settings`` (``conveyor.worker.core.settings``), one class per group: its
fields, each with the one-line comment the settings reference is built from, and what reads
only that group. ``Settings`` inherits them all, so every field keeps its flat name and its
``CONVEYOR_*`` variable."""
