"""The `egressd` command's entry point: `exec --attach` before anything else is imported.

An attached child's start-up is egressd's overhead on every tool an agent spawns, so a plain
`egressd exec --attach ... -- CMD` goes straight to egressd.child.attach (standard library and a few small
modules); every other command line goes to the click CLI, which imports nothing more for it.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["exec"] and "--attach" in argv:
        from egressd.child import attach

        attach.main(argv)  # returns only when the command line is not a plain attach
    from egressd.cli import main as cli_main

    cli_main()
