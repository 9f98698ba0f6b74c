"""The user interface: TOML + `--section.key value` overrides -> a validated `JobConfig`.

- `base.py`: field checks, coercion and CLI parsing shared by every section;
- `sections.py`: one dataclass per TOML section (job, model, training, ...);
- `job.py`: `JobConfig`, loading, cross-section checks, saving;
- `reference.py`: every key with its type, default and doc (`--help`, docs/config.md);
- `__main__.py`: `python -m trainer.config` (the launchers' `--check`, `--help`).
"""
