"""``semcache prepare``: everything a config's first start would make, made now.

The model folders the gateway converts (``prepared:NAME``), the revisions of every model
folder, and the checked ONNX graphs of the sentence encoders (the embeddings backends', the
semantic cache's and the embedded classifier's): an image build runs it once, so that a
container starts in seconds and never writes beside its models.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from server.app import registry_from_config
from server.cli.console import load_or_exit, say
from server.cli.options import env_option
from server.encoders import load_encoder


async def _load_embeddings(config_path: str | None) -> None:
    config = load_or_exit(config_path)
    registry = registry_from_config(config)  # prepares vLLM models, hashes every model folder
    for name, backend in registry.embedding.items():
        await backend.start()
        say(f"embeddings backend {name}: ready")
        await backend.aclose()


def cmd_prepare(args: argparse.Namespace) -> int:
    started = time.monotonic()
    config = load_or_exit(args.config)
    say(f"data directory {config.data_path()}, encoder graphs {config.encoder_path()}")
    asyncio.run(_load_embeddings(args.config))
    encoder = load_encoder(graph_dir=config.encoder_path())
    say(f"cache encoder {encoder.version} on {encoder.runtime}: ready")
    say(f"prepared in {time.monotonic() - started:.0f} s")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prepare = commands.add_parser(
        "prepare",
        help="convert and check the config's models now (what a first start would do)",
        description="Convert the models the config prepares (prepared:NAME), hash every model "
        "folder and export and check the sentence encoders' ONNX graphs, then exit. For "
        "image builds: the first start of a container is then as fast as any other.",
    )
    env_option(prepare, "--config")
    prepare.set_defaults(func=cmd_prepare)
