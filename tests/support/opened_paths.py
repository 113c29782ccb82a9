"""Run the real `egressd` command line and record every path it opens once the sandbox is planned.

Usage: python opened_paths.py OUT EGRESSD-ARGS...

An audit hook (sys.addaudithook) sees every file egressd's process opens, creates, renames,
removes or binds a Unix socket at, from the moment `plan_layout` returns; each is appended to OUT
as a JSON line, with the layout the sandbox was started with. The test then checks the child could
write none of them. OUT is opened before the hook is armed and written with os.write, so recording
never records itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

WRITE_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.chmod", "os.symlink", "os.link",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}  # fmt: skip
TWO_PATHS = {"os.rename", "os.symlink", "os.link", "shutil.copyfile", "shutil.move"}


def main() -> None:
    out = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    armed = [False]

    def record(entry: dict[str, object]) -> None:
        os.write(out, (json.dumps(entry) + "\n").encode())

    def hook(event: str, args: tuple[object, ...]) -> None:
        if not armed[0]:
            return
        if event == "open":
            paths = args[:1]
        elif event in WRITE_EVENTS:
            paths = args[:2] if event in TWO_PATHS else args[:1]
        elif event == "socket.bind" and len(args) > 1 and isinstance(args[1], str | bytes):
            paths = [args[1]]
        else:
            return
        for path in paths:
            if not isinstance(path, str | bytes):
                continue  # a descriptor: opened by path before, or handed over
            text = os.fsdecode(path)
            if text and not text.startswith("\0"):  # an abstract socket name is not a path
                record({"event": event, "path": text, "cwd": os.getcwd()})

    sys.addaudithook(hook)
    import egressd.cli.sandbox as cli

    plan = cli.plan_layout

    def planned(*args: object, **kwargs: object) -> object:
        layout = plan(*args, **kwargs)
        armed[0] = True
        return layout

    def keep(run):  # type: ignore[no-untyped-def]
        def started(session, creds, command, layout, **kwargs):  # type: ignore[no-untyped-def]
            # the start-up walk (`before`) is the exit summary's, not where anything is mounted
            shown = dataclasses.replace(layout, before=None)
            record({"layout": dataclasses.asdict(shown), "environ": dict(os.environ)})
            return run(session, creds, command, layout, **kwargs)

        return started

    cli.plan_layout = planned
    cli.run_bwrap = keep(cli.run_bwrap)
    cli.run_seatbelt = keep(cli.run_seatbelt)
    sys.argv = ["egressd", *sys.argv[2:]]
    from egressd.entry import main as egressd_main

    egressd_main()


if __name__ == "__main__":
    main()
