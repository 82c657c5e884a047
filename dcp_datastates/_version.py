"""The package version, in a module nothing else imports from (the bottom layer)."""

__version__ = "0.1.0"
