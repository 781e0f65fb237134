"""``python -m server.cli``: the `semcache` command."""

from server.cli.parser import main

if __name__ == "__main__":
    raise SystemExit(main())
