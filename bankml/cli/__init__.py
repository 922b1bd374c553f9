"""The ``bankml`` command: one argparse parser with a subparser for each subcommand.

``main`` (built in ``bankml.cli.app``) is the console script's entry point; each module here adds
its own commands: ``gate`` (guard, sha256, pin, verify), ``text`` (tokenize, chat-template),
``generate``; ``serve`` hands its arguments to the twistd plugin's options (``bankml.tap``). This
package is the top layer: nothing else in bankml imports it (an import-linter contract in
pyproject.toml keeps it so).
"""

from bankml.cli.app import main

__all__ = ["main"]
