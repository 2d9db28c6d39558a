"""The options that give a package's manifest its router metadata, shared by `expert pack` and
`expert train` (so neither command module imports the other)."""

from __future__ import annotations

import argparse


def add_metadata_options(parser) -> None:
    """The manifest's router metadata besides name, version and description (`pack` and `train`)."""
    parser.add_argument("--keywords", default="", metavar="A,B,...", help="comma-separated keywords")
    parser.add_argument("--capabilities", default="", metavar="A,B,...", help="comma-separated capabilities")
    parser.add_argument("--task-types", default="", metavar="A,B,...", help="comma-separated task types")
    parser.add_argument(
        "--priority", type=int, default=0, help="router priority in [-1000, 1000] (default 0)"
    )
    parser.add_argument(
        "--incompatible-with", default="", metavar="A,B,...", help="experts never to combine with"
    )
    parser.add_argument("--author", default="", help="who made the expert")


def metadata_from(args: argparse.Namespace, examples: tuple[str, ...] = ()):
    """The `ExpertMetadata` the options of `add_metadata_options` (and name, version, description) give."""
    from libs.experts.packing import ExpertMetadata

    return ExpertMetadata(
        name=args.name,
        version=args.version,
        description=args.description,
        keywords=split_list(args.keywords),
        examples=examples,
        capabilities=split_list(args.capabilities),
        task_types=split_list(args.task_types),
        priority=args.priority,
        incompatible_with=split_list(args.incompatible_with),
        author=args.author,
    )


def split_list(value: str) -> tuple[str, ...]:
    """ "a, b,,c" -> ("a", "b", "c")."""
    return tuple(part.strip() for part in value.split(",") if part.strip())
