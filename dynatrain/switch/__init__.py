"""The one switch driver and its stages (`driver`, `moves`): capture, plan, prepare target, release, move, build,
adopt, verify, report. Talks to the training framework only through a `SwitchContext` (`context`); knows no
Lightning and no model class."""
