"""Subcommands of `tiergate`; each module defines register(subparsers) and sets func."""
