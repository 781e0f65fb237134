"""The `semcache` command line: one module per command group, joined by ``parser``."""

from server.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
